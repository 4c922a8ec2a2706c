"""Prefix-LM / GLM attention (a bidirectional prefix, then causal, per packed document): the dense boolean
mask lmforge runs on a CPU against the flex-attention BlockMask it runs on a GPU, through the whole model.

    python bench/prefix_attention.py                                   # CUDA: ~1 minute on an H100/H200
    python bench/prefix_attention.py --preset tiny --device cpu --rounds 2 --json /tmp/prefix.json

Rows of --seq tokens packed with documents of log-normal lengths (median seq / 6, sigma 0.9), each with a
prefix of a uniform fraction of its length (the prefix_lm objective's default rule), the targets after the
prefix only; one forward + backward of lmforge's Transformer with `packed_attention` = mask, then flex
(models/common/prefix_masks.py builds either from the segment ids and prefix ends, once per step). The
gpu preset: d_model 1024, 8 layers, 16 heads of 64, batch 4 x 2048, bf16 autocast; tiny: d 64, 2 layers,
fp32, forward only (torch's flex attention has no backward on a CPU). Correctness: the loss and (on a GPU)
every gradient of flex against the dense mask (fp32 on a CPU: ~1e-6; bf16 on a GPU: rounding). Speed:
--warmup steps each, then --rounds rounds of one step each, the order alternating; median ms per step and
the ratio. Never asserts; prints machine info and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from lmforge.config import ModelConfig  # noqa: E402
from lmforge.models import build_model  # noqa: E402
from machine import machine_info, print_markdown_table  # noqa: E402  bench/machine.py (on sys.path)

PRESETS = {"gpu": dict(d_model=1024, n_layers=8, n_heads=16, vocab=32000, seq=2048, batch=4),
           "tiny": dict(d_model=64, n_layers=2, n_heads=4, vocab=512, seq=128, batch=2)}


def packed_rows(B: int, T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(segment_ids, prefix_end, position_ids), each (B, T): documents one after another, each with a
    prefix of round(u x length) positions (at least 1, at most length - 1)."""
    seg = torch.empty(B, T, dtype=torch.long)
    end = torch.empty(B, T, dtype=torch.long)
    pos = torch.empty(B, T, dtype=torch.long)
    for b in range(B):
        t, d = 0, 0
        while t < T:
            z = torch.randn(1, generator=gen).item()
            n = min(T - t, max(2, int(math.exp(math.log(T / 6) + 0.9 * z))))
            p = min(max(1, round(torch.rand(1, generator=gen).item() * n)), max(n - 1, 1))
            seg[b, t:t + n], end[b, t:t + n] = d, t + p
            pos[b, t:t + n] = torch.arange(n)
            t, d = t + n, d + 1
    return seg, end, pos


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    p, device = PRESETS[args.preset], torch.device(args.device)
    bf16 = device.type == "cuda"
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    cfg = ModelConfig(vocab_size=p["vocab"], d_model=p["d_model"], n_layers=p["n_layers"],
                      n_heads=p["n_heads"], max_seq_len=p["seq"])
    with torch.device(device):
        model = build_model(cfg)
    B, T = p["batch"], p["seq"]
    ids = torch.randint(0, p["vocab"], (B, T), generator=gen).to(device)
    seg, end, pos = (x.to(device) for x in packed_rows(B, T, gen))
    after = torch.arange(T, device=device)[None] >= end  # the targets: after each document's prefix
    targets = torch.where(after, torch.roll(ids, -1, 1), -100)

    backward = device.type == "cuda"  # torch's flex attention has no backward on a CPU

    def step(kernel: str) -> tuple[float, dict[str, torch.Tensor]]:
        model.packed_attention = kernel
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16), torch.set_grad_enabled(backward):
            logits = model(ids, position_ids=pos, segment_ids=seg, prefix_end=end)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        if not backward:
            return loss.item(), {}
        loss.backward()
        return loss.item(), {n: q.grad.detach().float().clone() for n, q in model.named_parameters()}

    def timed(kernel: str) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step(kernel)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    kernels = ("mask", "flex")
    results = {k: step(k) for k in kernels}
    (loss_m, grads_m), (loss_f, grads_f) = results["mask"], results["flex"]
    grad_diff = max((grads_m[n] - grads_f[n]).abs().max().item() for n in grads_m) if backward else None
    for _ in range(args.warmup):
        for k in kernels:
            timed(k)
    ms = {k: [] for k in kernels}
    for r in range(args.rounds):
        for k in (kernels if r % 2 == 0 else kernels[::-1]):
            ms[k].append(timed(k))
    med = {k: statistics.median(v) for k, v in ms.items()}
    out = dict(machine_info(), device=str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
               preset=args.preset, shape=p, dtype="bf16" if bf16 else "fp32", rounds=args.rounds,
               step="forward + backward" if backward else "forward (no flex backward on a CPU)",
               ms_per_step=med, flex_speedup=med["mask"] / med["flex"], loss_mask=loss_m, loss_flex=loss_f,
               loss_diff=abs(loss_m - loss_f), grad_max_diff=grad_diff)
    print_markdown_table(["kernel", "ms / step (median)"], [[k, f"{med[k]:.1f}"] for k in kernels])
    grads = "no backward" if grad_diff is None else f"max gradient diff {grad_diff:.2e}"
    print(f"flex vs mask ({out['step']}): {out['flex_speedup']:.2f}x; loss {loss_m:.6f} vs {loss_f:.6f} "
          f"(diff {out['loss_diff']:.2e}); {grads}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
