"""Learning-rate range test (Smith 2015, "Cyclical Learning Rates"; fastai's `lr_find`).

A fresh copy of the model the config describes takes optimizer steps at learning rates growing
exponentially from `min_lr` to `max_lr`; the loss falls while the lr is useful and blows up once it is
too large. The smoothed loss curve suggests two peak lrs: where it falls fastest (steepest descent in
log lr) and a tenth of the lr at its minimum (fastai's `minimum` rule, a step back from the edge).

The run dir is never created or written: the sweep is a throwaway, not a run.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.assembly import Run, build_run
from lmforge.config.schema import Config
from lmforge.data import data_dir, read_meta
from lmforge.errors import ConfigError
from lmforge.optim.builder import SPECS
from lmforge.optim.schedule import set_lrs

BETA = 0.98  # fastai's smoothing of the loss
DIVERGENCE = 4.0  # stop once the smoothed loss exceeds this many times its best (fastai)


@dataclass
class LRFindResult:
    lrs: list[float]  # the lr of each step taken (fewer than asked for when the loss diverged)
    losses: list[float]  # the training loss of each step
    smoothed: list[float]  # bias-corrected exponential moving average of `losses`
    steepest_lr: float  # lr where the smoothed loss falls fastest against log lr
    min_lr_div10: float  # (lr at the smoothed loss minimum) / 10
    min_loss_lr: float  # lr at the smoothed loss minimum
    diverged: bool  # stopped early: the smoothed loss exceeded DIVERGENCE x its best, or was not finite
    png: Path | None  # the plot, or None when none was asked for


def exponential_lrs(min_lr: float, max_lr: float, steps: int) -> list[float]:
    """`steps` lrs from `min_lr` to `max_lr` (both included), evenly spaced in log lr."""
    return [min_lr * (max_lr / min_lr) ** (i / (steps - 1)) for i in range(steps)]


def smooth(losses: list[float], beta: float = BETA) -> list[float]:
    """Exponential moving average with Adam-style bias correction, so early values are not pulled to 0."""
    avg, out = 0.0, []
    for i, loss in enumerate(losses, 1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta**i))
    return out


def suggest(lrs: list[float], smoothed: list[float]) -> tuple[int, int]:
    """(index of steepest descent, index of the minimum) of a smoothed loss curve.

    The steepest descent is searched from a tenth into the sweep (the EMA still settles there) up to
    the minimum: past it the curve is diverging, and its wiggles can out-steepen the real descent.
    """
    lowest = int(np.argmin(smoothed))
    if lowest == 0 or len(lrs) < 3:
        return lowest, lowest
    slope = np.gradient(np.asarray(smoothed), np.log(np.asarray(lrs)))
    start = min(len(lrs) // 10, lowest - 1)
    return start + int(np.argmin(slope[start: lowest + 1])), lowest


def lr_find(cfg: Config, min_lr: float = 1e-7, max_lr: float = 1.0, steps: int = 100,
            out_png: str | Path | None = "lr_find.png",
            say: Callable[[str], object] = print) -> LRFindResult:
    """Sweep the lr exponentially over `steps` optimizer steps of a fresh model built as `lmforge train`
    builds it (same data order, seed, optimizer, precision, micro-batches and clipping; no schedule,
    no batch-size ramp: every step is a full batch, the one the peak lr will be used with; no compile);
    return the curve and the suggested lrs, and draw it to `out_png`."""
    if not 0 < min_lr < max_lr:
        raise ConfigError(f"--min-lr {min_lr:g} and --max-lr {max_lr:g}: need 0 < min-lr < max-lr")
    if steps < 5:
        raise ConfigError(f"--steps {steps}: the sweep needs at least 5 steps to smooth and compare")
    fixed = SPECS[cfg.optim.name].capabilities(cfg.optim).fixed_lr
    if fixed:
        raise ConfigError(f"{fixed}, so an lr sweep has nothing to vary")
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": False})})
    with _threads(cfg.train.threads), _data(cfg, say) as cfg:
        run = build_run(cfg, "experiment", say=say)
        lrs, losses, smoothed, diverged = _sweep(run, exponential_lrs(min_lr, max_lr, steps))
    if len(losses) < 3:
        raise ConfigError(f"the loss was not finite after {len(losses)} step(s) even at lr {min_lr:g}; "
                          "lower --min-lr")
    steep, lowest = suggest(lrs, smoothed)
    if lowest == 0:
        say("the loss never fell below its first value: lower --min-lr")
    result = LRFindResult(lrs, losses, smoothed, lrs[steep], lrs[lowest] / 10, lrs[lowest], diverged, None)
    if out_png is not None:
        from lmforge.tools.plots import plot_lr_find

        marks = {"steepest": result.steepest_lr, "min/10": result.min_lr_div10}
        result.png = plot_lr_find(lrs, losses, smoothed, marks, out_png,
                                  title=f"lr range test: {cfg.run.name}")
    return result


def _sweep(run: Run, lrs: list[float]):
    tc = run.cfg.train
    done, losses, avg, best, diverged = [], [], 0.0, math.inf, False
    for lr in lrs:
        # Every group keeps its ratio to optim.lr (Muon's matrices start from optim.muon.lr).
        set_lrs(run.optimizer, run.schedule.initial, lr / run.cfg.optim.lr)
        batches = [run.train_loader.next_batch().to(run.device) for _ in range(tc.grad_accum_steps)]
        loss = run.parallel.step(batches, run.optimizer, run.precision, grad_clip=tc.grad_clip,
                                 grad_clip_value=tc.grad_clip_value, hooks=run.hooks).loss
        if not math.isfinite(loss):
            diverged = True
            break
        done.append(lr)
        losses.append(loss)
        avg = BETA * avg + (1 - BETA) * loss
        smoothed = avg / (1 - BETA ** len(losses))
        best = min(best, smoothed)
        if smoothed > DIVERGENCE * best:
            diverged = True
            break
    return done, losses, smooth(losses), diverged


@contextlib.contextmanager
def _data(cfg: Config, say: Callable[[str], object]) -> Iterator[Config]:
    """`cfg`, or a copy whose data lives in a throwaway dir, so that the run dir is never created.

    data.dir is a shared cache and is prepared in place. Without it the data lives in <run.dir>/data:
    read there if a run already prepared it, else prepared in a temporary dir removed afterwards.
    """
    if cfg.data.dir is not None or read_meta(data_dir(cfg)) is not None:
        yield cfg
        return
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-lr-find-"))
    try:
        say(f"data.dir is unset and {cfg.run.dir} holds no prepared data: preparing a throwaway copy")
        yield cfg.model_copy(update={"data": cfg.data.model_copy(update={"dir": str(tmp / "data")})})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _threads(n: int | str | None) -> Iterator[None]:
    """train.threads for the sweep only: the caller's thread count comes back afterwards (build_run
    sets a count that `auto` measures)."""
    before = torch.get_num_threads()
    if isinstance(n, int):
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
