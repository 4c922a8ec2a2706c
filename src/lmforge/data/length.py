"""`with_length`: train.epochs or train.max_tokens turned into the train.max_steps they mean.

The run's length is then an ordinary step count, so everything that reads train.max_steps (the LR
schedule's warmup and cooldown fractions, the trainer's loop, the console's progress) works unchanged.
An epoch is the data loader's pass over its data (EpochSampler, MixtureLoader): it ends at the first
optimizer step after the loader's last batch of the pass, as `Trainer.train_epochs()` counts it, so
train.epochs=E gives ceil(E x batches per pass / grad_accum_steps) steps. train.max_tokens=N gives the
fewest steps whose training tokens reach N.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lmforge.config.schema import Config
from lmforge.data.loader import TokenLoader
from lmforge.data.mixture import MixtureLoader
from lmforge.errors import ConfigError


def with_length(cfg: Config, loader: Any, dp_size: int, say: Callable[[str], object] = print) -> Config:
    """`cfg` with train.max_steps derived from train.epochs / train.max_tokens (unchanged when neither is
    set). ConfigError when train.max_steps was also set to another value, or the loader cannot honour it."""
    tc = cfg.train
    key, value = ("train.epochs", tc.epochs) if tc.epochs is not None else ("train.max_tokens", tc.max_tokens)
    if value is None:
        return cfg
    if tc.batch_warmup_tokens:
        raise ConfigError(f"{key}={value} with train.batch_warmup_tokens={tc.batch_warmup_tokens}: the steps "
                          f"of a batch ramp differ in size, so {key} has no fixed step count; set "
                          "train.max_steps instead, or remove the batch ramp")
    per_pass = getattr(loader, "batches_per_epoch", None)
    if tc.epochs is not None:
        if per_pass is None:
            raise ConfigError(f"train.epochs: the {cfg.objective.name} run's data loader "
                              f"({type(loader).__name__}) has no epochs; set train.max_steps")
        steps = math.ceil(tc.epochs * per_pass / tc.grad_accum_steps)
        how = f"train.epochs={tc.epochs} x {per_pass:,} batches per pass"
    else:
        if not isinstance(loader, TokenLoader | MixtureLoader):
            raise ConfigError(f"train.max_tokens counts the tokens of fixed-length windows (pretraining); "
                              f"the {cfg.objective.name} run's examples vary in length: set train.max_steps")
        per_step = tc.micro_batch_size * tc.grad_accum_steps * dp_size * loader.seq_len
        steps = math.ceil(tc.max_tokens / per_step)
        how = f"train.max_tokens={tc.max_tokens:,} at {per_step:,} tokens per step"
    if "max_steps" in tc.model_fields_set and tc.max_steps != steps:
        raise ConfigError(f"train.max_steps={tc.max_steps} and {key}={value} (= {steps:,} steps) both decide "
                          f"when training ends; remove one of them")
    say(f"training {steps:,} steps ({how})")
    return cfg.model_copy(update={"train": tc.model_copy(update={"max_steps": steps})})


def pass_ended(cfg: Config, loader: Any) -> bool:
    """True right after the step in which the loader finished a pass over its data, when train.epochs is
    set (the trainer then validates: epoch-end evaluation)."""
    if cfg.train.epochs is None or not hasattr(loader, "cursor"):
        return False
    return loader.epoch > 0 and loader.cursor < cfg.train.grad_accum_steps
