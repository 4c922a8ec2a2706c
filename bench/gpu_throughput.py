"""GPU training throughput: lmforge vs nanoGPT (GPT-2 124M) and vs transformers' Llama (two sizes).

Each row runs lmforge's training step and its competitor in one process, interleaved step by step (the
order alternating every round), on the same batches, from the same weights, and reports medians:

    row      layout                                       batch      competitor
    gpt2     GPT-2 124M: 12L d768 12H, vocab 50304         16 x 1024  nanoGPT's model.py + its train loop
    llama    Llama 12L d768 12H ff2048 untied, vocab 32000 16 x 1024  transformers LlamaForCausalLM
    llama1b  Llama 16L d2048 16H ff5632, vocab 32000       4 x 2048   transformers LlamaForCausalLM

    python bench/gpu_throughput.py --nanogpt ~/nanoGPT        # on a GPU: the three rows
    python bench/gpu_throughput.py --memory                   # train.loss_chunk_tokens, GPT-2 124M, 32 x 1024
    python bench/gpu_throughput.py --tiny                     # tiny shapes of the same layouts (CPU default)

On CUDA: bf16 autocast over fp32 weights on every side, torch.compile (--no-compile: eager), fused
AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1), clip 1.0, TF32 matmuls allowed (nanoGPT's train.py
sets it; it is process-wide, so every side gets it).
- lmforge: what `lmforge train` runs per step: the run `build_run` assembles (train.compile: model and
  loss compiled as one graph), stepped by `run.parallel.step([(x, y)], ...)` as the Trainer steps between
  log steps (defer=True where lmforge has it: no host synchronisation inside the step).
- nanoGPT: a checkout the user provides (`--nanogpt PATH` or LMFORGE_NANOGPT; bench/nanogpt_ref.py): its
  GPT(bias=True, dropout 0), its configure_optimizers (fused AdamW on CUDA), torch.compile(model) as its
  train.py does, and its loop's step (forward with targets under autocast, backward, clip 1.0, step,
  zero_grad(set_to_none=True)). Without a checkout the row is skipped, saying how to get one.
- transformers: LlamaForCausalLM (sdpa attention), torch.compile(model), `model(input_ids=x, labels=x)`
  under autocast, backward, clip_grad_norm_ 1.0, fused AdamW, zero_grad(set_to_none=True).
Before timing, lmforge's weights are copied into the competitor and the fp32 initial losses must agree
to 1e-4 (TF32 off for the check). Step times include a CUDA synchronise at the end of each step.

MFU = lmforge.models.flops.flops_per_token (6N + causal attention, the same formula for both sides: same
shape) x tokens/s / peak: the datasheet peak on known GPUs (lmforge.metrics.throughput: H100 SXM and
H200 bf16 dense 989e12, A100 312e12, ...), else (CPU, unknown GPU) a measured matmul; the JSON and the
table say which. On CPU the peak is an fp32 matmul timed in every round, as in train_throughput.py.
Peak memory per side = its parameters and optimizer state + the largest rise of
torch.cuda.max_memory_allocated over a step of it: what the side would hold alone.

Without CUDA (or with --tiny) the rows run at tiny shapes of the same layouts in fp32, eager unless
--compile, in well under a minute on 2 cores: the code path and the same-function checks, not numbers
to compare with the targets (>= 1.10x nanoGPT, >= 1.10x transformers, >= 1.25x and >= 48% MFU at 1.1B).

nanochat is not compared here: see train_throughput.py's docstring (PyPI's `nanochat` holds no model).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lmforge.config.schema import ModelConfig
from lmforge.metrics.throughput import peak_flops
from lmforge.models.flops import count_params, flops_per_token
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)
from nanogpt_ref import (  # bench/nanogpt_ref.py
    build_nanogpt,
    find_nanogpt,
    gpt2_config,
    load_nanogpt,
    nanogpt_optimizer,
    nanogpt_stepper,
)
from nanogpt_ref import check_same_function as check_same_function_nanogpt
from train_throughput import (  # bench/train_throughput.py
    assemble,
    batches_of,
    check_same_function,
    hf_config,
    lmforge_config,
    peak_probe,
    stepper,
)

RESULTS = Path(__file__).resolve().parent / "results"

# The rows (targets: competitor ms / lmforge ms on an H100, and MFU for llama1b).
ROWS = {
    "gpt2": dict(layout="gpt2", n_layers=12, n_heads=12, d_model=768, seq_len=1024, batch=16, vocab=50304,
                 target_ratio=1.10),
    "llama": dict(layout="llama", n_layers=12, n_heads=12, d_model=768, d_ff=2048, seq_len=1024, batch=16,
                  vocab=32000, target_ratio=1.10),
    "llama1b": dict(layout="llama", n_layers=16, n_heads=16, d_model=2048, d_ff=5632, seq_len=2048, batch=4,
                    vocab=32000, target_ratio=1.25, target_mfu=0.48),
}
# Tiny shapes of the same layouts: milliseconds per step on a CPU.
TINY_ROWS = {
    "gpt2": dict(layout="gpt2", n_layers=2, n_heads=4, d_model=64, seq_len=64, batch=4, vocab=256),
    "llama": dict(layout="llama", n_layers=2, n_heads=4, d_model=64, d_ff=176, seq_len=64, batch=4,
                  vocab=256),
    "llama1b": dict(layout="llama", n_layers=2, n_heads=4, d_model=128, d_ff=352, seq_len=128, batch=2,
                    vocab=512),
}
# --memory: GPT-2 124M at 32 x 1024 (tiny: a vocabulary large enough that its logits dominate).
MEMORY = dict(n_layers=12, n_heads=12, d_model=768, seq_len=1024, vocab=50304, batch=32, chunks=(4096, 8192))
TINY_MEMORY = dict(n_layers=2, n_heads=4, d_model=64, seq_len=128, vocab=8192, batch=16, chunks=(256, 512))


def model_config(spec: dict) -> ModelConfig:
    if spec["layout"] == "gpt2":
        return gpt2_config(spec["n_layers"], spec["n_heads"], spec["d_model"], spec["seq_len"], spec["vocab"])
    base = lmforge_config(spec)  # train_throughput's Llama layout (RMSNorm, RoPE, SwiGLU, untied)
    return ModelConfig.model_validate({**base.model_dump(), "d_ff": spec["d_ff"]})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a side's parameters and optimizer state (tied tensors once): what it holds between steps."""
    tensors = list(model.parameters()) + [
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    ]
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def fp32_matmuls():
    """TF32 off: the same-function checks compare fp32 results, not a faster matmul mode's rounding."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def competitor(spec: dict, cfg: ModelConfig, run, batches, device, opts) -> tuple[str, dict]:
    """(name, {step, model, optimizer, check}) of the row's competitor, holding lmforge's weights, or
    ("", {"skipped": why}) when it cannot run here."""
    autocast = (lambda: torch.autocast(device.type, torch.bfloat16)) if opts.bf16 else contextlib.nullcontext
    if spec["layout"] == "gpt2":
        root, why = find_nanogpt(opts.nanogpt)
        if root is None:
            return "", dict(skipped=why)
        torch.manual_seed(0)
        nano = build_nanogpt(load_nanogpt(root), cfg, device)
        with fp32_matmuls():
            check = check_same_function_nanogpt(run.model, nano, cfg, *batches[0])
        opt = nanogpt_optimizer(nano, device)  # train.py: configure_optimizers, then torch.compile(model)
        call = torch.compile(nano) if opts.compile else nano
        step = nanogpt_stepper(call, opt, autocast, batches)
        return "nanogpt", dict(step=step, model=nano, optimizer=opt, check=check, checkout=str(root))

    from transformers import LlamaForCausalLM  # here: the --memory processes never need it (seconds)

    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config(cfg)).to(device).train()
    with fp32_matmuls():
        check = check_same_function(run.model, hf, cfg, *batches[0])
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    call = torch.compile(hf) if opts.compile else hf

    def step(i: int) -> torch.Tensor:
        x, _ = batches[i % len(batches)]
        with autocast():
            loss = call(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return "hf", dict(step=step, model=hf, optimizer=opt, check=check,
                      attn_implementation=hf.config._attn_implementation)


def lmforge_stepper(run, batches):
    """The Trainer's step between log steps: `run.parallel.step` with defer=True where this lmforge has it
    (the loss and skip flag stay on the device, no host synchronisation inside the step); the loss is
    read after the timed step."""
    kw = {"defer": True} if "defer" in inspect.signature(run.parallel.step).parameters else {}
    return lambda i: run.parallel.step([batches[i % len(batches)]], run.optimizer, run.precision,
                                       grad_clip=1.0, **kw)


def timed(fn, i: int, device: torch.device) -> tuple[float, float, int | None]:
    """(seconds, loss, rise of the allocated-memory peak over the step or None on CPU) of step i."""
    sync(device)
    base = None
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    loss = fn(i)
    sync(device)
    dt = time.perf_counter() - t0
    loss = loss.loss if hasattr(loss, "loss") else loss  # lmforge's StepResult (maybe deferred)
    rise = torch.cuda.max_memory_allocated(device) - base if base is not None else None
    return dt, float(loss), rise


def bench_row(name: str, spec: dict, opts) -> dict:
    device = opts.device
    cfg = model_config(spec)
    B, T = spec["batch"], spec["seq_len"]
    data, batches = batches_of(cfg.vocab_size, B, T)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    run = assemble(cfg, data, compile=opts.compile, precision="bf16" if opts.bf16 else "fp32",
                   device=device.type)
    n_params = sum(p.numel() for p in run.model.parameters())
    assert n_params == count_params(cfg)
    base, comp = competitor(spec, cfg, run, batches, device, opts)
    if "skipped" in comp:
        print(f"[{name}] skipped: {comp['skipped']}", flush=True)
        return dict(skipped=comp["skipped"])
    assert n_params == sum(p.numel() for p in comp["model"].parameters())
    check = comp["check"]
    print(f"[{name}] {cfg.n_layers}L d{cfg.d_model} {B}x{T}, {n_params / 1e6:.1f}M params: initial fp32 loss "
          f"lmforge {check['loss_lmforge']:.6f} vs {base} {check[f'loss_{base}']:.6f} "
          f"(|diff| {check['abs_diff']:.1e}) OK", flush=True)

    sides = {"lmforge": lmforge_stepper(run, batches), base: comp["step"]}
    state = {"lmforge": (run.model, run.optimizer), base: (comp["model"], comp["optimizer"])}
    # The first step of each side compiles (and allocates the optimizer state): timed apart.
    first = {k: timed(fn, 0, device) for k, fn in sides.items()}
    print(f"[{name}] first step{' (compile)' if opts.compile else ''}: " +
          ", ".join(f"{k} {v[0]:.1f} s" for k, v in first.items()) +
          "; its losses: " + ", ".join(f"{k} {v[1]:.5f}" for k, v in first.items()), flush=True)
    for i in range(1, opts.warmup + 1):
        for fn in sides.values():
            fn(i)
    probe = peak_probe(opts.peak_n) if device.type == "cpu" else None
    times = {k: [] for k in sides}
    losses = {k: [] for k in sides}
    # Not the first step's rise: it allocates the optimizer state, which resident_bytes counts.
    rises: dict[str, list[int]] = {k: [] for k in sides}
    probes: list[float] = []
    order = list(sides)
    t_start = time.perf_counter()
    for r in range(opts.rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            dt, loss, rise = timed(sides[k], opts.warmup + 1 + r, device)
            times[k].append(dt)
            losses[k].append(loss)
            if rise is not None:
                rises[k].append(rise)
        if probe is not None:
            probes.append(probe())
    wall = time.perf_counter() - t_start

    peak, peak_source = (statistics.median(probes), "measured fp32 matmul, median of rounds") if probes \
        else opts.peak
    fpt = flops_per_token(cfg, T)
    tokens = B * T
    res = dict(
        layout=spec["layout"], shape=dict(n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_model=cfg.d_model,
                                          d_ff=cfg.resolved_d_ff, seq_len=T, batch=B, vocab=cfg.vocab_size),
        params=n_params, tokens_per_step=tokens, flops_per_token=fpt, baseline=base,
        lmforge_defer="defer" in inspect.signature(run.parallel.step).parameters, rounds=opts.rounds,
        warmup=opts.warmup, wall_s=wall, initial_loss_check=check, peak_flops=peak, peak_source=peak_source,
        first_step=dict({k: dict(seconds=v[0], loss=v[1]) for k, v in first.items()}),
        **{k: comp[k] for k in ("checkout", "attn_implementation") if k in comp},
        sides={},
    )
    for k in sides:
        med = statistics.median(times[k])
        res["sides"][k] = dict(
            median_ms=med * 1e3, tokens_per_s=tokens / med, mfu=fpt * tokens / med / peak,
            peak_mem_mib=(resident_bytes(*state[k]) + max(rises[k])) / 2**20 if rises[k] else None,
            raw_step_s=times[k], losses=losses[k],
        )
    res["ratio"] = res["sides"][base]["median_ms"] / res["sides"]["lmforge"]["median_ms"]
    per_round = sorted(h / o for h, o in zip(times[base], times["lmforge"]))
    res["ratio_per_round_q25_q75"] = [per_round[len(per_round) // 4], per_round[(3 * len(per_round)) // 4]]
    if not opts.tiny:
        res["targets"] = {k: spec[k] for k in ("target_ratio", "target_mfu") if k in spec}
    print(f"[{name}] ratio {res['ratio']:.3f} (per-round IQR {res['ratio_per_round_q25_q75'][0]:.3f}-"
          f"{res['ratio_per_round_q25_q75'][1]:.3f}), {opts.rounds} rounds in {wall:.0f} s", flush=True)
    return res


def print_rows(rows: dict) -> None:
    headers = ["row", "vs", "params", "tok/step", "ours ms", "base ms", "ours tok/s", "base tok/s", "ratio",
               "target", "MFU ours", "MFU base", "mem ours MiB", "mem base MiB"]
    table = []
    for name, r in rows.items():
        if "skipped" in r or "error" in r:
            table.append([name, "skipped" if "skipped" in r else "error"] + [""] * (len(headers) - 2))
            continue
        o, b = r["sides"]["lmforge"], r["sides"][r["baseline"]]
        t = r.get("targets", {})
        target = " ".join(filter(None, [f">={t['target_ratio']:.2f}x" if "target_ratio" in t else "",
                                        f">={100 * t['target_mfu']:.0f}% MFU" if "target_mfu" in t else ""]))

        def mem(side: dict) -> str:
            return f"{side['peak_mem_mib']:.0f}" if side["peak_mem_mib"] is not None else "n/a"

        table.append([name, r["baseline"], f"{r['params'] / 1e6:.1f}M", str(r["tokens_per_step"]),
                      f"{o['median_ms']:.1f}", f"{b['median_ms']:.1f}", f"{o['tokens_per_s']:.0f}",
                      f"{b['tokens_per_s']:.0f}", f"{r['ratio']:.3f}", target or "-",
                      f"{100 * o['mfu']:.1f}%", f"{100 * b['mfu']:.1f}%", mem(o), mem(b)])
    print_markdown_table(headers, table)
    for name, r in rows.items():
        if "skipped" in r:
            print(f"{name}: skipped: {r['skipped']}")
        elif "error" in r:
            print(f"{name}: {r['error']}")
        else:
            print(f"{name}: MFU denominator {r['peak_flops'] / 1e12:.3f} TFLOP/s ({r['peak_source']})")


# ---- --memory: train.loss_chunk_tokens on lmforge's GPT-2 124M shape, one fresh process per setting ----

def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory_child(setting: dict) -> dict:
    """Build lmforge's run at `setting` and take `steps` steps: peak memory (CUDA: max_memory_allocated;
    CPU: the process's peak RSS, VmHWM, reset after building) and how much of it the steps added."""
    device = torch.device(setting["device"])
    cfg = gpt2_config(setting["n_layers"], setting["n_heads"], setting["d_model"], setting["seq_len"],
                      setting["vocab"])
    data, batches = batches_of(cfg.vocab_size, setting["batch"], setting["seq_len"], n_batches=2)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    run = assemble(cfg, data, compile=setting["compile"], precision=setting["precision"], device=device.type,
                   loss_chunk_tokens=setting["chunk"])
    step = stepper(run, batches)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        built = torch.cuda.memory_allocated(device)
    else:
        built = _status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    times = []
    try:
        for i in range(setting["steps"]):
            t0 = time.perf_counter()
            step(i)
            sync(device)
            times.append(time.perf_counter() - t0)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # the compiler may wrap an OOM in its own error
        if "out of memory" not in str(e).lower():
            raise
        return dict(fits=False, error=str(e).splitlines()[0][:300])
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _status_kib("VmHWM") * 1024
    return dict(fits=True, peak_mib=peak / 2**20, built_mib=built / 2**20,
                step_rise_mib=(peak - built) / 2**20,
                step_ms_after_first=statistics.median(times[1:]) * 1e3 if len(times) > 1 else None)


def bench_memory(opts) -> dict:
    m = dict(TINY_MEMORY if opts.tiny else MEMORY)
    if opts.memory_batch:
        m["batch"] = opts.memory_batch
    chunks = [0] + [int(c) for c in (opts.chunks.split(",") if opts.chunks else m["chunks"])]
    tokens = m["batch"] * m["seq_len"]
    logits_mib = {"fp32": tokens * m["vocab"] * 4 / 2**20, "bf16": tokens * m["vocab"] * 2 / 2**20}
    out = dict(shape={k: m[k] for k in ("n_layers", "n_heads", "d_model", "seq_len", "vocab", "batch")},
               tokens=tokens, logits_mib=logits_mib, settings={})
    for chunk in chunks:
        setting = dict(m, chunk=chunk, device=opts.device.type, compile=opts.compile, steps=opts.memory_steps,
                       precision="bf16" if opts.bf16 else "fp32", threads=opts.threads)
        setting.pop("chunks")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", json.dumps(setting)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY_RESULT ")]
        if proc.returncode != 0 or not lines:
            why = f"exit {proc.returncode}" + (" (killed: out of memory?)" if proc.returncode < 0 else "")
            res = dict(fits=False, error=f"{why}: {proc.stderr.strip().splitlines()[-1:] or ''}")
        else:
            res = json.loads(lines[-1][len("MEMORY_RESULT "):])
        out["settings"][str(chunk)] = res
        said = (f"peak {res['peak_mib']:.0f} MiB (steps added {res['step_rise_mib']:.0f} MiB)" if res["fits"]
                else f"does not fit: {res['error']}")
        print(f"[memory] loss_chunk_tokens {chunk}: {said}", flush=True)
    return out


def print_memory(mem: dict) -> None:
    s = mem["shape"]
    print(f"\nlmforge GPT-2 layout {s['n_layers']}L d{s['d_model']} vocab {s['vocab']}, batch {s['batch']} x "
          f"{s['seq_len']} = {mem['tokens']} tokens; logits {mem['logits_mib']['fp32']:.0f} MiB in fp32 "
          f"({mem['logits_mib']['bf16']:.0f} MiB in bf16)\n")
    plain = mem["settings"]["0"]
    rows = []
    for chunk, r in mem["settings"].items():
        if not r["fits"]:
            rows.append([chunk, "does not fit", "", "", ""])
            continue
        drop = f"{plain['peak_mib'] - r['peak_mib']:.0f}" if plain["fits"] and chunk != "0" else ""
        ms = f"{r['step_ms_after_first']:.1f}" if r["step_ms_after_first"] is not None else ""
        rows.append([chunk, f"{r['peak_mib']:.0f}", f"{r['step_rise_mib']:.0f}", drop, ms])
    print_markdown_table(["loss_chunk_tokens", "peak MiB", "added by steps MiB", "drop vs 0 MiB",
                          "ms/step (not interleaved)"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ",".join(ROWS))
    p.add_argument("--tiny", action="store_true", help="tiny shapes, fp32 (the default without CUDA)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile every side (default: on with CUDA at full shapes, off at tiny shapes)")
    p.add_argument("--nanogpt", default=None, metavar="PATH",
                   help="a nanoGPT checkout (default: $LMFORGE_NANOGPT)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per row (default: 30; tiny: 20)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps per side after the first (default 3)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 at tiny shapes, torch's own on CUDA)")
    p.add_argument("--peak-n", type=int, default=2048, help="size of the CPU reference fp32 matmul")
    p.add_argument("--memory", action="store_true", help="instead of the rows: peak memory of lmforge's "
                   "GPT-2 124M shape with train.loss_chunk_tokens 0 and --chunks")
    p.add_argument("--chunks", default=None, help="loss_chunk_tokens values for --memory (default 4096,8192; "
                   "tiny 256,512)")
    p.add_argument("--memory-batch", type=int, default=None, help="batch for --memory (default 32; tiny 16)")
    p.add_argument("--memory-steps", type=int, default=3, help="steps per --memory setting")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON (default bench/results/gpu_throughput.json; --memory: gpu_memory.json)")
    opts = p.parse_args(argv)

    if opts.memory_child is not None:
        setting = json.loads(opts.memory_child)
        torch.set_num_threads(setting["threads"])
        print("MEMORY_RESULT " + json.dumps(memory_child(setting)), flush=True)
        return 0

    if opts.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    opts.device = torch.device("cuda" if opts.device != "cpu" and torch.cuda.is_available() else "cpu")
    opts.tiny = opts.tiny or opts.device.type == "cpu"
    # Tiny steps gain nothing from a second thread, and with two threads every parallel op waits for any
    # other process on a 2-core machine (tiny steps went from ~10 ms to ~1 s while another job ran).
    opts.threads = opts.threads or (1 if opts.device.type == "cpu" else torch.get_num_threads())
    torch.set_num_threads(opts.threads)
    opts.bf16 = not opts.tiny
    opts.compile = (not opts.tiny) if opts.compile is None else opts.compile
    opts.rounds = opts.rounds if opts.rounds is not None else (20 if opts.tiny else 30)
    opts.warmup = opts.warmup if opts.warmup is not None else 3
    names = [n.strip() for n in opts.rows.split(",") if n.strip()]
    for n in names:
        if n not in ROWS:
            p.error(f"unknown row {n!r}; choose from {', '.join(ROWS)}")
    if opts.rounds < 1:
        p.error("--rounds must be at least 1")
    if opts.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # nanoGPT's train.py; process-wide, so for every side
        torch.backends.cudnn.allow_tf32 = True
        opts.peak = peak_flops(opts.device, torch.bfloat16 if opts.bf16 else torch.float32)
    import transformers

    machine = machine_info(
        transformers=transformers.__version__, threads=opts.threads, device=str(opts.device),
        gpu=torch.cuda.get_device_name(opts.device) if opts.device.type == "cuda" else None,
        cuda=torch.version.cuda, tiny=opts.tiny, precision="bf16 autocast" if opts.bf16 else "fp32",
        compile=opts.compile, tf32=torch.backends.cuda.matmul.allow_tf32,
    )
    print(f"machine: {machine}", flush=True)

    if opts.memory:
        result = dict(memory=bench_memory(opts))
        print_memory(result["memory"])
        out = opts.out or RESULTS / "gpu_memory.json"
    else:
        rows = {}
        for n in names:
            spec = (TINY_ROWS if opts.tiny else ROWS)[n]
            try:
                rows[n] = bench_row(n, spec, opts)
            except torch.OutOfMemoryError as e:
                rows[n] = dict(error=f"does not fit: {str(e).splitlines()[0][:300]}")
                print(f"[{n}] {rows[n]['error']}", flush=True)
            gc.collect()
            if opts.device.type == "cuda":
                torch._dynamo.reset()  # the row's compiled graphs hold their own buffers
                torch.cuda.empty_cache()
        print()
        print_rows(rows)
        result = dict(rows=rows)
        out = opts.out or RESULTS / "gpu_throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine["loadavg_at_end"] = list(os.getloadavg())
    out.write_text(json.dumps(dict(machine=machine, command=" ".join(sys.argv), **result), indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
