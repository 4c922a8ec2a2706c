"""Decode speed and memory of the ways a weight-only quantized model can run on a CPU: the numbers
behind `lmforge serve --quantized` (lmforge.compress.cpu_decode).

    .venv/bin/python bench/quant_decode.py --compile             # demo + a ~100M model: ~10 min at load 6
    .venv/bin/python bench/quant_decode.py --rounds 1 --steps 8   # a quick look while building

Models: runs/demo (4M parameters: d_model 256, 4 layers) and a random-weight ~100M-parameter Llama-shaped
model built here (d_model 768, 12 layers, d_ff 2048, vocab 32000, tied), big enough that reading the
weights dominates a decode step. Variants per model: fp32; bf16 (every weight and activation in
bfloat16); int8 (per-channel RTN) and int4 (RTN, symmetric groups of 64 on the demo, whose d_ff 704 is not
a multiple of 128, else 128) on each cpu_decode path: kernel-fp32 (QuantLinear as `lmforge generate`
runs it today), kernel-bf16, dequant-fp32, dequant-bf16; and torchao 0.18's Int8WeightOnlyConfig on the
fp32 model, weight-only and with dynamic int8 activations (eager; --compile adds weight-only under
torch.compile(dynamic=True), demo model only: its warm-up compiles for minutes on 2 shared cores).

Measured: greedy decode steps of `batch` rows (1 and 8) after an untimed 16-token prefill, tokens/s =
batch * steps / seconds; variants interleaved round by round (the order reversed every other round),
medians (and the best round) over --rounds. Memory: the variant's weight bytes (its tensors, tied ones
once) and the growth of the process's resident set when it was built (a rough figure: the allocator
keeps freed pages).
Never asserts; writes bench/results/quant_decode.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmforge.compress import cpu_decode  # noqa: E402
from lmforge.config import ModelConfig  # noqa: E402
from lmforge.models import Transformer  # noqa: E402
from lmforge.models.common.attention import KVCache  # noqa: E402
from machine import machine_info, print_markdown_table  # noqa: E402

BIG = dict(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048, max_seq_len=512,
           tie_embeddings=True)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's tensors, tied ones once; a tensor subclass (torchao's) by its inner tensors."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            for n in names:
                add(getattr(t, n))
        elif t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for t in [*model.parameters(), *model.buffers()]:
        add(t)
    return total


def torchao_int8(model: torch.nn.Module, compiled: bool, dynamic_activations: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig as DA8W8
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

    m = copy.deepcopy(model)
    config = DA8W8() if dynamic_activations else Int8WeightOnlyConfig()
    quantize_(m, config, filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear)
              and fqn.startswith("layers."))
    return torch.compile(m, dynamic=True) if compiled else m


def variants(base: torch.nn.Module, group4: int, compile_ao: bool) -> dict:
    """name -> (model, weight bytes, RSS growth while building it)."""
    out = {}

    def add(name, build, nbytes=None):
        gc.collect()
        before = rss()
        t0 = time.perf_counter()
        m = build()
        built = time.perf_counter() - t0
        out[name] = {"model": m, "weight_bytes": nbytes(m) if nbytes else tensor_bytes(m),
                     "rss_growth": rss() - before, "build_s": built}

    add("fp32", lambda: copy.deepcopy(base))
    add("bf16", lambda: copy.deepcopy(base).to(torch.bfloat16))
    for bits in (8, 4):
        q = copy.deepcopy(base)
        targets = ["layers.*"]
        if bits == 4:
            cpu_decode.INT4_GROUPS, saved = (group4,), cpu_decode.INT4_GROUPS
            try:
                cpu_decode.quantize_in_memory(q, 4, targets)
            finally:
                cpu_decode.INT4_GROUPS = saved
        else:
            cpu_decode.quantize_in_memory(q, 8, targets)
        for path in cpu_decode.PATHS:
            need = cpu_decode.weight_bytes(q, path)
            add(f"int{bits} {path}", lambda q=q, path=path: cpu_decode.apply_path(copy.deepcopy(q), path),
                lambda _m, need=need: need)
        del q
    add("int8 torchao-wo", lambda: torchao_int8(base, False))
    add("int8 torchao-da8w8", lambda: torchao_int8(base, False, dynamic_activations=True))
    if compile_ao:
        add("int8 torchao-wo compiled", lambda: torchao_int8(base, True))
    return out


@torch.no_grad()
def decode_seconds(model, batch: int, steps: int, prompt: torch.Tensor) -> float:
    """Seconds for `steps` greedy decode steps of `batch` rows after an untimed prefill."""
    dtype = next(model.parameters()).dtype
    cfg = getattr(model, "cfg", None) or model._orig_mod.cfg
    cache = KVCache(model if hasattr(model, "cfg") else model._orig_mod, batch, prompt.shape[1] + steps + 1,
                    dtype=dtype)
    ids = prompt.expand(batch, -1)
    nxt = model(ids, cache=cache)[:, -1].argmax(-1, keepdim=True)
    assert cfg.max_seq_len >= prompt.shape[1] + steps
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = model(nxt, cache=cache)[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - t0


def bench_model(label: str, base: torch.nn.Module, group4: int, args) -> dict:
    base = base.float().eval()
    n_params = sum(p.numel() for p in base.parameters())
    print(f"{label}: {n_params / 1e6:.1f}M parameters", flush=True)
    vs = variants(base, group4, args.compile and label == "demo")
    prompt = torch.randint(0, base.cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    names = list(vs)
    times = {(n, b): [] for n in names for b in args.batch}
    for n in names:  # warm-up: kernel operands, compilation
        for b in args.batch:
            decode_seconds(vs[n]["model"], b, 2, prompt)
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else reversed(names):
            for b in args.batch:
                times[(n, b)].append(decode_seconds(vs[n]["model"], b, args.steps, prompt))
        print(f"  round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.1f})", flush=True)
    rows = {}
    for n in names:
        rows[n] = {"weight_bytes": vs[n]["weight_bytes"], "rss_growth": vs[n]["rss_growth"],
                   "build_s": vs[n]["build_s"]}
        for b in args.batch:
            med = statistics.median(times[(n, b)])
            rows[n][f"tok_s_b{b}"] = b * args.steps / med
            rows[n][f"ratio_fp32_b{b}"] = statistics.median(times[("fp32", b)]) / med
            # The best round too: on a shared machine the load moves within a round, and the fastest
            # round is the one least disturbed.
            rows[n][f"best_tok_s_b{b}"] = b * args.steps / min(times[(n, b)])
            rows[n][f"best_ratio_fp32_b{b}"] = min(times[("fp32", b)]) / min(times[(n, b)])
    return {"parameters": n_params, "group4": group4, "variants": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="runs/demo")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="also torchao int8 weight-only + torch.compile")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "quant_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info(threads=args.threads, src=args.src, rounds=args.rounds, steps=args.steps)
    results = {"machine": info}
    from lmforge.eval.open_run import load_run

    results["demo"] = bench_model("demo", load_run(args.src).model, 64, args)
    if not args.skip_big:
        torch.manual_seed(0)
        results["big"] = bench_model("big", Transformer(ModelConfig(**BIG)), 128, args)
    results["loadavg_at_end"] = list(os.getloadavg())
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    for key in ("demo", "big"):
        if key not in results:
            continue
        print(f"\n{key} ({results[key]['parameters'] / 1e6:.0f}M parameters), tokens/s, median (x fp32) "
              "/ best round (x fp32):")
        heads = ["variant", *[f"batch {b}" for b in args.batch], "weights MiB", "RSS growth MiB"]
        table = []
        for n, r in results[key]["variants"].items():
            table.append([n, *[f"{r[f'tok_s_b{b}']:.0f} ({r[f'ratio_fp32_b{b}']:.2f}x) / "
                               f"{r[f'best_tok_s_b{b}']:.0f} ({r[f'best_ratio_fp32_b{b}']:.2f}x)"
                               for b in args.batch],
                          f"{r['weight_bytes'] / 2**20:.1f}", f"{r['rss_growth'] / 2**20:.0f}"])
        print_markdown_table(heads, table)
    print(f"\nload average at start {info['loadavg_at_start']}, at end {results['loadavg_at_end']}")


if __name__ == "__main__":
    main()
