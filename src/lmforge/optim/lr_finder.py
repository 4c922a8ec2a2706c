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

from lmforge.config.schema import Config
from lmforge.errors import ConfigError

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
    if cfg.optim.name == "adafactor" and cfg.optim.relative_step:
        raise ConfigError("optim.name=adafactor with optim.relative_step=true ignores the lr the sweep sets; "
                          "set optim.relative_step=false")
    cfg = cfg.model_copy(deep=True)  # resolving the vocabulary below must not leak into the caller's config
    with _threads(cfg.train.threads), _data(cfg, say) as data:
        model, optimizer, precision, loader = _build(cfg, data)
        lrs, losses, smoothed, diverged = _sweep(cfg, model, optimizer, precision, loader,
                                                 exponential_lrs(min_lr, max_lr, steps))
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


def _sweep(cfg: Config, model, optimizer, precision, loader, lrs: list[float]):
    from lmforge.train.step import train_step

    tc, base = cfg.train, cfg.optim.lr
    device = next(model.parameters()).device
    done, losses, avg, best, diverged = [], [], 0.0, math.inf, False
    for lr in lrs:
        for group in optimizer.param_groups:  # groups with their own peak (Muon's) keep their ratio to it
            group["lr"] = lr * group.get("peak_lr", base) / base
        batches = [tuple(t.to(device) for t in loader.next_batch()) for _ in range(tc.grad_accum_steps)]
        loss = train_step(model, batches, optimizer, precision, tc.grad_clip,
                          grad_clip_value=tc.grad_clip_value).loss
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


def _build(cfg: Config, data):
    """Model, optimizer, precision and train loader exactly as `Trainer.__init__` makes them."""
    from lmforge.checkpoint.hf_io import load_init_weights
    from lmforge.data import TokenLoader
    from lmforge.models import build_model
    from lmforge.optim.builder import build_optimizer
    from lmforge.parallel.checkpointing import apply_activation_checkpointing
    from lmforge.parallel.world import World, resolve_device
    from lmforge.train.precision import Precision, resolve_precision
    from lmforge.train.state import seed_everything
    from lmforge.train.trainer import resolve_vocab_size

    tc = cfg.train
    device = resolve_device(tc.device, World())
    cfg.model.vocab_size = resolve_vocab_size(cfg, data.tokenizer.vocab_size)
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model, device=device)
    if cfg.model.init_from:
        load_init_weights(cfg.model.init_from, model)
    apply_activation_checkpointing(model, tc.activation_checkpointing, tc.ac_every)
    optimizer = build_optimizer(model, cfg.optim)
    precision = Precision(resolve_precision(tc.precision, device, model, tc.micro_batch_size, cfg.seq_len,
                                            cfg.model.vocab_size), device)
    loader = TokenLoader(data.shards("train"), cfg.seq_len, tc.micro_batch_size, seed=cfg.run.seed)
    return model, optimizer, precision, loader


@contextlib.contextmanager
def _data(cfg: Config, say: Callable[[str], object]) -> Iterator:
    """The prepared data `cfg` trains on, without creating the run dir.

    data.dir is a shared cache and is prepared in place. Without it the data lives in <run.dir>/data:
    read there if a run already prepared it, else prepared in a temporary dir removed afterwards.
    """
    from lmforge.checkpoint.hf_io import apply_init_from
    from lmforge.data import prepare
    from lmforge.data.prepare import data_dir
    from lmforge.data.shards import read_meta

    if cfg.model.init_from:
        apply_init_from(cfg, say=say)
    if cfg.data.dir is not None or read_meta(data_dir(cfg)) is not None:
        yield prepare(cfg, console=say)
        return
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-lr-find-"))
    try:
        cfg.data.dir = str(tmp / "data")
        say(f"data.dir is unset and {cfg.run.dir} holds no prepared data: preparing a throwaway copy")
        yield prepare(cfg, console=say)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """train.threads for the sweep only: the caller's thread count comes back afterwards."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
