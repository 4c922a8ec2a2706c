"""train.sanity_check=overfit_one_batch: before a fresh run's first step, prove the run can learn at all.

A model, loss and optimizer that work drive the loss on one fixed batch far down within a few dozen
steps (Karpathy's "overfit one batch" recipe); one that cannot shows a broken setup in seconds instead
of after hours of a flat curve. The check trains `train.sanity_steps` steps on the run's first batch at
the peak lr (warm-up would start it at ~0 and prove nothing), then puts the weights, the optimizer and
every Stateful part of the run (data position, RNG, loss scaler, ...) back as they were: a run that
passes the check is, step for step, the run it would have been without it. It passes when the last
step's loss is below `train.sanity_loss_ratio` (default 0.5) of the first's: memorising one batch
halves a cross-entropy well inside 50 steps at any working lr, while an lr off by 100x, frozen weights
or an empty loss mask leave it near where it started.

It runs before the run rather than instead of it: the run is what the user asked for, and the check
costs sanity_steps steps once.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmforge.config.methods import method_facts
from lmforge.errors import ConfigError, LmforgeError
from lmforge.optim.schedule import set_lrs

if TYPE_CHECKING:
    from lmforge.config.schema import Config
    from lmforge.train.trainer import Trainer


class SanityCheckFailed(LmforgeError):
    """train.sanity_check=overfit_one_batch: the loss on one repeated batch did not fall as it must."""


@dataclass
class SanityReport:
    losses: list[float]
    ratio: float  # last loss / first loss
    target_tokens: int  # targets that carried a loss in the batch (the whole job)


def check_sanity_supported(cfg: Config) -> None:
    """Refuse, before the run starts, a check that cannot judge the run's loss."""
    if cfg.train.sanity_check != "none" and method_facts(cfg).data == "prompts":
        raise ConfigError(f"train.sanity_check={cfg.train.sanity_check} needs a loss that falls as a batch "
                          f"is learned; {cfg.objective.name}'s policy loss on sampled rollouts does not: set "
                          "train.sanity_check=none")


def sanity_check(trainer: Trainer) -> SanityReport:
    """Run train.sanity_check, record its verdict in metrics.jsonl and say it on the console."""
    report = overfit_one_batch(trainer)
    first, last = report.losses[0], report.losses[-1]
    trainer._event("sanity_check", check="overfit_one_batch", steps=len(report.losses), first_loss=first,
                   last_loss=last, ratio=report.ratio)
    trainer.console(f"sanity check passed: {len(report.losses)} steps on one batch took the loss from "
                    f"{first:.4g} to {last:.4g}")
    return report


def overfit_one_batch(trainer: Trainer) -> SanityReport:
    """Train `train.sanity_steps` steps on one batch, restore everything, and raise SanityCheckFailed
    with a diagnosis unless the loss fell below `train.sanity_loss_ratio` of its start."""
    tc, run = trainer.cfg.train, trainer.run
    model, optimizer = trainer.model, trainer.optimizer
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1: the state lives in the local optimizer
    optim_state = copy.deepcopy(inner.state_dict())
    states = {k: copy.deepcopy(part.state_dict()) for k, part in trainer.states.items()}
    losses: list[float] = []
    targets = 0
    try:
        batches = [trainer._next_batch() for _ in range(run.ramp.micro_batches(0))]
        set_lrs(optimizer, run.schedule.initial, 1.0, trainer.control.lr_scale)
        for _ in range(tc.sanity_steps):
            result = trainer.parallel.step(batches, optimizer, trainer.precision, grad_clip=tc.grad_clip,
                                           grad_clip_value=tc.grad_clip_value, hooks=run.hooks)
            losses.append(float(result.loss))
            targets = result.target_tokens
            if not math.isfinite(losses[-1]):
                break
    finally:
        model.load_state_dict(weights)
        inner.load_state_dict(optim_state)
        model.zero_grad(set_to_none=True)
        for k, part in trainer.states.items():
            part.load_state_dict(states[k])
    first, last = losses[0], losses[-1]
    ratio = last / first if math.isfinite(last) and first > 0 else math.nan
    report = SanityReport(losses, ratio, targets)
    if math.isfinite(ratio) and ratio < tc.sanity_loss_ratio:
        return report
    raise SanityCheckFailed(_diagnosis(trainer, report))


def _diagnosis(trainer: Trainer, report: SanityReport) -> str:
    tc, cfg = trainer.cfg.train, trainer.cfg
    losses = report.losses
    head = (f"train.sanity_check=overfit_one_batch failed: {len(losses)} steps on one batch took the loss "
            f"from {losses[0]:.4g} to {losses[-1]:.4g}")
    params = list(trainer.model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    lr = f"optim.lr={cfg.optim.lr:g}" + (f" x lr_scale {trainer.lr_scale:g}" if trainer.lr_scale != 1 else "")
    causes = []
    if report.target_tokens == 0:
        causes.append("the batch has no loss targets: the loss mask leaves nothing to learn (check the chat "
                      "template's assistant turns, sft loss settings, or sequences shorter than 2 tokens)")
    if trainable == 0:
        causes.append("no parameter is trainable (every requires_grad is False)")
    if not math.isfinite(losses[-1]):
        causes.append(f"the loss became NaN/Inf: the lr is too high ({lr}), or fp16 overflowed (use "
                      "train.precision=bf16/fp32)")
    elif losses[-1] >= losses[0]:
        causes.append(f"the loss rose: the lr is likely too high ({lr}); try 10x lower")
    else:
        causes.append(f"the loss barely fell: the lr may be too low ({lr}; try 10x higher), the schedule's "
                      f"peak too small, or train.grad_clip={tc.grad_clip:g} too tight")
        if trainable < total:
            causes.append(f"only {trainable:,} of {total:,} parameters train (frozen parameters or "
                          "adapters): check finetune.method / requires_grad")
    return (f"{head} (ratio {report.ratio:.3g}; it must fall below train.sanity_loss_ratio="
            f"{tc.sanity_loss_ratio:g}). Likely causes: " + "; ".join(causes) + ". The run took no step; set "
            "train.sanity_check=none to train anyway")
