"""Mixed precision: which dtype to autocast to, and the loss scaler fp16 needs.

`auto` is decided by measurement, not by the device name: on CPUs without native bf16 units a
bf16 matmul is many times slower than fp32 (shared cpu-facts), so we time both.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import cache

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@cache
def bf16_speedup_on_cpu(n: int = 256, repeats: int = 3) -> float:
    """fp32 time / bf16 time of an n x n matmul on this CPU (> 1 means bf16 is faster)."""

    def best(dtype: torch.dtype) -> float:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        torch.mm(a, b)  # warm-up: first call pays for kernel selection
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.float32) / best(torch.bfloat16)


def resolve_precision(name: str, device: torch.device) -> str:
    """'auto' -> 'bf16' on a GPU that supports it, else bf16 only on a CPU where it measures faster."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if bf16_speedup_on_cpu() > 1.0 else "fp32"


@dataclass
class Precision:
    """Autocast context and gradient scaler for one resolved precision."""

    name: str
    device: torch.device

    def __post_init__(self) -> None:
        self.dtype = _DTYPES[self.name]
        # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range and needs none.
        self.scaler = torch.amp.GradScaler(self.device.type) if self.name == "fp16" else None

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, sd: dict) -> None:
        if self.scaler is not None and sd.get("scaler"):
            self.scaler.load_state_dict(sd["scaler"])
