"""`lmforge estimate` against measured peaks: the estimate and the measured peak RSS growth of the
busiest rank for each configuration of `lmforge.tools.estimate_measure.grid()`, and the error.

    .venv/bin/python bench/estimate_memory.py            # all configurations, ~5 minutes on 2 cores
    .venv/bin/python bench/estimate_memory.py 0 7 10     # some of them, by index

Each configuration trains 3 steps of random tokens in fresh processes (one per rank, gloo, 1 thread
each) through the real ParallelModel.step; measured = VmHWM - VmRSS after a warm-up, with glibc's
malloc pinned (MALLOC_MMAP_THRESHOLD_=65536, MALLOC_ARENA_MAX=2) so that freed tensors leave RSS.
"""

from __future__ import annotations

import platform
import sys
import time

from lmforge.tools.estimate_measure import compare, grid


def main() -> None:
    pick = {int(a) for a in sys.argv[1:]}
    print(f"machine: {platform.processor() or platform.machine()}, {platform.platform()}")
    print(f"{'#':>2} {'config':36s} {'estimate MiB':>12s} {'measured MiB':>12s} {'error':>7s}")
    worst = 0.0
    for i, (name, config, world_size) in enumerate(grid()):
        if pick and i not in pick:
            continue
        t0 = time.perf_counter()
        est, measured = compare(config, world_size)
        err = (est - measured) / measured
        worst = max(worst, abs(err))
        print(f"{i:2d} {name:36s} {est / 2**20:12.1f} {measured / 2**20:12.1f} {err:+7.1%}"
              f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"largest |error|: {worst:.1%}")


if __name__ == "__main__":
    main()
