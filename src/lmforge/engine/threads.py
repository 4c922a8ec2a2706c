"""`train.threads: auto`: torch's CPU thread count chosen by timing the candidates on this machine.

What is timed is the MLP of one block at the run's shape (a GEMM into the hidden width, SiLU, a GEMM
back), not a whole training step: the thread count is set before the model exists (the model is built
with it), the MLP's GEMMs are where a CPU step spends most of its time (bench/kernel_floor.py), and its
elementwise op is memory-bound, which is where extra hyperthreads stop paying. It costs tens of
milliseconds a candidate and its verdict is cached per machine and shape like the precision probe's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from lmforge.utils.machine import CpuFacts, ProbeCache, cpu_facts

MAX_ROWS = 2048  # rows of the timed GEMM: enough to load every core, cheap on any CPU
REPEATS = 3
DEADLINE_S = 2.0
NOISE = 0.03  # a candidate must beat torch's default by more than this to replace it

ThreadTimer = Callable[[int], float]  # threads -> seconds of one timed MLP


def candidates(facts: CpuFacts, default: int) -> list[int]:
    """torch's default, the physical and the logical cores, and half the physical cores (on a shared or
    loaded machine, or one with efficiency cores, fewer threads can be faster), each once, ascending."""
    half = max(1, facts.physical_cores // 2)
    return sorted({default, facts.physical_cores, facts.logical_cores, half})


def _mlp_timer(rows: int, d_model: int, d_ff: int) -> ThreadTimer:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_model, generator=gen)
    w1 = torch.randn(d_model, d_ff, generator=gen) / d_model**0.5
    w2 = torch.randn(d_ff, d_model, generator=gen) / d_ff**0.5

    def time_mlp(threads: int) -> float:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        torch.nn.functional.silu(x @ w1) @ w2
        return time.perf_counter() - t0

    return time_mlp


def resolve_threads(setting: int | str | None, *, rows: int, d_model: int, d_ff: int,
                    say: Callable[[str], object] = print, facts: CpuFacts | None = None,
                    cache: ProbeCache | None = None, time_mlp: ThreadTimer | None = None) -> int | None:
    """The thread count to set for `setting` (None: leave torch's default; an int: that). "auto" times
    each candidate REPEATS times, interleaved, within DEADLINE_S, and takes the fastest, keeping torch's
    default unless another count is more than NOISE faster; the choice is said in one line. Under
    OMP_NUM_THREADS the launcher has chosen: auto takes that. torch's thread count is left as it was."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    default = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ:
        say(f"threads auto: {default} (OMP_NUM_THREADS is set)")
        return default
    facts = facts or cpu_facts()
    cands = candidates(facts, default)
    if len(cands) == 1:
        say(f"threads auto: {default} (the only candidate on this machine)")
        return default
    rows, cache = min(rows, MAX_ROWS), cache or ProbeCache()
    key = ProbeCache.key("threads", **facts.key(), candidates=cands, shape=[rows, d_model, d_ff])
    hit = cache.get(key)
    if hit is not None and type(hit.get("threads")) is int and hit["threads"] in cands:
        say(f"threads auto: {hit['threads']} (measured before on this machine; cached in {cache.path})")
        return hit["threads"]
    time_mlp = time_mlp or _mlp_timer(rows, d_model, d_ff)
    best = {n: float("inf") for n in cands}
    spent = 0.0
    try:
        for n in cands:  # a warm-up for each count: the thread pool grows, kernels are chosen
            spent += time_mlp(n)
        for _ in range(REPEATS):
            if spent > DEADLINE_S and all(t < float("inf") for t in best.values()):
                break
            for n in cands:
                t = time_mlp(n)
                spent += t
                best[n] = min(best[n], t)
    finally:
        torch.set_num_threads(default)
    fastest = min(cands, key=lambda n: (best[n], n != default))
    chosen = default if best[default] <= best[fastest] * (1 + NOISE) else fastest
    stored = cache.put(key, {"threads": chosen, "seconds": {str(n): best[n] for n in cands}})
    times = ", ".join(f"{n} thread{'s' * (n != 1)} {best[n] * 1e3:.1f} ms" for n in cands)
    where = f"cached in {cache.path}" if stored else "not cached"
    say(f"threads auto: {chosen} (an MLP of {rows}x{d_model}x{d_ff}: {times}; {where})")
    return chosen
