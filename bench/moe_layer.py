"""One mixture-of-experts layer, forward + backward: lmforge's MoE vs transformers' MixtralSparseMoeBlock
with the same weights.

    .venv/bin/python bench/moe_layer.py                   # --preset cpu, ~1 minute on 2 idle cores
    .venv/bin/python bench/moe_layer.py --preset small    # the tiny config's shape, 8 experts
    .venv/bin/python bench/moe_layer.py --preset gpu      # Mixtral-like width on CUDA, bf16

Both sides: x (B*T, d_model) fp32 (bf16 for gpu) requiring grad -> layer -> out.sum().backward(), the
gradients zeroed after each call. lmforge's MoE sorts the token -> expert assignments once
(argsort + bincount), runs each expert on one contiguous slice (GroupedExperts; one grouped GEMM per
projection on CUDA), and scatter-adds the weighted rows back; transformers' block (5.x, its default
"eager" experts implementation) builds a one-hot (E, k, N) mask, loops over the experts that got tokens
and gathers / index_adds each one's rows. Before timing, both outputs and the router-weight gradients
are compared (max |diff| printed; the run stops above 1e-4 in fp32).

Method: --warmup calls per side, then --repeats rounds of one call per side, the order alternating each
round, and a 1024^3 fp32 reference matmul timed in every round (the machine's state; see
/work/shared/cpu-facts.md). Reported: median ms per forward + backward and the ratio transformers /
lmforge (> 1: lmforge faster). Never asserts on speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from lmforge.config.schema import ModelConfig
from lmforge.models.moe import MoE
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

PRESETS = {
    "cpu": dict(d_model=512, d_ff=1024, n_experts=8, top_k=2, tokens=2048, dtype=torch.float32),
    "small": dict(d_model=256, d_ff=512, n_experts=8, top_k=2, tokens=2048, dtype=torch.float32),
    "gpu": dict(d_model=4096, d_ff=14336, n_experts=8, top_k=2, tokens=8192, dtype=torch.bfloat16),
}


def build(p: dict, device: torch.device):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = ModelConfig(vocab_size=64, d_model=p["d_model"], n_heads=8, max_seq_len=64,
                      moe=dict(n_experts=p["n_experts"], top_k=p["top_k"], d_ff_expert=p["d_ff"]))
    torch.manual_seed(0)
    ours = MoE(cfg).to(device)
    with torch.no_grad():
        for w in ours.parameters():
            w.normal_(0.0, 0.02)
    hf_cfg = MixtralConfig(hidden_size=p["d_model"], intermediate_size=p["d_ff"],
                           num_local_experts=p["n_experts"], num_experts_per_tok=p["top_k"])
    hf = MixtralSparseMoeBlock(hf_cfg).to(device)
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.gate.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([ours.experts.w_gate, ours.experts.w_up], dim=1))
        hf.experts.down_proj.copy_(ours.experts.w_down)
    return ours.to(p["dtype"]).train(), hf.to(p["dtype"]).train()


def run(layer: torch.nn.Module, x: torch.Tensor, batched: bool) -> torch.Tensor:
    out = layer(x[None] if batched else x)
    out.float().sum().backward()
    return out.reshape(x.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    p = PRESETS[args.preset]
    device = torch.device("cuda" if args.preset == "gpu" else "cpu")
    torch.set_num_threads(args.threads)
    ours, hf = build(p, device)
    x = torch.randn(p["tokens"], p["d_model"], device=device, dtype=p["dtype"], generator=None)
    x.requires_grad_(True)

    # Same function: outputs and router gradients agree before anything is timed.
    a = run(ours, x, batched=True)
    ga = ours.router.gate.weight.grad.clone()
    b = run(hf, x, batched=True)
    gb = hf.gate.weight.grad.clone()
    out_diff, grad_diff = float((a - b).detach().abs().max()), float((ga - gb).abs().max())
    # Relative to the largest entry: in bf16 an absolute difference alone says nothing (the router's
    # gradient sums over every token).
    out_rel, grad_rel = out_diff / float(b.detach().abs().max()), grad_diff / float(gb.abs().max())
    print(f"check: max |out diff| {out_diff:.2e} ({out_rel:.1e} of the largest output), max |router grad "
          f"diff| {grad_diff:.2e} ({grad_rel:.1e} of the largest gradient)")
    if p["dtype"] == torch.float32 and not max(out_diff, grad_diff) <= 1e-4:
        raise SystemExit("the two layers disagree: timing them is moot")

    sides = {"lmforge": ours, "transformers": hf}
    times: dict[str, list[float]] = {k: [] for k in sides}
    ref: list[float] = []
    m = torch.randn(1024, 1024)

    def timed(name: str) -> float:
        layer = sides[name]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        run(layer, x, batched=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return dt

    for _ in range(args.warmup):
        for name in sides:
            timed(name)
    for r in range(args.repeats):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            times[name].append(timed(name))
        t = time.perf_counter()
        m @ m
        ref.append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    info = machine_info(preset=args.preset, **{k: str(v) for k, v in p.items()}, threads=args.threads,
                        ref_matmul_gflops=2 * 1024**3 / statistics.median(ref) / 1e9)
    print(json.dumps(info, indent=1))
    rows = [[k, f"{v:.1f}", f"{p['tokens'] / v * 1e3:,.0f}"] for k, v in med.items()]
    print_markdown_table(["side", "ms / fwd+bwd (median)", "tokens/s"], rows)
    ratio = med["transformers"] / med["lmforge"]
    print(f"ratio transformers / lmforge = {ratio:.2f}x (> 1: lmforge faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, median_ms=med, ratio=ratio, out_diff=out_diff, grad_diff=grad_diff,
                           out_rel=out_rel, grad_rel=grad_rel,
                           samples_ms={k: [t * 1e3 for t in v] for k, v in times.items()}), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
