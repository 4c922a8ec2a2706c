"""Checkpoint load time: lmforge's safe reading (allow-listed metadata unpickler, weights-only
non-tensor values, metadata checked before DCP reads it) against torch.distributed.checkpoint's plain
FileSystemReader + DefaultLoadPlanner, on the same checkpoint, interleaved, medians.

    .venv/bin/python bench/checkpoint_io.py                 # the 10m preset + AdamW state, 15 rounds
    .venv/bin/python bench/checkpoint_io.py --preset 125m --rounds 5

The checkpoint is written once by lmforge's CheckpointManager (model, flattened AdamW state with its
param-group values, run state). Each round loads it into the same model and optimizer both ways (the
order alternates); the files are in the page cache after the first round, so this times the parsing
and copying the safety adds, not the disk. Saving is unchanged (the same dcp.save call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lmforge.checkpoint.manager import CheckpointManager, _options, _quiet_single_process, load_states
from lmforge.config import ModelConfig
from lmforge.config.optim import optim_config
from lmforge.models import build_model
from lmforge.optim.builder import build_optimizer
from machine import machine_info  # bench/machine.py (on sys.path)

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_io.json"


def plain_load(path: Path, model, optimizer) -> None:
    """What torch's documentation shows: dcp.load with its default reader and planner."""
    options = _options()
    model_sd, optim_sd = get_state_dict(model, [optimizer], options=options)
    state = {"model": model_sd, "optim": optim_sd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path / "state"))
    set_state_dict(model, [optimizer], model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="10m")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=args.preset, vocab_size=8192))
    opt = build_optimizer(model, optim_config())
    model(torch.zeros(1, 8, dtype=torch.long)).float().mean().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {"plain": [], "lmforge": []}
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        path = CheckpointManager(Path(d), keep_last=1).save(1, model, opt, {})
        save_s = time.perf_counter() - t0
        sides = {
            "plain": lambda: plain_load(path, model, opt),
            "lmforge": lambda: load_states(path, model, opt),
        }
        for fn in sides.values():
            fn()  # warm: page cache, first-call setup
        for r in range(args.rounds):
            for name in (("plain", "lmforge") if r % 2 == 0 else ("lmforge", "plain")):
                t0 = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = med["lmforge"] / med["plain"]
    print(f"{args.preset}: {n / 1e6:.1f}M params + AdamW state, checkpoint {size / 2**20:.0f} MiB, "
          f"save {save_s:.2f} s")
    print(f"load median: plain DCP {med['plain']:.1f} ms, lmforge safe {med['lmforge']:.1f} ms, "
          f"ratio {ratio:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            dict(
                machine=machine_info(threads=args.threads),
                command=" ".join(sys.argv),
                params=n,
                checkpoint_bytes=size,
                median_ms=med,
                ratio=ratio,
                raw_s=times,
            ),
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
