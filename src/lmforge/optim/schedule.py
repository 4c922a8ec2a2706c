"""Learning-rate schedules as pure functions of the step: step -> lr multiplier in [0, 1].

Pure functions make resume trivial (the step counter is the whole state) and let
`LambdaLR`-free code ask "what lr will step k use?" without building an optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lmforge.config.schema import ScheduleConfig


def lr_multiplier(step: int, cfg: ScheduleConfig, max_steps: int) -> float:
    """The factor applied to the peak lr at optimizer step `step` (0-based).

    Linear warm-up from 0 to the peak over `warmup_steps`, then a cosine or linear decay to
    `min_lr_ratio` at `decay_steps` (default: max_steps), then flat. The same values as
    transformers' `get_*_schedule_with_warmup` (step 0 of a warm-up has lr 0).
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        return step / warmup
    if cfg.name == "constant":
        return 1.0
    end = cfg.decay_steps or max_steps
    span = max(1, end - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = cfg.min_lr_ratio
    if cfg.name == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * (1.0 - progress)


def make_schedule(cfg: ScheduleConfig, max_steps: int, peak_lr: float) -> Callable[[int], float]:
    """step -> absolute lr."""
    return lambda step: peak_lr * lr_multiplier(step, cfg, max_steps)
