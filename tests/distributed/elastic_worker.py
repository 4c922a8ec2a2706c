"""A torchrun worker for test_launch: joins the job through lmforge.parallel.process_group, checks an
all-reduce, and - when asked - dies on the first attempt so that torchrun restarts everyone."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.parallel.process_group import init_distributed, shutdown

if __name__ == "__main__":
    out, crash_first = Path(sys.argv[1]), sys.argv[2] == "crash"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world = init_distributed(timeout_s=30)
    t = torch.tensor([world.rank + 1.0])
    dist.all_reduce(t)
    if crash_first and attempt == 0 and world.rank == 1:
        sys.exit(3)  # a rank lost mid-run
    n = world.world_size
    (out / f"rank{world.rank}_attempt{attempt}.txt").write_text(
        f"{t.item()} {n * (n + 1) / 2} {torch.get_num_threads()}")
    shutdown()
