"""train.optimizer_offload=cpu on a GPU: device memory held between steps (weights + optimizer state) and
step time, with and without the offload, same shape, one process, interleaved blocks, medians.

    python bench/optimizer_offload.py --json out.json       # ~0.9B Llama shape, bf16 autocast, AdamW

On CUDA: a row of bench/gpu_suite.sh (`opt_offload`). With --device cpu (the state is in host memory
either way) it measures what the offload path costs in copies alone, at the shape given:

    python bench/optimizer_offload.py --device cpu --d-model 256 --layers 4 --heads 4 --vocab 4096 \
        --seq 256 --batch 8 --rounds 6 --json bench/results/optimizer_offload_cpu.json
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


def make(offload: str, args):
    device = args.device
    cfg = Config.model_validate({
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
                  "vocab_size": args.vocab, "max_seq_len": args.seq, "tie_embeddings": False},
        "train": {"micro_batch_size": args.batch, "precision": "bf16" if device == "cuda" else "fp32",
                  "device": device, "threads": None if device == "cuda" else 2,
                  "optimizer_offload": offload},
    })
    ids = np.random.default_rng(0).integers(0, args.vocab, size=args.batch * args.seq * 4 + 1)
    return build_run(cfg, "experiment", train_data=[ids], say=lambda *_: None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("optimizer_offload.py needs CUDA (or --device cpu)")
    sys.path.insert(0, str(REPO / "bench"))
    from machine import machine_info

    out: dict = {"machine": machine_info(device=args.device,
                                         gpu=torch.cuda.get_device_name() if cuda else None),
                 "shape": {k: getattr(args, k)
                           for k in ("d_model", "layers", "heads", "vocab", "seq", "batch")}}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {"none": [], "cpu": []}
    held: dict[str, int] = {}
    for r in range(args.rounds):
        for variant in (("none", "cpu") if r % 2 == 0 else ("cpu", "none")):
            if cuda:
                torch.cuda.empty_cache()
            run = make(variant, args)
            batch = run.train_loader.next_batch().to(args.device)
            for i in range(args.steps + 1):
                sync()
                t0 = time.perf_counter()
                run.parallel.step([batch], run.optimizer, run.precision, grad_clip=1.0)
                sync()
                if i:  # the first step creates the optimizer state
                    times[variant].append(time.perf_counter() - t0)
            held[variant] = torch.cuda.memory_allocated() if cuda else 0
            del run, batch
    med = {k: statistics.median(v) for k, v in times.items()}
    out.update(step_s=med, held_bytes_between_steps=held, slowdown=med["cpu"] / med["none"],
               device_bytes_saved=held["none"] - held["cpu"])
    print(f"offload: {held['cpu'] / 2**30:.2f} GiB held vs {held['none'] / 2**30:.2f} GiB (0: a CPU); step "
          f"{med['cpu'] * 1e3:.0f} ms vs {med['none'] * 1e3:.0f} ms ({med['cpu'] / med['none']:.3f}x)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
