"""Mixed precision: which dtype to autocast to, and the loss scaler fp16 needs.

`auto` is decided by measurement, not by the device name: on CPUs without native bf16 units a
bf16 matmul is many times slower than fp32 (shared cpu-facts), and on CPUs with AMX the matmuls are
faster but a whole bf16 training step can still be slower, so we time a real step of the model.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from lmforge.engine.loss import logits_of

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bf16_step_speedup(model: torch.nn.Module, batch_size: int, seq_len: int, vocab_size: int,
                      device: torch.device, backward: bool = True, repeats: int = 1) -> float:
    """fp32 time / bf16-autocast time of one forward(+backward) of `model` on a real-sized micro-batch.

    The whole step at the run's own shape is timed, not a matmul: on CPUs with fast bf16 matmuls (AMX)
    the casts and non-matmul ops under autocast make small shapes slower in bf16 and large ones faster
    (measured on a Xeon with AMX: the debug model's 8 x 64 batch 0.58x, the demo model at 1 x 256
    1.1-1.2x, at its real 16 x 256 micro-batch 1.5x).
    Global RNG state is left untouched, so measuring never changes a run's random stream.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen).to(device)
    best = {"fp32": float("inf"), "bf16": float("inf")}
    with torch.random.fork_rng(devices=[]):
        for name in ("fp32", "bf16") * (repeats + 1):  # the first pair warms up kernels
            ctx = contextlib.nullcontext() if name == "fp32" else torch.autocast(device.type, torch.bfloat16)
            t0 = time.perf_counter()
            with torch.set_grad_enabled(backward), ctx:
                out = logits_of(model(x)).float().mean()
            if backward:
                out.backward()
            best[name] = min(best[name], time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return best["fp32"] / best["bf16"]


def resolve_precision(name: str, device: torch.device, model: torch.nn.Module | None = None,
                      batch_size: int = 1, seq_len: int = 128, vocab_size: int = 256,
                      backward: bool = True) -> str:
    """'auto' -> bf16 on a GPU that supports it; on a CPU, bf16 only where a step of this model
    measures clearly faster in bf16 than in fp32 (fp32 when there is no model to measure)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if model is None:
        return "fp32"
    speedup = bf16_step_speedup(model, batch_size, seq_len, vocab_size, device, backward)
    return "bf16" if speedup > 1.1 else "fp32"


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
