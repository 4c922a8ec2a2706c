"""Throughput, model FLOP utilisation and memory.

MFU's denominator is measured on this machine in this run (a large matmul in the training
dtype), never taken from a spec sheet: on shared CPUs the achievable peak moves with load.
"""

from __future__ import annotations

import resource
import sys
import time

import torch


def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 2048,
                       repeats: int = 5) -> float:
    """Best achieved FLOP/s of an n x n matmul in `dtype` on `device`."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # a run's RNG stays
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # warm-up
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far: allocated by torch on a GPU, the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


class Throughput:
    """Tokens and seconds over a logging window; the clock can be paused around eval/checkpoints."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, tokens: int) -> None:
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None
        self.tokens += tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
