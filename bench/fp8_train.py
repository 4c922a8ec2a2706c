"""train.fp8 on a GPU: FP8 (torchao float8, tensorwise and rowwise) vs bf16 training, compiled, in one
process, the same seeded model and batches.

    python bench/fp8_train.py --json out.json            # loss over 200 steps at d1024 L8, then speed at 1.1B
    python bench/fp8_train.py --loss-steps 50 --speed-steps 10 --skip-speed

Loss: each variant trains --loss-steps steps from the same weights on the same batches; the report gives
each FP8 variant's mean loss over the last 50 steps relative to bf16's (torchao and torchtitan report
FP8 loss curves within noise of bf16; the number is for the reader to judge against that). Speed: the
Llama 1.1B shape (22 layers, d2048, GQA 32/4, 2048 tokens x 4) steps, the variants' blocks of steps
interleaved, medians; tokens/s and the speed-up over bf16. Needs CUDA with compute capability >= 8.9
(a row of bench/gpu_suite.sh: `fp8`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from lmforge.assembly import build_run  # noqa: E402
from lmforge.config.schema import Config  # noqa: E402

VARIANTS = ("none", "tensorwise", "rowwise")
LOSS_SHAPE = dict(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=16, vocab_size=32768, max_seq_len=1024)
SPEED_SHAPE = dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, vocab_size=32000,
                   max_seq_len=2048)


def make_run(shape: dict, fp8: str, batch: int, lr: float):
    cfg = Config.model_validate({
        "model": {**shape, "tie_embeddings": False},
        "optim": {"lr": lr},
        "train": {"micro_batch_size": batch, "precision": "bf16", "device": "cuda", "compile": True,
                  "fp8": fp8},
    })
    n = batch * shape["max_seq_len"]
    ids = np.random.default_rng(0).integers(0, shape["vocab_size"], size=n * 4 + 1)
    return build_run(cfg, "experiment", train_data=[ids], say=lambda *_: None)


def batches_for(shape: dict, batch: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Learnable data: a fixed random bigram walk, so the loss falls and FP8's effect on it shows."""
    g = np.random.default_rng(seed)
    v = shape["vocab_size"]
    nxt = g.integers(0, v, size=(v, 4))
    out = []
    for _ in range(steps):
        rows = np.empty((batch, shape["max_seq_len"] + 1), dtype=np.int64)
        rows[:, 0] = g.integers(0, v, size=batch)
        choice = g.integers(0, 4, size=rows.shape)
        for t in range(1, rows.shape[1]):
            rows[:, t] = nxt[rows[:, t - 1], choice[:, t]]
        out.append(torch.from_numpy(rows).cuda())
    return out


def step(run, batch) -> float:
    result = run.parallel.step([batch], run.optimizer, run.precision, grad_clip=1.0)
    return result.loss


def loss_part(args) -> dict:
    data = batches_for(LOSS_SHAPE, args.batch, args.loss_steps)
    curves = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        run = make_run(LOSS_SHAPE, variant, args.batch, 3e-4)
        curves[variant] = [float(step(run, b)) for b in data]
        del run
        torch.cuda.empty_cache()
    tail = {k: statistics.fmean(c[-50:]) for k, c in curves.items()}
    return {"shape": LOSS_SHAPE, "steps": args.loss_steps, "tail_mean_loss": tail,
            "rel_diff_vs_bf16": {k: tail[k] / tail["none"] - 1 for k in VARIANTS if k != "none"},
            "curves": curves}


def speed_part(args) -> dict:
    runs = {v: make_run(SPEED_SHAPE, v, args.speed_batch, 3e-4) for v in VARIANTS}
    data = batches_for(SPEED_SHAPE, args.speed_batch, 2)
    for run in runs.values():  # compile and autotune
        for _ in range(3):
            step(run, data[0])
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.speed_steps):
        for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            t0 = time.perf_counter()
            step(runs[v], data[r % 2])
            torch.cuda.synchronize()
            times[v].append(time.perf_counter() - t0)
    tokens = args.speed_batch * SPEED_SHAPE["max_seq_len"]
    med = {v: statistics.median(t) for v, t in times.items()}
    return {"shape": SPEED_SHAPE, "batch": args.speed_batch, "step_s": med,
            "tokens_per_s": {v: tokens / s for v, s in med.items()},
            "speedup_vs_bf16": {v: med["none"] / med[v] for v in VARIANTS if v != "none"}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loss-steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--speed-steps", type=int, default=12)
    p.add_argument("--speed-batch", type=int, default=4)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("fp8_train.py needs a CUDA GPU of compute capability 8.9 or later")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "loss": loss_part(args)}
    diffs = out["loss"]["rel_diff_vs_bf16"]
    print("loss, last 50 steps vs bf16:", {k: f"{v:+.4f}" for k, v in diffs.items()})
    if not args.skip_speed:
        out["speed"] = speed_part(args)
        ups = out["speed"]["speedup_vs_bf16"]
        print("speed-up vs bf16 at 1.1B:", {k: f"{v:.2f}x" for k, v in ups.items()})
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
