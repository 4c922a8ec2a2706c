"""`Trainer.train_epochs()`: the run one pass over its training data at a time.

    for summary in trainer.train_epochs():
        print(summary["epoch"], summary["loss"])
        if summary["loss"] < 2.0:
            break                      # a checkpoint of the run is saved here; resume=True continues it

Each summary: "epoch" (counted from 1), "steps" and "tokens" of that pass, "loss" (the mean of its step
losses), "step" (the run's), "complete" (False for a last pass that train.max_steps, train.max_time or a
stop request cut short). An epoch is the data loader's (data/sampler.py EpochSampler): it ends at the
first step boundary after the loader has passed over all of its data (with gradient accumulation that
step may have taken a micro-batch of the next pass). When the generator runs out the run ends as fit's
does (final checkpoint and validation); nothing of the loop itself differs from fit's, so the steps are
fit's steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lmforge.errors import ConfigError
from lmforge.train.signals import restore_handlers
from lmforge.utils.host_memory import keep_freed_memory

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


def train_epochs(trainer: Trainer) -> Iterator[dict[str, Any]]:
    """See the module docstring. The loader is checked at the call, before the first `next`."""
    loader = trainer.run.train_loader
    if not hasattr(loader, "epoch"):
        raise ConfigError(f"train_epochs: the {trainer.cfg.objective.name} run's data loader "
                          f"({type(loader).__name__}) has no epochs (its data is sampled); use fit()")
    return _epochs(trainer, loader)


def _epochs(t: Trainer, loader: Any) -> Iterator[dict[str, Any]]:
    if t.complete:
        t._completed()
        return
    old_handlers, final = t._install_signal_handlers(), None
    t._emit("on_train_start")
    try:
        t._sanity_check()
        ended = True
        while ended and t.step < t.cfg.train.max_steps:
            epoch, step0, tokens0, t._epoch_results = loader.epoch, t.step, t.tokens_seen, []
            with keep_freed_memory(t.cfg.train.keep_host_memory):
                ended = t._loop(until=lambda e=epoch: loader.epoch != e)
            losses = [r.loss for r in t._epoch_results if math.isfinite(r.loss)]
            if t.step > step0:
                yield {"epoch": epoch + 1, "steps": t.step - step0, "tokens": t.tokens_seen - tokens0,
                       "loss": sum(losses) / len(losses) if losses else math.nan, "step": t.step,
                       "complete": ended}
        final = t._finish()
    except GeneratorExit:  # the caller stopped between epochs: keep the run where it is
        if t._last_saved_step != t.step:
            t.save()
        raise
    finally:
        t._epoch_results = None
        restore_handlers(old_handlers)
        try:
            t._emit("on_train_end", final)
        finally:
            t._release()
