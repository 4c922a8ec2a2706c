"""What keeps a long run alive: the non-finite guard and loss-spike detection (early stopping is a
callback: lmforge.train.callbacks).

Each is a small Stateful object fed one number per step that answers a question; the trainer acts
on the answers (skip an update, roll back, stop). Their state is part of the run state in every
checkpoint, so a resumed run judges exactly as the uninterrupted one.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from lmforge.config.schema import StabilityConfig

# MAD of a normal distribution is 0.6745 sigma: this makes the robust z-score comparable to a z-score.
_MAD_TO_SIGMA = 0.6745


class NonFiniteGuard:
    """Counts consecutive steps whose loss or gradients were NaN/Inf (each one skipped)."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.consecutive = 0

    def observe(self, finite: bool) -> bool:
        """Record one step; True when the run must stop (K non-finite steps in a row)."""
        self.consecutive = 0 if finite else self.consecutive + 1
        return self.consecutive >= self.max_consecutive

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive}

    def load_state_dict(self, sd: dict) -> None:
        self.consecutive = int(sd["consecutive"])


@dataclass
class Spike:
    loss: float
    median: float
    z: float


def robust_z(x: float, history: list[float]) -> tuple[float, float]:
    """(robust z-score of x against history, median): 0.6745 (x - median) / MAD (Iglewicz-Hoaglin)."""
    med = statistics.median(history)
    mad = statistics.median(abs(h - med) for h in history)
    # A flat history (MAD 0) would call any rise a spike; floor the MAD at a relative 1e-3.
    mad = max(mad, 1e-3 * abs(med), 1e-12)
    return _MAD_TO_SIGMA * (x - med) / mad, med


class SpikeDetector:
    """Flags a step loss that sits far above the trailing window's median (one-sided: a drop in
    loss is never a problem). Spikes do not enter the window, so one spike cannot mask the next."""

    def __init__(self, cfg: StabilityConfig) -> None:
        self.window = cfg.spike_window
        self.min_history = cfg.spike_min_history
        self.threshold = cfg.spike_z
        self.history: deque[float] = deque(maxlen=self.window)
        self.recoveries = 0

    def check(self, loss: float) -> Spike | None:
        """Judge `loss` (before its update is applied); None when it is normal."""
        if not math.isfinite(loss):
            return None  # the non-finite guard's business
        if len(self.history) >= self.min_history:
            z, med = robust_z(loss, list(self.history))
            if z > self.threshold:
                return Spike(loss, med, z)
        self.history.append(loss)
        return None

    def state_dict(self) -> dict:
        return {"history": list(self.history), "recoveries": self.recoveries}

    def load_state_dict(self, sd: dict) -> None:
        self.history = deque(sd["history"], maxlen=self.window)
        self.recoveries = int(sd["recoveries"])
