"""One optimizer step: forward/backward over micro-batches, loss normalisation, clipping, update."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.train.precision import Precision

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy in fp32; targets equal to IGNORE_INDEX do not count."""
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@dataclass
class StepResult:
    loss: float  # mean loss per target token over the whole step
    tokens: int  # input tokens processed
    target_tokens: int  # tokens that carried a loss
    grad_norm: float  # global gradient norm before clipping
    skipped: bool = False  # the update was not applied (non-finite gradients)


def train_step(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    grad_clip: float,
) -> StepResult:
    """Accumulate gradients over `micro_batches`, then clip and apply one update.

    Each micro-batch's summed loss is divided by the target-token count of the WHOLE step, so
    the gradient equals that of one big batch even when micro-batches hold different numbers
    of real targets (dividing by the number of micro-batches would weight short ones up).
    """
    n_targets = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)
    denom = max(n_targets, 1)
    loss_total = torch.zeros((), dtype=torch.float32, device=micro_batches[0][0].device)
    scaler = precision.scaler
    for x, y in micro_batches:
        with precision.autocast():
            logits = model(x)
        loss = token_loss_sum(logits, y) / denom
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_total += loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    skipped = False
    if scaler is not None:
        scaler.step(optimizer)  # skips the update itself when grads overflowed, then lowers the scale
        scaler.update()
    elif math.isfinite(grad_norm):
        optimizer.step()
    else:
        skipped = True  # never let a NaN/Inf gradient into the weights or the Adam moments
    optimizer.zero_grad(set_to_none=True)
    tokens = sum(x.numel() for x, _ in micro_batches)
    return StepResult(float(loss_total), tokens, n_targets, grad_norm, skipped)
