"""train.tf32 on a GPU: one fp32 training step (no autocast) with TensorFloat-32 matmuls on vs off, in one
process on the same model and batches, interleaved (on, off, off, on, ...), medians; plus the first
step's loss both ways (TF32's rounding, not a different computation).

    python bench/tf32_step.py --json out.json                  # CUDA: ~0.9B Llama shape, 4 x 1024 tokens
    python bench/tf32_step.py --d-model 256 --layers 2 ...     # a smaller shape

Needs CUDA (TF32 is a CUDA matmul mode; train.tf32=true is refused elsewhere): a row of
bench/gpu_suite.sh (`tf32`). The flags are set through lmforge's own set_tf32, as a run sets them.
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
from lmforge.engine.precision import set_tf32  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8, help="rounds of one on-block and one off-block")
    p.add_argument("--steps", type=int, default=2, help="timed steps per block")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tf32_step.py needs CUDA: TF32 is a CUDA matmul mode")
    device = torch.device("cuda")
    cfg = Config.model_validate({
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
                  "vocab_size": args.vocab, "max_seq_len": args.seq, "tie_embeddings": False},
        "train": {"micro_batch_size": args.batch, "precision": "fp32", "device": "cuda", "tf32": False},
    })
    n = args.batch * args.seq
    ids = np.random.default_rng(0).integers(0, args.vocab, size=n * 8 + 1)
    run = build_run(cfg, "experiment", train_data=[ids], say=lambda *_: None)
    batch = run.train_loader.next_batch().to(device)

    def step() -> float:
        result = run.parallel.step([batch], run.optimizer, run.precision, grad_clip=1.0)
        torch.cuda.synchronize()
        return result.loss

    def block(tf32: bool) -> list[float]:
        restore = set_tf32(tf32, device)
        try:
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            return times
        finally:
            restore()

    state = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    opt_state = run.optimizer.state_dict()
    first = {}
    for tf32 in (False, True):  # the same weights and batch: the first loss both ways
        run.model.load_state_dict(state)
        restore = set_tf32(tf32, device)
        with torch.no_grad():
            first[tf32] = float(run.parallel.objective(run.model, batch).loss)
        restore()
    run.optimizer.load_state_dict(opt_state)
    block(True), block(False)  # warm-up (cuBLAS picks its kernels per mode)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for tf32 in ((True, False) if r % 2 == 0 else (False, True)):
            times[tf32] += block(tf32)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    tokens = n
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": {k: getattr(args, k) for k in ("d_model", "layers", "heads", "vocab", "seq", "batch")},
           "step_s_tf32": on, "step_s_ieee": off, "speedup": off / on,
           "tokens_per_s_tf32": tokens / on, "tokens_per_s_ieee": tokens / off,
           "first_loss_ieee": first[False], "first_loss_tf32": first[True],
           "first_loss_rel_diff": abs(first[True] - first[False]) / abs(first[False])}
    print(f"fp32 step: TF32 {on * 1e3:.1f} ms, IEEE {off * 1e3:.1f} ms, speed-up {off / on:.2f}x; first loss "
          f"{first[False]:.6f} vs {first[True]:.6f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
