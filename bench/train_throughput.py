"""Training throughput: lmforge vs a plain PyTorch loop over transformers' LlamaForCausalLM.

Both sides train the same Llama-layout model (RMSNorm eps 1e-5, RoPE theta 1e4, SwiGLU with the
same intermediate size, no biases, untied embeddings, n_kv_heads = n_heads, no dropout) in fp32 on
the same batches, in one process, interleaved step by step (the order alternates every round),
with a reference fp32 matmul timed in every round as the MFU denominator. Reports medians.

    python bench/train_throughput.py                       # shapes a and b, ~3-4 minutes
    python bench/train_throughput.py --shapes a --rounds 200
    python bench/train_throughput.py --compile             # adds lmforge + torch.compile
    python bench/train_throughput.py --shapes nanogpt --nanogpt ~/nanoGPT   # vs nanoGPT's own loop
    python bench/train_throughput.py --shapes nanochat --nanochat ~/nanochat   # vs nanochat's own loop

lmforge side = what `lmforge train` runs per step: the run `build_run` assembles from the config
(model, optimizer, precision, objective; `train.compile` compiles the model and its loss as one
graph), stepped by `run.parallel.step([(x, y)], run.optimizer, run.precision, grad_clip=1.0)`.
Baseline = what a user writes: out = model(input_ids=x, labels=x); out.loss.backward();
clip_grad_norm_(..., 1.0); AdamW(model.parameters(), lr=3e-4, weight_decay=0.1).step();
zero_grad(set_to_none=True). Both sides run B*T input tokens per step and a cross-entropy over
B*T logit rows (HF pads the shifted labels with -100, so it has B*(T-1) targets; same work).

Shape `nanogpt` (opt-in) is nanoGPT's documented CPU shape with lmforge's GPT-2 layout (LayerNorm,
learned positions, GELU, biases, tied) against nanoGPT's own model.py and train loop, from a checkout
the user provides (`--nanogpt PATH` or LMFORGE_NANOGPT; bench/nanogpt_ref.py): its configure_optimizers
on device "cpu" (torch's default foreach AdamW), fp32, forward with targets, backward, clip 1.0, step,
zero_grad(set_to_none=True). With --compile both sides are compiled too (nanoGPT: torch.compile(model),
as its train.py does with compile=True). Without a checkout the row is skipped with how to get one.

Shape `nanochat` (opt-in) times each tool's OWN model and optimizer at one shape, runs/runcpu.sh scaled
down: nanochat's GPT (window "L"), MuonAdamW and base_train.py step from a checkout the user provides
(`--nanochat PATH` or LMFORGE_NANOCHAT; PyPI's `nanochat` is only its tokenizer) against lmforge's closest
model with optim.name=muon, fp32; with --compile both compiled. Details: bench/nanochat_ref.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import nanochat_ref  # bench/nanochat_ref.py
from lmforge.assembly import Run, build_run
from lmforge.config.schema import Config, ModelConfig
from lmforge.engine.loss import token_loss_sum
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

if TYPE_CHECKING:
    from transformers import LlamaConfig

# transformers is imported where the HF side is built: gpu_throughput.py's --memory processes use this
# file's helpers without it, and importing it costs seconds.

# rounds: at most this many timed rounds by default, stopping early once budget_s seconds of
# timed rounds have passed (but never before MIN_ROUNDS); --rounds N runs exactly N.
SHAPES = {
    "a": dict(
        n_layers=4, n_heads=4, d_model=128, seq_len=64, batch=12, vocab=65, rounds=300, budget_s=45, warmup=5
    ),
    "b": dict(
        n_layers=8,
        n_heads=8,
        d_model=512,
        seq_len=512,
        batch=8,
        vocab=8192,
        rounds=15,
        budget_s=150,
        warmup=1,
    ),
    # nanoGPT's documented CPU run (README: n_layer 4, n_head 4, n_embd 128, block 64, batch 12,
    # shakespeare_char's 65 symbols), GPT-2 layout on both sides; only with --shapes nanogpt.
    "nanogpt": dict(
        layout="gpt2", n_layers=4, n_heads=4, d_model=128, seq_len=64, batch=12, vocab=65, rounds=300,
        budget_s=45, warmup=5,
    ),
    # runs/runcpu.sh scaled down, each tool's own model and Muon setup; only with --shapes nanochat.
    "nanochat": dict(
        layout="nanochat", n_layers=4, n_heads=4, d_model=256, seq_len=256, batch=8, vocab=8192, rounds=30,
        budget_s=120, warmup=2,
    ),
}
MIN_ROUNDS = 5

RESULTS = Path(__file__).resolve().parent / "results" / "train_throughput.json"


def lmforge_config(s: dict) -> ModelConfig:
    return ModelConfig(
        vocab_size=s["vocab"],
        d_model=s["d_model"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        n_kv_heads=s["n_heads"],
        max_seq_len=s["seq_len"],
        norm="rmsnorm",
        norm_eps=1e-5,
        pos_embedding="rope",
        rope_theta=10000.0,
        mlp="swiglu",
        bias=False,
        qkv_bias=False,
        tie_embeddings=False,
        dropout=0.0,
    )


def hf_config(cfg: ModelConfig) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.resolved_d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.resolved_kv_heads,
        head_dim=cfg.resolved_head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def lmforge_to_hf_state(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    out = {
        "model.embed_tokens.weight": sd["tok_embeddings.weight"],
        "model.norm.weight": sd["norm.weight"],
        "lm_head.weight": sd["output.weight"],
    }
    names = {
        "attn.wq": "self_attn.q_proj",
        "attn.wk": "self_attn.k_proj",
        "attn.wv": "self_attn.v_proj",
        "attn.wo": "self_attn.o_proj",
        "attn_norm": "input_layernorm",
        "mlp_norm": "post_attention_layernorm",
        "mlp.w_gate": "mlp.gate_proj",
        "mlp.w_up": "mlp.up_proj",
        "mlp.w_down": "mlp.down_proj",
    }
    for i in range(n_layers):
        for ours, theirs in names.items():
            out[f"model.layers.{i}.{theirs}.weight"] = sd[f"layers.{i}.{ours}.weight"]
    return out


def check_same_function(ours: torch.nn.Module, hf: torch.nn.Module, cfg: ModelConfig, x, y) -> dict:
    """Copy lmforge's weights into the HF model; the initial losses must agree to 1e-4."""
    missing, unexpected = hf.load_state_dict(
        lmforge_to_hf_state(ours.state_dict(), cfg.n_layers), strict=False
    )
    missing = [k for k in missing if "rotary_emb" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        logits = ours(x)
        loss_ours = float(token_loss_sum(logits, y) / y.numel())
        out = hf(input_ids=x, labels=x, shift_labels=y)  # same targets as lmforge's (x, y)
        loss_hf = float(out.loss)
        max_logit_diff = float((out.logits - logits).abs().max())
        # and the loss of the timed baseline call (labels=x: last position of each row ignored)
        y_last_ignored = y.clone()
        y_last_ignored[:, -1] = -100
        loss_ours_shift = float(token_loss_sum(logits, y_last_ignored) / (y.numel() - y.size(0)))
        loss_hf_plain = float(hf(input_ids=x, labels=x).loss)
    res = dict(
        loss_lmforge=loss_ours,
        loss_hf=loss_hf,
        abs_diff=abs(loss_ours - loss_hf),
        loss_lmforge_last_ignored=loss_ours_shift,
        loss_hf_labels_x=loss_hf_plain,
        abs_diff_labels_x=abs(loss_ours_shift - loss_hf_plain),
        max_abs_logit_diff=max_logit_diff,
    )
    assert res["abs_diff"] < 1e-4 and res["abs_diff_labels_x"] < 1e-4, res
    return res


def assemble(cfg: ModelConfig, data: torch.Tensor, compile: bool = False, precision: str = "fp32",
             optim: dict | None = None, **train) -> Run:
    """The run `lmforge train` would assemble for this model (no run dir; fp32 unless `precision`
    says otherwise, AdamW lr 3e-4, weight decay 0.1 unless `optim` replaces the optim section, clip 1.0,
    more train keys from `train`); the timed batches are the bench's own, `data` only has to exist."""
    config = Config.model_validate({
        "model": cfg.model_dump(), "optim": optim or {"lr": 3e-4, "weight_decay": 0.1},
        "train": {"grad_clip": 1.0, "precision": precision, "compile": compile, "micro_batch_size": 1,
                  "seq_len": cfg.max_seq_len, **train},
        "schedule": {"name": "constant", "warmup_steps": 0},
    })
    run = build_run(config, "experiment", train_data=[data.flatten()], say=lambda *_: None)
    run.model.train()
    return run


def peak_probe(n: int):
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    c = torch.empty(n, n)

    def run() -> float:
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        dt = time.perf_counter() - t0
        return 2.0 * n**3 / dt

    run()
    return run


def batches_of(vocab: int, B: int, T: int, n_batches: int = 8):
    """The bench's data: `n_batches` seeded random (x, y) batches of B x T, and the raw B x (T+1) rows."""
    gen = torch.Generator().manual_seed(1234)
    data = torch.randint(0, vocab, (n_batches, B, T + 1), generator=gen)
    return data, [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def stepper(r: Run, batches: list):
    """One `lmforge train` step of run `r` on batch i (mod the batch count)."""
    return lambda i: r.parallel.step([batches[i % len(batches)]], r.optimizer, r.precision,
                                     grad_clip=1.0).loss


def first_step_s(fn) -> float:
    """Seconds of a compiled side's first step (the compile)."""
    t0 = time.perf_counter()
    fn(0)
    return time.perf_counter() - t0


def interleave(sides: dict, warmup: int, rounds: int, budget_s: float | None, peak_n: int) -> dict:
    """Warm-up steps on every side, then per round one step of each side (the order alternating every
    round) and one reference matmul (the round's measured peak)."""
    peak = peak_probe(peak_n)
    for i in range(warmup):
        for fn in sides.values():
            fn(i)
    times: dict[str, list[float]] = {k: [] for k in sides}
    peaks: list[float] = []
    losses: dict[str, list[float]] = {k: [] for k in sides}
    order = list(sides)
    t_start = time.perf_counter()
    for r in range(rounds):
        if budget_s is not None and r >= MIN_ROUNDS and time.perf_counter() - t_start > budget_s:
            break
        seq = order if r % 2 == 0 else order[::-1]
        for k in seq:
            t0 = time.perf_counter()
            loss = sides[k](warmup + r)
            times[k].append(time.perf_counter() - t0)
            losses[k].append(float(loss))
        peaks.append(peak())
    return dict(times=times, losses=losses, peaks=peaks, wall=time.perf_counter() - t_start)


def summarise(cfg: ModelConfig, B: int, T: int, n_params: int, warmup: int, timing: dict, **extra) -> dict:
    """Medians, tokens/s and MFU per side (the result dict of one shape; ratios are the caller's)."""
    times, peaks = timing["times"], timing["peaks"]
    tokens = B * T
    fpt = flops_per_token(cfg, T)
    peak_med = statistics.median(peaks)
    res = dict(
        shape=dict(
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            d_model=cfg.d_model,
            d_ff=cfg.resolved_d_ff,
            seq_len=T,
            batch=B,
            vocab=cfg.vocab_size,
        ),
        params=n_params,
        tokens_per_step=tokens,
        flops_per_token=fpt,
        rounds=len(peaks),
        warmup=warmup,
        wall_s=timing["wall"],
        **extra,
        peak_gflops_median=peak_med / 1e9,
        peak_gflops_raw=[p / 1e9 for p in peaks],
        sides={},
    )
    for k in times:
        med = statistics.median(times[k])
        tps = tokens / med
        res["sides"][k] = dict(
            median_ms=med * 1e3,
            tokens_per_s=tps,
            mfu=fpt * tps / peak_med,
            raw_step_s=times[k],
            losses=timing["losses"][k],
        )
    return res


def add_ratios(res: dict, baseline: str, baseline_compile: str, times: dict) -> None:
    """ratio = baseline median / lmforge median (> 1: lmforge faster), the compiled pair's too, and the
    per-round ratio's quartiles (how stable the comparison was)."""
    sides = res["sides"]
    res["baseline"], res["baseline_compile"] = baseline, baseline_compile
    res["ratio"] = sides[baseline]["median_ms"] / sides["lmforge"]["median_ms"]
    if "lmforge_compile" in sides:
        res["ratio_compile"] = sides[baseline_compile]["median_ms"] / sides["lmforge_compile"]["median_ms"]
    per_round = sorted(h / o for h, o in zip(times[baseline], times["lmforge"]))
    res["ratio_per_round_q25_q75"] = [per_round[len(per_round) // 4], per_round[(3 * len(per_round)) // 4]]


def rounds_of(s: dict, args) -> tuple[int, float | None, int]:
    rounds = args.rounds if args.rounds is not None else s["rounds"]
    budget_s = None if args.rounds is not None else s["budget_s"]
    warmup = args.warmup if args.warmup is not None else s["warmup"]
    return rounds, budget_s, warmup


def bench_shape(name: str, s: dict, args) -> dict:
    if s.get("layout") == "gpt2":
        return bench_nanogpt_shape(name, s, args)
    if s.get("layout") == "nanochat":
        return nanochat_ref.bench_shape(name, s, args, bench=sys.modules[__name__])
    cfg = lmforge_config(s)
    B, T = s["batch"], s["seq_len"]
    rounds, budget_s, warmup = rounds_of(s, args)
    data, batches = batches_of(cfg.vocab_size, B, T)

    run = assemble(cfg, data)
    ours = run.model
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(hf_config(cfg))
    hf.train()
    n_params = sum(p.numel() for p in ours.parameters())
    assert n_params == sum(p.numel() for p in hf.parameters()) == count_params(cfg)

    check = check_same_function(ours, hf, cfg, *batches[0])
    print(
        f"[{name}] initial loss lmforge {check['loss_lmforge']:.7f} vs HF {check['loss_hf']:.7f} "
        f"(|diff| {check['abs_diff']:.2e}; labels=x form |diff| {check['abs_diff_labels_x']:.2e}; "
        f"max |logit diff| {check['max_abs_logit_diff']:.2e}) OK",
        flush=True,
    )

    opt_hf = torch.optim.AdamW(hf.parameters(), lr=3e-4, weight_decay=0.1)

    def step_hf(i: int) -> float:
        x, _ = batches[i % len(batches)]
        out = hf(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)
        return out.loss.item()

    sides = {"lmforge": stepper(run, batches), "hf": step_hf}
    compile_s = None
    if args.compile:
        run_c = assemble(
            cfg, data, compile=True
        )  # as the Trainer runs train.compile: model + loss, one graph
        run_c.model.load_state_dict(ours.state_dict())
        step_compiled = stepper(run_c, batches)
        compile_s = first_step_s(step_compiled)
        print(f"[{name}] torch.compile first step (compile) {compile_s:.1f} s", flush=True)
        sides["lmforge_compile"] = step_compiled

    timing = interleave(sides, warmup, rounds, budget_s, args.peak_n)
    res = summarise(cfg, B, T, n_params, warmup, timing,
                    hf_attn_implementation=hf.config._attn_implementation, initial_loss_check=check)
    res["compile_s"] = compile_s
    add_ratios(res, "hf", "hf", timing["times"])
    return res


def bench_nanogpt_shape(name: str, s: dict, args) -> dict:
    """lmforge's train step vs nanoGPT's own model and loop (a checkout the user provides), GPT-2 layout,
    fp32 on CPU; with --compile both compiled. {"skipped": why} without a checkout."""
    root, why = find_nanogpt(args.nanogpt)
    if root is None:
        print(f"[{name}] skipped: {why}", flush=True)
        return dict(skipped=why)
    module = load_nanogpt(root)
    cfg = gpt2_config(s["n_layers"], s["n_heads"], s["d_model"], s["seq_len"], s["vocab"])
    B, T = s["batch"], s["seq_len"]
    rounds, budget_s, warmup = rounds_of(s, args)
    data, batches = batches_of(cfg.vocab_size, B, T)
    cpu = torch.device("cpu")

    run = assemble(cfg, data)
    torch.manual_seed(0)
    nano = build_nanogpt(module, cfg, cpu)
    n_params = sum(p.numel() for p in run.model.parameters())
    assert n_params == sum(p.numel() for p in nano.parameters()) == count_params(cfg)
    check = check_same_function_nanogpt(run.model, nano, cfg, *batches[0])
    print(f"[{name}] nanoGPT from {root}; initial loss lmforge {check['loss_lmforge']:.7f} vs nanoGPT "
          f"{check['loss_nanogpt']:.7f} (|diff| {check['abs_diff']:.2e}) OK", flush=True)

    sides = {"lmforge": stepper(run, batches),
             "nanogpt": nanogpt_stepper(nano, nanogpt_optimizer(nano, cpu), contextlib.nullcontext, batches)}
    compile_s = None
    if args.compile:
        run_c = assemble(cfg, data, compile=True)
        run_c.model.load_state_dict(run.model.state_dict())
        nano_c = build_nanogpt(module, cfg, cpu)
        nano_c.load_state_dict(nano.state_dict())
        opt_c = nanogpt_optimizer(nano_c, cpu)  # train.py: configure_optimizers, then torch.compile
        sides["lmforge_compile"] = stepper(run_c, batches)
        sides["nanogpt_compile"] = nanogpt_stepper(torch.compile(nano_c), opt_c, contextlib.nullcontext,
                                                   batches)
        compile_s = {k: first_step_s(sides[k]) for k in ("lmforge_compile", "nanogpt_compile")}
        print(f"[{name}] torch.compile first step (compile): lmforge {compile_s['lmforge_compile']:.1f} s, "
              f"nanoGPT {compile_s['nanogpt_compile']:.1f} s", flush=True)

    timing = interleave(sides, warmup, rounds, budget_s, args.peak_n)
    res = summarise(cfg, B, T, n_params, warmup, timing, nanogpt_checkout=str(root), initial_loss_check=check)
    res["compile_s"] = compile_s
    add_ratios(res, "nanogpt", "nanogpt_compile", timing["times"])
    return res


def profile_shape(name: str, s: dict, steps: int, row_limit: int = 25) -> None:
    """torch.profiler tables (self CPU time) of `steps` steps of each side."""
    from torch.profiler import ProfilerActivity, profile

    cfg = lmforge_config(s)
    B, T = s["batch"], s["seq_len"]
    d = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    x, y = d[:, :-1].contiguous(), d[:, 1:].contiguous()
    run = assemble(cfg, d)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(hf_config(cfg))
    hf.load_state_dict(lmforge_to_hf_state(run.model.state_dict(), cfg.n_layers), strict=False)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=3e-4, weight_decay=0.1)

    def step_hf():
        out = hf(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)
        out.loss.item()

    def step_ours():
        run.parallel.step([(x, y)], run.optimizer, run.precision, grad_clip=1.0)

    for label, fn in (("lmforge", step_ours), ("hf", step_hf)):
        for _ in range(2):
            fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
        print(f"\n=== profile [{name}] {label}: {steps} steps ===")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit))


def print_table(results: dict) -> None:
    headers = [
        "shape",
        "params",
        "tok/step",
        "ours ms/step",
        "base ms/step",
        "ours tok/s",
        "base tok/s",
        "ratio",
        "MFU ours",
        "MFU base",
        "peak GFLOP/s",
    ]
    rows = []
    for name, r in results.items():
        if "skipped" in r:
            continue
        o, h = r["sides"]["lmforge"], r["sides"][r["baseline"]]
        rows.append(
            [
                name,
                f"{r['params'] / 1e6:.2f}M",
                str(r["tokens_per_step"]),
                f"{o['median_ms']:.1f}",
                f"{h['median_ms']:.1f}",
                f"{o['tokens_per_s']:.0f}",
                f"{h['tokens_per_s']:.0f}",
                f"{r['ratio']:.3f}",
                f"{100 * o['mfu']:.1f}%",
                f"{100 * h['mfu']:.1f}%",
                f"{r['peak_gflops_median']:.1f}",
            ]
        )
        if "lmforge_compile" in r["sides"]:
            c = r["sides"]["lmforge_compile"]
            h = r["sides"][r["baseline_compile"]]  # nanogpt: compiled too; a and b: HF stays eager
            rows.append(
                [
                    f"{name} (compile)",
                    "",
                    "",
                    f"{c['median_ms']:.1f}",
                    f"{h['median_ms']:.1f}",
                    f"{c['tokens_per_s']:.0f}",
                    f"{h['tokens_per_s']:.0f}",
                    f"{r['ratio_compile']:.3f}",
                    f"{100 * c['mfu']:.1f}%",
                    f"{100 * h['mfu']:.1f}%",
                    f"{r['peak_gflops_median']:.1f}",
                ]
            )
    if rows:  # none when every shape was skipped
        print_markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="a,b", help="comma-separated subset of: " + ",".join(SHAPES))
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="exactly this many timed rounds per shape (default: time-budgeted, "
        "a: <=300 rounds / 45 s, b: <=15 rounds / 150 s, at least 5)",
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per side (default: a=5, b=1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time lmforge with torch.compile(model)")
    p.add_argument("--peak-n", type=int, default=2048, help="size of the reference fp32 matmul")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead of timing, print torch.profiler tables of STEPS steps of each side",
    )
    p.add_argument("--nanogpt", default=None, metavar="PATH",
                   help="a nanoGPT checkout for shape nanogpt (default: $LMFORGE_NANOGPT)")
    p.add_argument("--nanochat", default=None, metavar="PATH",
                   help="a nanochat checkout for shape nanochat (default: $LMFORGE_NANOCHAT)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    for n in names:
        if n not in SHAPES:
            p.error(f"unknown shape {n!r}; choose from {', '.join(SHAPES)}")
    if args.profile:
        if {"nanogpt", "nanochat"} & set(names):
            p.error("--profile covers the HF shapes (a, b); not nanogpt or nanochat")
        for n in names:
            profile_shape(n, SHAPES[n], args.profile)
        return 0

    import transformers

    machine = machine_info(transformers=transformers.__version__, threads=args.threads)
    print(f"machine: {machine}", flush=True)
    results = {}
    for n in names:
        results[n] = bench_shape(n, SHAPES[n], args)
        r = results[n]
        if "skipped" in r:
            continue
        print(
            f"[{n}] ratio {r['ratio']:.3f} (per-round IQR {r['ratio_per_round_q25_q75'][0]:.3f}-"
            f"{r['ratio_per_round_q25_q75'][1]:.3f}), {r['rounds']} rounds in {r['wall_s']:.0f} s",
            flush=True,
        )
    print()
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine["loadavg_at_end"] = list(os.getloadavg())
    args.out.write_text(
        json.dumps(dict(machine=machine, command=" ".join(sys.argv), results=results), indent=1)
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
