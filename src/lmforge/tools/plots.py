"""Planning plots: the lr schedule a config will use, and the loss of a learning-rate range test
(a run's own loss / lr curves are drawn by `lmforge.metrics.curves`)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.metrics.curves import pyplot, save_figure

if TYPE_CHECKING:
    from lmforge.config.schema import Config


@dataclass
class ScheduleCurve:
    """The lr of every optimizer step of a run, and the tokens seen before each step. A schedule over a
    wall-clock budget (unit time) has no steps known in advance: its points are evenly spaced seconds of
    training (`seconds`), and `tokens` is empty."""

    lrs: list[float]
    tokens: list[int]
    max_tokens: int
    unit: str
    warmup_end: int | None  # first step past the warm-up (one_cycle: at its peak); None: not in this run
    seconds: list[float] | None = None  # unit time: the training time of each point

    @property
    def peak_step(self) -> int:
        return self.lrs.index(max(self.lrs))


def schedule_curve(cfg: Config, world_size: int = 1) -> ScheduleCurve:
    """The lrs `lmforge train` will use with `cfg` on `world_size` data-parallel ranks: the trainer's own
    schedule, fed the tokens its batch-size ramp (train.batch_warmup_tokens) gives each step."""
    from lmforge.optim.batch_ramp import BatchRamp
    from lmforge.optim.schedule import make_schedule, warmup_length

    if world_size < 1:
        from lmforge.errors import ConfigError

        raise ConfigError(f"world size {world_size}: a run has at least one data-parallel rank")
    if cfg.schedule.unit == "time":
        return _time_curve(cfg)
    steps = cfg.train.max_steps
    ramp = BatchRamp(cfg, world_size)
    max_tokens = ramp.total_tokens(steps)
    lr_at = make_schedule(cfg.schedule, cfg.optim.lr, steps, max_tokens)
    lrs, tokens, seen = [], [], 0
    for step in range(steps):
        lrs.append(lr_at(step, seen))
        tokens.append(seen)
        seen += ramp.tokens_per_step(seen)
    curve = ScheduleCurve(lrs, tokens, max_tokens, cfg.schedule.unit, None)
    if cfg.schedule.name == "one_cycle":
        curve.warmup_end = curve.peak_step
    else:
        warmup = warmup_length(cfg.schedule)
        position = tokens if cfg.schedule.unit == "tokens" else range(steps)
        curve.warmup_end = next((s for s, x in enumerate(position) if x >= warmup), None)
    return curve


TIME_POINTS = 1000


def _time_curve(cfg: Config) -> ScheduleCurve:
    """The lr over the budget train.max_time, at TIME_POINTS evenly spaced seconds of training."""
    from lmforge.optim.schedule import make_schedule, warmup_length

    budget = cfg.train.max_time
    lr_at = make_schedule(cfg.schedule, cfg.optim.lr, cfg.train.max_steps, 0, budget)
    seconds = [budget * i / TIME_POINTS for i in range(TIME_POINTS)]
    lrs = [lr_at(0, 0, t) for t in seconds]
    curve = ScheduleCurve(lrs, [], 0, "time", None, seconds)
    if cfg.schedule.name == "one_cycle":
        curve.warmup_end = curve.peak_step
    else:
        warmup = warmup_length(cfg.schedule)
        curve.warmup_end = next((i for i, t in enumerate(seconds) if t >= warmup), None)
    return curve


def plot_schedule(curve: ScheduleCurve, out_path: str | os.PathLike, title: str = "") -> Path:
    """Draw the lr against the step, and against tokens seen when the schedule counts tokens."""
    plt = pyplot()
    panels = 2 if curve.unit == "tokens" else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.2 * panels), squeeze=False)
    xs = [("step", list(range(len(curve.lrs))))]
    if curve.seconds is not None:
        xs = [("seconds of training", curve.seconds)]
    if panels == 2:
        xs.append(("tokens seen", curve.tokens))
    for ax, (label, x) in zip(axes[:, 0], xs):
        ax.plot(x, curve.lrs, color="tab:green", lw=1.4)
        if curve.warmup_end is not None:
            ax.axvline(x[curve.warmup_end], color="grey", ls="--", lw=0.8, label="warm-up end")
            ax.legend()
        ax.set_xlabel(label)
        ax.set_ylabel("lr")
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    axes[0, 0].set_title(title)
    return save_figure(fig, out_path)


def plot_lr_find(lrs: Sequence[float], losses: Sequence[float], smoothed: Sequence[float],
                 marks: dict[str, float], out_path: str | os.PathLike, title: str = "") -> Path:
    """Loss against a log-scale lr (raw faint, smoothed bold), each suggested lr marked on the curve."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(lrs, losses, color="tab:blue", alpha=0.3, lw=1, label="loss")
    ax.plot(lrs, smoothed, color="tab:blue", lw=1.8, label="smoothed loss")
    for (label, lr), color in zip(marks.items(), ("tab:red", "tab:orange", "tab:purple")):
        # the smoothed loss at the grid point nearest the mark (lr/10 falls between grid points)
        i = min(range(len(lrs)), key=lambda k: abs(math.log(lrs[k] / lr)))
        ax.plot([lr], [smoothed[i]], "o", color=color, ms=8, label=f"{label}: {lr:.2e}")
    ax.set_xscale("log")
    # Scaled to the descent: the diverging tail (up to 4x the best loss) would squash the valley flat.
    best = list(smoothed).index(min(smoothed))
    low, high = min(losses[: best + 1]), max(smoothed[: best + 1])
    pad = 0.1 * (high - low) or 0.1
    ax.set_ylim(low - pad, high + 3 * pad)
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return save_figure(fig, out_path)
