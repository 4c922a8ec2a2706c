"""Learning-rate schedules as pure functions: position -> lr multiplier (1 at the peak lr).

Pure functions make resume trivial (the step counter and the tokens seen are the whole state) and let
`LambdaLR`-free code ask "what lr will step k use?" without building an optimizer. A schedule counts
optimizer steps or tokens seen (`schedule.unit`); counting tokens keeps the warm-up and decay where
they belong when the batch size ramps up and steps stop being proportional to tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lmforge.config.schema import UNIT_SUFFIX, ScheduleConfig
from lmforge.errors import ConfigError

DEFAULT_WARMUP_STEPS = 100
DEFAULT_COOLDOWN_FRACTION = 0.2  # Hägele et al. 2024: a 20% cooldown matches a full cosine run
DEFAULT_TIMESCALE_STEPS = 10_000  # transformers' get_inverse_sqrt_schedule without warm-up


def _length(cfg: ScheduleConfig, key: str) -> float | None:
    """The `key` length (warmup, decay, cooldown, timescale) in the schedule's unit, as configured."""
    return getattr(cfg, f"{key}_{UNIT_SUFFIX[cfg.unit]}")


def warmup_length(cfg: ScheduleConfig) -> float:
    """The linear warm-up in `cfg.unit`: the key that was set, else 100 steps (one_cycle: none)."""
    n = _length(cfg, "warmup")
    if n is not None:
        return n
    return DEFAULT_WARMUP_STEPS if cfg.unit == "steps" and cfg.name != "one_cycle" else 0


def decay_end(cfg: ScheduleConfig, total: float) -> float:
    """Where the decay (one_cycle: the cycle) ends, in `cfg.unit`: the key that was set, else `total`."""
    n = _length(cfg, "decay")
    return total if n is None else n


def lr_multiplier(x: float, cfg: ScheduleConfig, total: float) -> float:
    """The factor applied to the peak lr at position `x` (0-based): the optimizer step about to be
    taken, or the tokens seen (unit tokens) or seconds trained (unit time) before it. `total` is the
    run's length in the same unit (train.max_steps, the tokens the whole run sees, train.max_time).

    Every schedule but one_cycle starts with a linear warm-up from 0 (wsd: from min_lr_ratio, as
    transformers' `get_wsd_schedule`) to the peak. The values equal transformers'
    `get_*_schedule_with_warmup` / `get_inverse_sqrt_schedule` / `get_wsd_schedule` and torch's
    `OneCycleLR` (step 0 of a warm-up has lr 0); past the decay end the lr stays at its floor.
    """
    if cfg.name == "one_cycle":
        return _one_cycle(x, cfg, decay_end(cfg, total))
    warmup = warmup_length(cfg)
    floor = cfg.min_lr_ratio
    if x < warmup:
        if cfg.name == "wsd":
            return x / warmup * (1.0 - floor) + floor
        return x / warmup
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "inverse_sqrt":
        timescale = _timescale(cfg, warmup)
        return 1.0 / math.sqrt((x + (timescale - warmup)) / timescale)
    end = decay_end(cfg, total)
    if cfg.name in ("wsd", "constant_cooldown"):
        return _cooldown(x, cfg, end, floor)
    span = max(1, end - warmup)
    progress = min(1.0, (x - warmup) / span)
    if cfg.name == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.name == "polynomial":
        return floor + (1.0 - floor) * (1.0 - progress) ** cfg.power
    return floor + (1.0 - floor) * (1.0 - progress)


Multiplier = Callable[..., float]  # (step, tokens_seen, seconds=0.0) -> factor


def make_multiplier(cfg: ScheduleConfig, max_steps: int, max_tokens: int,
                    max_seconds: float | None = None) -> Multiplier:
    """(step, tokens_seen, seconds=0.0) -> the factor on the peak lr for the optimizer step about to be
    taken (0-based step; tokens seen and seconds trained before it). `max_tokens` is what the whole
    run will see, `max_seconds` its wall-clock budget (needed by unit=time)."""
    if cfg.unit == "time":
        if max_seconds is None:
            raise ConfigError("schedule.unit=time needs the wall-clock budget train.max_time")
        total: float = max_seconds
    else:
        total = max_steps if cfg.unit == "steps" else max_tokens
        if total < 1:
            raise ConfigError(f"a schedule in {cfg.unit} needs a run of at least one {cfg.unit[:-1]}, "
                              f"got {total}")
    if cfg.name == "one_cycle" and _one_cycle_peak(cfg, decay_end(cfg, total)) <= 0:
        raise ConfigError(f"schedule.pct_start={cfg.pct_start} puts one_cycle's peak before the first "
                          f"step of a {decay_end(cfg, total)}-step cycle; raise pct_start or train longer")
    if cfg.unit == "time":
        return lambda step, tokens_seen, seconds=0.0: lr_multiplier(seconds, cfg, total)
    if cfg.unit == "tokens":
        return lambda step, tokens_seen, seconds=0.0: lr_multiplier(tokens_seen, cfg, total)
    return lambda step, tokens_seen, seconds=0.0: lr_multiplier(step, cfg, total)


def make_schedule(cfg: ScheduleConfig, peak_lr: float, max_steps: int, max_tokens: int,
                  max_seconds: float | None = None) -> Multiplier:
    """(step, tokens_seen, seconds=0.0) -> absolute lr for the optimizer step about to be taken."""
    multiplier = make_multiplier(cfg, max_steps, max_tokens, max_seconds)
    return lambda step, tokens_seen, seconds=0.0: peak_lr * multiplier(step, tokens_seen, seconds)


class LRSchedule:
    """Sets every parameter group's lr to its own initial lr x the schedule's multiplier x `scale`
    (a factor the run may lower, e.g. after a loss spike).

    The initial lrs are read once from the optimizer as built from the config (Muon's matrices start
    at optim.muon.lr, everything else at optim.lr), so one rule serves every optimizer and a resumed
    run follows the config, not the lrs its checkpoint happened to hold. Stateless: the step and the
    tokens seen and the seconds trained (the trainer's progress and clock) are the whole position.
    """

    def __init__(self, cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, base_lr: float, max_steps: int,
                 max_tokens: int, max_seconds: float | None = None) -> None:
        self.multiplier = make_multiplier(cfg, max_steps, max_tokens, max_seconds)
        self.base_lr = base_lr
        self.initial = [g["lr"] for g in optimizer.param_groups]

    def apply(
        self, optimizer: torch.optim.Optimizer, step: int, tokens_seen: int, scale: float = 1.0,
        seconds: float = 0.0,
    ) -> float:
        """Set the lrs for the coming step; returns the headline lr (base_lr's), as logged."""
        m = self.multiplier(step, tokens_seen, seconds)
        set_lrs(optimizer, self.initial, m, scale)
        return self.base_lr * m * scale


def set_lrs(optimizer: torch.optim.Optimizer, initial: list[float | None], multiplier: float,
            scale: float = 1.0) -> None:
    """Each group's lr = its initial lr x multiplier x scale. A group without an lr (Adafactor's
    relative step computes its own) is left alone."""
    for group, lr0 in zip(optimizer.param_groups, initial, strict=True):
        if lr0 is not None:
            group["lr"] = lr0 * multiplier * scale


def _timescale(cfg: ScheduleConfig, warmup: float) -> float:
    t = _length(cfg, "timescale")
    if t is not None:
        return t
    return warmup or DEFAULT_TIMESCALE_STEPS  # tokens without warm-up: the config demands timescale_tokens


def _cooldown(x: float, cfg: ScheduleConfig, end: float, floor: float) -> float:
    """Flat at the peak, then the final decay over [end - length, end) to `floor`, then the floor.

    The decay window is anchored at the end, so a warm-up that overlaps it wins where they meet,
    exactly as transformers' wsd does when its stable phase comes out negative.
    """
    length = _length(cfg, "cooldown")
    if length is None:
        length = (cfg.cooldown_fraction or DEFAULT_COOLDOWN_FRACTION) * end
    start = end - length
    if x < start:
        return 1.0
    if x >= end:
        return floor
    progress = (x - start) / length
    if cfg.decay_shape == "linear":
        factor = 1.0 - progress
    elif cfg.decay_shape == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - math.sqrt(progress)
    return factor * (1.0 - floor) + floor


def _one_cycle_peak(cfg: ScheduleConfig, end: float) -> float:
    # OneCycleLR numbers steps 0..total-1, so its rise ends at pct_start*total - 1 and its floor is reached
    # at step total-1. Counted in tokens or seconds the cycle is continuous: from 0 to the run's end.
    return cfg.pct_start * end - (1 if cfg.unit == "steps" else 0)


def _one_cycle(x: float, cfg: ScheduleConfig, end: float) -> float:
    """torch's OneCycleLR (anneal_strategy="cos", three_phase=False) as a multiplier of its max_lr:
    a cosine rise from 1/div_factor to 1, then a cosine fall to 1/(div_factor*final_div_factor)."""
    start_lr = 1.0 / cfg.div_factor
    min_lr = start_lr / cfg.final_div_factor
    peak_at = _one_cycle_peak(cfg, end)
    if x <= peak_at:
        return _cos_anneal(start_lr, 1.0, x / peak_at)
    last = end - 1 if cfg.unit == "steps" else end
    return _cos_anneal(1.0, min_lr, min(1.0, (x - peak_at) / (last - peak_at)))


def _cos_anneal(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
