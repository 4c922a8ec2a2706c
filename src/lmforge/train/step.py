"""One optimizer step: forward/backward over micro-batches, loss normalisation, clipping, update.

Everything that differs between one process and a distributed job (how many targets the whole
step has, when gradients synchronise, what the global gradient norm is) goes through a `Comm`;
the single-process one below is the identity, `lmforge.parallel` supplies the distributed one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

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


class Comm:
    """The collectives one optimizer step needs; for one process each is the identity."""

    def sum_count(self, n: int) -> int:
        """Target tokens of the step summed over data-parallel ranks."""
        return n

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward; `enabled=False` defers the gradient all-reduce."""
        return contextlib.nullcontext()

    def norms(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-tensor L2 norms of the full (unsharded) gradients, as 0-dim tensors."""
        return list(torch._foreach_norm(grads, 2.0)) if grads else []

    def reduce_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        """Sum a squared norm over ranks that hold disjoint parameters (pipeline stages)."""
        return sq

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss as the whole job sees it (each rank holds its share)."""
        return loss


LOCAL = Comm()


@dataclass
class StepResult:
    loss: float  # mean loss per target token over the whole step
    tokens: int  # input tokens processed
    target_tokens: int  # tokens that carried a loss
    grad_norm: float  # global gradient norm before clipping
    skipped: bool = False  # the update was not applied (non-finite loss or gradients)
    group_grad_norms: dict[str, float] = field(default_factory=dict)  # with group_stats
    update_ratios: dict[str, float] = field(default_factory=dict)  # |update| / |param| per group


def _group_name(i: int, group: dict) -> str:
    return str(group.get("name", i))


def train_step(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    grad_clip: float,
    grad_clip_value: float = 0.0,
    group_stats: bool = False,
    comm: Comm = LOCAL,
    accept: Callable[[float], bool] | None = None,
) -> StepResult:
    """Accumulate gradients over `micro_batches`, then clip and apply one update.

    Each micro-batch's summed loss is divided by the target-token count of the WHOLE step (all
    micro-batches of all data-parallel ranks), so the gradient equals that of one big batch even
    when micro-batches hold different numbers of real targets. Gradients synchronise only on the
    last micro-batch. `accept(loss)` is asked before the update is applied (loss-spike guard):
    False leaves the weights untouched and marks the step skipped.
    """
    n_local = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)
    n_targets = comm.sum_count(n_local)
    denom = max(n_targets, 1)
    loss_total = torch.zeros((), dtype=torch.float32, device=micro_batches[0][0].device)
    scaler = precision.scaler
    for i, (x, y) in enumerate(micro_batches):
        with comm.grad_sync(model, enabled=i == len(micro_batches) - 1):
            with precision.autocast():
                logits = model(x)
            loss = token_loss_sum(logits, y) / denom
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_total += loss.detach()
    loss_value = float(comm.mean_loss(loss_total))
    result = StepResult(loss_value, sum(x.numel() for x, _ in micro_batches), n_targets, 0.0)
    if accept is not None and not accept(result.loss):
        result.skipped = True
        optimizer.zero_grad(set_to_none=True)
        return result
    apply_update(optimizer, precision, result, grad_clip, grad_clip_value, group_stats, comm)
    if not result.skipped and getattr(optimizer, "hessian_due", None) and optimizer.hessian_due():
        from lmforge.optim.sophia import estimate_hessian

        # The eager module: Hutchinson's double backward does not run through torch.compile.
        estimate_hessian(getattr(model, "_orig_mod", model), optimizer, micro_batches, precision, comm)
    return result


def apply_update(
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    result: StepResult,
    grad_clip: float,
    grad_clip_value: float = 0.0,
    group_stats: bool = False,
    comm: Comm = LOCAL,
) -> None:
    """Clip the accumulated gradients (by value, then by the global norm), step, zero the grads.

    A step whose loss or gradient norm is not finite is never applied: one NaN would otherwise
    poison the weights and the optimizer moments for good. Fills `result.grad_norm`,
    `result.skipped` and, with `group_stats`, the per-group norms and update/param ratios.
    """
    scaler = precision.scaler
    if scaler is not None:
        scaler.unscale_(optimizer)
    groups = [[p for p in g["params"] if p.grad is not None] for g in optimizer.param_groups]

    def norms() -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        # One norm per tensor, then the global norm from them: the same arithmetic as
        # torch.nn.utils.clip_grad_norm_, with the per-group norms falling out for free.
        per_group = [comm.norms([p.grad for p in ps]) for ps in groups]
        flat = [n for ns in per_group for n in ns]
        total = torch.linalg.vector_norm(torch.stack(flat), 2.0) if flat else torch.zeros(())
        return per_group, comm.reduce_norm_sq(total.square()).sqrt() if comm is not LOCAL else total

    per_group, total = norms()
    grad_norm = float(total)  # before any clipping: an Inf here is never clamped into a finite step
    result.grad_norm = grad_norm
    if grad_clip_value > 0 and math.isfinite(grad_norm):
        torch.nn.utils.clip_grad_value_([p for ps in groups for p in ps], grad_clip_value)
        per_group, total = norms()  # the norm clip acts on the value-clipped gradients
    if grad_clip > 0 and math.isfinite(grad_norm):
        torch.nn.utils.clip_grads_with_norm_([p for ps in groups for p in ps], grad_clip, total)
    if group_stats:
        for i, (g, ns) in enumerate(zip(optimizer.param_groups, per_group)):
            if ns:
                sq = comm.reduce_norm_sq(torch.linalg.vector_norm(torch.stack(ns), 2.0).square())
                result.group_grad_norms[_group_name(i, g)] = float(sq.sqrt())
        before = [[p.detach().clone() for p in ps] for ps in groups]
    finite = math.isfinite(grad_norm) and math.isfinite(result.loss)
    if scaler is not None:
        scaler.step(optimizer)  # skips the update itself when grads overflowed, then lowers the scale
        scaler.update()
        result.skipped = not finite
    elif finite:
        optimizer.step()
    else:
        result.skipped = True
    if group_stats and not result.skipped:
        for i, (g, ps, old) in enumerate(zip(optimizer.param_groups, groups, before)):
            if ps:
                delta = comm.norms([p.detach() - o for p, o in zip(ps, old)])
                size = comm.norms([o for o in old])
                d = comm.reduce_norm_sq(torch.linalg.vector_norm(torch.stack(delta), 2.0).square()).sqrt()
                s = comm.reduce_norm_sq(torch.linalg.vector_norm(torch.stack(size), 2.0).square()).sqrt()
                result.update_ratios[_group_name(i, g)] = float(d / s.clamp_min(1e-30))
    optimizer.zero_grad(set_to_none=True)
