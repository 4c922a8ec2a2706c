"""Each optimizer's memory facts: the bytes of state it holds per parameter tensor and the scratch one
step allocates, as its implementation allocates them. The optimizer's spec (optim/builder.py
`OptimizerSpec.memory`) carries them; the memory planner (tools/estimate_parts.py) reads them here,
where no torch import is needed, so `lmforge estimate` stays a config-only computation (importing
builder.py would load torch and every optimizer: ~1 s -> ~7 s on a 2-core machine).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lmforge.config.optim import (
    OPTIMIZER_CONFIGS,
    AdafactorConfig,
    AdamConfig,
    AdamW8bitConfig,
    AdamWConfig,
    MuonConfig,
    OptimConfig,
)


class ParamShape(Protocol):
    """What an optimizer's state size depends on for one parameter tensor (the memory estimator's
    TensorInfo is one)."""

    shape: tuple[int, ...]  # the whole tensor's shape
    local: int  # elements on this rank (after tensor parallelism / FSDP sharding)
    hidden: bool  # a block's linear weight: the matrices Muon orthogonalises

    @property
    def numel(self) -> int: ...


@dataclass(frozen=True)
class MemoryFacts:
    """What an optimizer holds, as it allocates it, for the memory planner (tools/estimate_parts).

    state_bytes: bytes of state one tensor has once it has had its first update (state is created
    lazily at step 1), on a device type ("cpu", "cuda"). step_copies: temporaries one step allocates
    beyond its state, in fp32 copies of the largest tensor (fused Adam updates in place: 0)."""

    state_bytes: Callable[[ParamShape, OptimConfig, str], int]
    step_copies: Callable[[OptimConfig], int]


def _adam_state(t: ParamShape, cfg: OptimConfig, device_type: str) -> int:
    return 8 * t.local + 4  # exp_avg, exp_avg_sq (fp32), step (a 0-dim fp32 tensor)


def _adam_copies(cfg: AdamWConfig | AdamConfig) -> int:
    # fused=None is planned as fused: the kernel exists on both device types the planner sizes
    return 0 if cfg.fused is not False else 2


def _adafactor_state(t: ParamShape, cfg: AdafactorConfig, device_type: str) -> int:
    n = t.local
    total = 4  # step
    if cfg.adafactor.beta1 is not None:
        total += 4 * n
    if len(t.shape) < 2:
        return total + 4 * n  # an unfactored second moment
    rows = math.prod(t.shape[:-1]) * n // max(t.numel, 1)  # this rank's share of the row factor
    cols = math.prod(t.shape[:-2]) * t.shape[-1]
    return total + 4 * (rows + cols)


def _adamw8bit_state(t: ParamShape, cfg: AdamW8bitConfig, device_type: str) -> int:
    q, n = cfg.adamw8bit, t.local
    bnb = device_type == "cuda" and q.backend != "torch" and q.block_size == 256
    if n < q.min_size:
        return 8 * n + 4  # fp32 moments for small tensors
    block = 256 if bnb else q.block_size
    total = 2 * n + 2 * 4 * math.ceil(n / block) + 4  # int8 moments, an fp32 scale per block each, step
    return total + (2 * 256 * 4 if bnb else 0)  # bitsandbytes keeps both quantisation maps per tensor


def _muon_state(t: ParamShape, cfg: MuonConfig, device_type: str) -> int:
    return 4 * t.local if t.hidden else 8 * t.local + 4  # momentum; AdamW's state on the rest


def _copies(n: int) -> Callable[[OptimConfig], int]:
    return lambda cfg: n


_ADAM = MemoryFacts(_adam_state, _adam_copies)
MEMORY: dict[str, MemoryFacts] = {
    "adamw": _ADAM,
    "adam": _ADAM,
    "sgd": MemoryFacts(lambda t, cfg, dev: 4 * t.local if cfg.sgd.momentum > 0 else 0, _copies(1)),
    "lion": MemoryFacts(lambda t, cfg, dev: 4 * t.local, _copies(1)),  # momentum
    "adafactor": MemoryFacts(_adafactor_state, _copies(3)),
    "adamw8bit": MemoryFacts(_adamw8bit_state, _copies(5)),
    "sophia": MemoryFacts(_adam_state, _copies(2)),  # exp_avg, hessian, step
    "muon": MemoryFacts(_muon_state, _copies(3)),
}
assert MEMORY.keys() == OPTIMIZER_CONFIGS.keys(), "every optimizer in the config schema has its memory facts"
