"""Throughput, model FLOP utilisation and memory.

MFU's denominator is the hardware's peak for the dtype the matmuls run in: on known GPUs the vendor's
datasheet figure (dense, no sparsity), as torchtitan and nanoGPT use, because a probe matmul reaches
only part of it (a 2048^3 bf16 matmul reads ~420 TFLOP/s on an H100 whose datasheet says 989); on
CPUs, which have no such table, a short measured matmul in fp32, or in bf16 where that is faster
(AMX). fp16 on a CPU is emulated, so its honest peak is the fp32 one, and it is never probed (a large
fp16 probe took minutes and produced an MFU of 995%).
"""

from __future__ import annotations

import resource
import sys
import time

import torch

# Dense peak FLOP/s by GPU (matched against torch.cuda.get_device_name) and matmul dtype. "tf32" is
# fp32 with TF32 tensor cores allowed (torch.backends.cuda.matmul.allow_tf32); "fp32" without them.
# Sources: NVIDIA data sheets (H100/H200 SXM and PCIe, A100, L40S, L4, A10, V100, RTX 4090/3090).
GPU_PEAKS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("H200",), {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    (("H100", "PCIe"), {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    (("H100",), {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}),  # SXM / HBM3
    (("A100",), {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (("L40S",), {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    (("L4",), {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    (("A10",), {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (("V100",), {"fp16": 125e12, "tf32": 15.7e12, "fp32": 15.7e12}),
    (("RTX 4090",), {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    (("RTX 3090",), {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
]
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def datasheet_peak(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """The dense datasheet peak of a GPU for `dtype`, or None for a GPU (or dtype) not in the table."""
    key = _NAMES.get(dtype)
    if key == "fp32" and tf32:
        key = "tf32"
    for parts, peaks in GPU_PEAKS:
        if all(p in device_name for p in parts):
            return peaks.get(key) if key else None
    return None


def peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """(MFU denominator in FLOP/s, where it comes from) for matmuls in `dtype` on `device`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = datasheet_peak(name, dtype, torch.backends.cuda.matmul.allow_tf32)
        if peak is not None:
            return peak, f"{name} datasheet, {_NAMES[dtype]}"
        measured = measure_peak_flops(device, dtype, n=4096)
        return measured, f"{name}: measured {_NAMES.get(dtype, dtype)} matmul"
    fp32 = measure_peak_flops(device, torch.float32, n=1024, repeats=3)
    if dtype == torch.bfloat16:  # bf16 units (AMX) make it faster; without them it is emulated and slower
        bf16 = measure_peak_flops(device, torch.bfloat16, n=512, repeats=2)
        if bf16 > fp32:
            return bf16, "measured bf16 matmul"
    return fp32, "measured fp32 matmul"


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
