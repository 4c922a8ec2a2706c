"""Training throughput: lmforge vs a plain PyTorch loop over transformers' LlamaForCausalLM.

Both sides train the same Llama-layout model (RMSNorm eps 1e-5, RoPE theta 1e4, SwiGLU with the
same intermediate size, no biases, untied embeddings, n_kv_heads = n_heads, no dropout) in fp32 on
the same batches, in one process, interleaved step by step (the order alternates every round),
with a reference fp32 matmul timed in every round as the MFU denominator. Reports medians.

    python bench/train_throughput.py                       # shapes a and b, ~3-4 minutes
    python bench/train_throughput.py --shapes a --rounds 200
    python bench/train_throughput.py --compile             # adds lmforge + torch.compile

lmforge side = what `lmforge train` runs per step: the run `build_run` assembles from the config
(model, optimizer, precision, objective; `train.compile` compiles the model and its loss as one
graph), stepped by `run.parallel.step([(x, y)], run.optimizer, run.precision, grad_clip=1.0)`.
Baseline = what a user writes: out = model(input_ids=x, labels=x); out.loss.backward();
clip_grad_norm_(..., 1.0); AdamW(model.parameters(), lr=3e-4, weight_decay=0.1).step();
zero_grad(set_to_none=True). Both sides run B*T input tokens per step and a cross-entropy over
B*T logit rows (HF pads the shifted labels with -100, so it has B*(T-1) targets; same work).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from lmforge.assembly import Run, build_run
from lmforge.config.schema import Config, ModelConfig
from lmforge.engine.loss import token_loss_sum
from lmforge.models.flops import count_params, flops_per_token
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

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


def assemble(cfg: ModelConfig, data: torch.Tensor, compile: bool = False) -> Run:
    """The run `lmforge train` would assemble for this model (no run dir; fp32, AdamW lr 3e-4, weight
    decay 0.1, clip 1.0); the timed batches are the bench's own, `data` only has to exist."""
    config = Config.model_validate({
        "model": cfg.model_dump(), "optim": {"lr": 3e-4, "weight_decay": 0.1},
        "train": {"grad_clip": 1.0, "precision": "fp32", "compile": compile, "micro_batch_size": 1,
                  "seq_len": cfg.max_seq_len},
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


def bench_shape(name: str, s: dict, args) -> dict:
    cfg = lmforge_config(s)
    B, T = s["batch"], s["seq_len"]
    rounds = args.rounds if args.rounds is not None else s["rounds"]
    budget_s = None if args.rounds is not None else s["budget_s"]
    warmup = args.warmup if args.warmup is not None else s["warmup"]

    gen = torch.Generator().manual_seed(1234)
    n_batches = 8
    data = torch.randint(0, cfg.vocab_size, (n_batches, B, T + 1), generator=gen)
    batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]

    run = assemble(cfg, data)
    ours = run.model
    torch.manual_seed(0)
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

    def stepper(r: Run):
        return lambda i: (
            r.parallel.step([batches[i % n_batches]], r.optimizer, r.precision, grad_clip=1.0).loss
        )

    step_ours = stepper(run)

    def step_hf(i: int) -> float:
        x, _ = batches[i % n_batches]
        out = hf(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)
        return out.loss.item()

    sides = {"lmforge": step_ours, "hf": step_hf}
    compile_s = None
    if args.compile:
        run_c = assemble(
            cfg, data, compile=True
        )  # as the Trainer runs train.compile: model + loss, one graph
        run_c.model.load_state_dict(ours.state_dict())
        step_compiled = stepper(run_c)

        t0 = time.perf_counter()
        step_compiled(0)
        compile_s = time.perf_counter() - t0
        print(f"[{name}] torch.compile first step (compile) {compile_s:.1f} s", flush=True)
        sides["lmforge_compile"] = step_compiled

    peak = peak_probe(args.peak_n)
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
            losses[k].append(loss)
        peaks.append(peak())
    wall = time.perf_counter() - t_start
    rounds = len(peaks)

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
        rounds=rounds,
        warmup=warmup,
        wall_s=wall,
        hf_attn_implementation=hf.config._attn_implementation,
        initial_loss_check=check,
        peak_gflops_median=peak_med / 1e9,
        peak_gflops_raw=[p / 1e9 for p in peaks],
        compile_s=compile_s,
        sides={},
    )
    for k in sides:
        med = statistics.median(times[k])
        tps = tokens / med
        res["sides"][k] = dict(
            median_ms=med * 1e3,
            tokens_per_s=tps,
            mfu=fpt * tps / peak_med,
            raw_step_s=times[k],
            losses=losses[k],
        )
    res["ratio"] = res["sides"]["hf"]["median_ms"] / res["sides"]["lmforge"]["median_ms"]
    if "lmforge_compile" in sides:
        res["ratio_compile"] = res["sides"]["hf"]["median_ms"] / res["sides"]["lmforge_compile"]["median_ms"]
    # Per-round ratio spread: how stable the comparison was.
    per_round = sorted(h / o for h, o in zip(times["hf"], times["lmforge"]))
    res["ratio_per_round_q25_q75"] = [per_round[len(per_round) // 4], per_round[(3 * len(per_round)) // 4]]
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
        o, h = r["sides"]["lmforge"], r["sides"]["hf"]
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
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    for n in names:
        if n not in SHAPES:
            p.error(f"unknown shape {n!r}; choose from {', '.join(SHAPES)}")
    if args.profile:
        for n in names:
            profile_shape(n, SHAPES[n], args.profile)
        return 0

    machine = machine_info(transformers=transformers.__version__, threads=args.threads)
    print(f"machine: {machine}", flush=True)
    results = {}
    for n in names:
        results[n] = bench_shape(n, SHAPES[n], args)
        r = results[n]
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
