"""One optimizer step: forward/backward of an objective over micro-batches, loss normalisation,
clipping, the update, and the hooks that follow it.

Everything that differs between one process and a distributed job (how many targets the whole
step has, when gradients synchronise, what the global gradient norm is) goes through a `Comm`;
everything that differs between training methods goes through the `Objective`; what a particular
optimizer needs after its update (Sophia's Hessian refresh) attaches as a `StepHook`. The step itself
knows none of them by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from lmforge.engine.comm import LOCAL, Comm
from lmforge.engine.objectives import CausalLM, Objective, ObjectiveOutput
from lmforge.engine.objectives.base import objective_forward
from lmforge.engine.precision import Precision
from lmforge.models.moe import ExpertBias


@dataclass
class Verdict:
    """A judge's ruling on a step's loss, made before its update is applied (the loss-spike guard)."""

    apply: bool  # False keeps the update out of the weights
    finding: Any = None  # what the judge found (e.g. a loss spike), for the caller to act on


class StepResult:
    """What one optimizer step did.

    `loss`, `grad_norm` and `skipped` may still live on the device when the step was run with
    `defer=True` and could decide on the device whether to apply its update (a fused Adam/AdamW skips a
    non-finite step by itself): reading one of them copies them to the host then (one synchronisation),
    and `settle_all` does that for many results at once. Everything else is known on the host.
    """

    def __init__(self, loss: float, tokens: int, target_tokens: int, grad_norm: float, skipped: bool = False,
                 verdict: Verdict | None = None, metrics: dict[str, float] | None = None) -> None:
        self._loss, self._grad_norm, self._skipped = loss, grad_norm, skipped
        self._pending: torch.Tensor | None = None  # [loss, grad_norm, skipped] on the device, unread
        self.tokens = tokens  # input tokens processed (the whole job: all data-parallel ranks; no padding)
        self.target_tokens = target_tokens  # targets that carried a loss (the whole job)
        self.verdict = verdict  # the judge's ruling, when there was a judge and it found something
        self.metrics: dict[str, float] = metrics or {}  # the objective's metrics, means per target
        self.group_grad_norms: dict[str, float] = {}  # with group_stats
        self.update_ratios: dict[str, float] = {}  # |update| / |param| per group
        self.seconds = 0.0  # wall time of the step, batches included (the trainer fills it in)

    def defer(self, loss: torch.Tensor, grad_norm: torch.Tensor, skipped: torch.Tensor) -> None:
        """Keep the step's loss, gradient norm and skip flag on the device until someone reads them."""
        self._pending = torch.stack([loss.detach().float(), grad_norm.detach().float(), skipped.float()])

    @property
    def settled(self) -> bool:
        return self._pending is None

    @staticmethod
    def settle_all(results: Sequence[StepResult]) -> None:
        """Read every unsettled result's values with one device-to-host copy."""
        pending = [r for r in results if r._pending is not None]
        if not pending:
            return
        values = torch.stack([r._pending for r in pending]).tolist()
        for r, (loss, norm, skipped) in zip(pending, values):
            r._loss, r._grad_norm, r._skipped, r._pending = loss, norm, bool(skipped), None

    def _get(self, name: str) -> Any:
        if self._pending is not None:
            StepResult.settle_all([self])
        return getattr(self, name)

    loss = property(lambda self: self._get("_loss"), lambda self, v: setattr(self, "_loss", v),
                    doc="mean loss per target over the whole step")
    grad_norm = property(lambda self: self._get("_grad_norm"), lambda self, v: setattr(self, "_grad_norm", v),
                         doc="global gradient norm before clipping")
    skipped = property(lambda self: self._get("_skipped"), lambda self, v: setattr(self, "_skipped", v),
                       doc="the update was not applied (non-finite loss or gradients, or the judge said so)")


@dataclass
class StepContext:
    """What a hook sees after an applied update: the eager model, the step's batches and collectives."""

    model: nn.Module
    batches: list[Any]
    precision: Precision
    comm: Comm
    objective: Objective


class StepHook(Protocol):
    """Called after every applied update (optimizer specs attach their extra work this way)."""

    def __call__(self, ctx: StepContext) -> None: ...


class MetricSums:
    """An objective's metrics summed over micro-batches (and, in `means`, over data-parallel ranks):
    each reported per target, or per its own count where the objective gives one."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    def add(self, out: ObjectiveOutput) -> None:
        for k, v in out.metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v.detach().float()
        for k, v in (out.counts or {}).items():
            self.counts[k] = self.counts.get(k, 0.0) + torch.as_tensor(v, dtype=torch.float32).detach()

    def means(self, comm: Comm, targets: int) -> dict[str, float]:
        """Every metric's mean: its sum over the job / its count over the job (default: `targets`,
        which is already the job's)."""
        out = {}
        for k, v in self.sums.items():
            if k in self.counts:
                out[k] = float(comm.mean_loss(v)) / max(float(comm.mean_loss(self.counts[k])), 1.0)
            else:
                out[k] = float(comm.mean_loss(v / max(targets, 1)))
        return out


def _group_name(i: int, group: dict) -> str:
    return str(group.get("name", i))


def train_step(
    model: nn.Module,
    micro_batches: Sequence[Any],
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    *,
    objective: Objective | None = None,
    grad_clip: float = 0.0,
    grad_clip_value: float = 0.0,
    group_stats: bool = False,
    comm: Comm = LOCAL,
    judge: Callable[[float], Verdict | None] | None = None,
    hooks: Sequence[StepHook] = (),
    forward: Callable[[Any], ObjectiveOutput] | None = None,
    defer: bool = False,
) -> StepResult:
    """Accumulate gradients of `objective` (default: causal LM) over `micro_batches`, then clip and
    apply one update.

    Each micro-batch's summed loss is divided by the target count of the WHOLE step (all
    micro-batches of all data-parallel ranks), so the gradient equals that of one big batch even
    when micro-batches hold different numbers of real targets. Gradients synchronise only on the
    last micro-batch. `forward(batch)` computes the objective when it is not `objective(model, batch)`
    (a compiled `ObjectiveModule`). `judge(loss)` rules before the update is applied: a verdict with
    apply=False leaves the weights untouched and marks the step skipped.

    `defer=True` asks for a step without a device-to-host synchronisation: where the optimizer can skip
    a non-finite update on the device (fused Adam/AdamW) and nothing else needs the loss on the host
    (no judge, no hooks, no expert-bias update, no loss scaler, no group stats, no objective metrics),
    the result's loss, gradient norm and skip flag stay on the device until read (`StepResult`).
    """
    objective = objective or CausalLM()
    batches = [objective.batch_of(b) for b in micro_batches]
    # Real (non-padding) tokens differ between ranks for fine-tuning rows: both counts are the job's.
    n_targets, n_tokens = comm.sum_counts(sum(objective.num_targets(b) for b in batches),
                                          sum(b.num_tokens for b in batches))
    denom = max(n_targets, 1)
    run = forward if forward is not None else (lambda b: objective_forward(model, objective, b))
    balance = ExpertBias.of(model)  # None unless the model balances its experts by bias
    loss_total = torch.zeros((), dtype=torch.float32, device=batches[0].device)
    metrics = MetricSums()
    scaler = precision.scaler
    for i, batch in enumerate(batches):
        with comm.grad_sync(model, enabled=i == len(batches) - 1):
            with precision.training_forward():
                out = run(batch)
            if balance is not None:
                balance.observe()
            loss = out.loss / denom
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_total += loss.detach()
        metrics.add(out)
    comm.finish_grads()
    on_device = (defer and judge is None and not hooks and balance is None and scaler is None
                 and not group_stats and not metrics.sums and skips_on_device(optimizer))
    if on_device:
        result = StepResult(math.nan, n_tokens, n_targets, math.nan)
        apply_update(optimizer, precision, result, grad_clip, grad_clip_value, group_stats, comm,
                     loss=comm.mean_loss(loss_total))
        return result
    result = StepResult(float(comm.mean_loss(loss_total)), n_tokens, n_targets, 0.0)
    result.metrics = metrics.means(comm, denom)
    if withheld(result, judge, optimizer):
        return result
    apply_update(optimizer, precision, result, grad_clip, grad_clip_value, group_stats, comm)
    if balance is not None and not result.skipped:
        balance.update(comm.mean_loss)  # mean_loss sums over the data-parallel ranks
    if not result.skipped and hooks:
        ctx = StepContext(model, batches, precision, comm, objective)
        for hook in hooks:
            hook(ctx)
    return result


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` tensor itself (torch's fused Adam/AdamW/SGD, the
    contract torch's GradScaler relies on): then a non-finite step is skipped without the host looking."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def withheld(result: StepResult, judge: Callable[[float], Verdict | None] | None,
             optimizer: torch.optim.Optimizer) -> bool:
    """Ask the judge about the step's loss; True (gradients dropped, step marked skipped) when its
    verdict keeps the update out of the weights."""
    if judge is None:
        return False
    result.verdict = judge(result.loss)
    if result.verdict is None or result.verdict.apply:
        return False
    result.skipped = True
    optimizer.zero_grad(set_to_none=True)
    return True


def apply_update(
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    result: StepResult,
    grad_clip: float,
    grad_clip_value: float = 0.0,
    group_stats: bool = False,
    comm: Comm = LOCAL,
    loss: torch.Tensor | None = None,
) -> None:
    """Clip the accumulated gradients (by value, then by the global norm), step, zero the grads.

    A step whose loss or gradient norm is not finite is never applied: one NaN would otherwise
    poison the weights and the optimizer moments for good. Fills `result.grad_norm`,
    `result.skipped` and, with `group_stats`, the per-group norms and update/param ratios.

    With `loss` (the step's loss as a device tensor; only for an optimizer that `skips_on_device`, and
    no loss scaler or group stats) the finiteness check happens on the device: the optimizer gets the
    flag as its `found_inf` and leaves weights, moments and step count alone when it is set, and the
    result keeps loss, norm and flag on the device (`StepResult.defer`). The arithmetic of an applied
    step is the same either way.
    """
    scaler = precision.scaler
    if scaler is not None:
        scaler.unscale_(optimizer, comm)  # the overflow verdict is agreed over all ranks here
    groups = [[p for p in g["params"] if p.grad is not None] for g in optimizer.param_groups]

    def norms() -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        # One norm per tensor, then the global norm from them: the same arithmetic as
        # torch.nn.utils.clip_grad_norm_, with the per-group norms falling out for free.
        per_group = [comm.norms([p.grad for p in ps]) for ps in groups]
        flat = [n for ns in per_group for n in ns]
        total = torch.linalg.vector_norm(torch.stack(flat), 2.0) if flat else torch.zeros(())
        return per_group, comm.reduce_norm_sq(total.square()).sqrt() if comm is not LOCAL else total

    per_group, total = norms()
    if loss is not None:
        bad = ~(torch.isfinite(total) & torch.isfinite(loss))
        clipped = total
        if grad_clip_value > 0:  # a non-finite step is clipped too, harmlessly: its update never applies
            for ps in groups:
                torch.nn.utils.clip_grad_value_(ps, grad_clip_value)
            clipped = norms()[1]
        if grad_clip > 0:
            for ps in groups:
                torch.nn.utils.clip_grads_with_norm_(ps, grad_clip, clipped)
        optimizer.found_inf = bad.float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        optimizer.zero_grad(set_to_none=True)
        result.defer(loss, total, bad)
        return
    grad_norm = float(total)  # before any clipping: an Inf here is never clamped into a finite step
    result.grad_norm = grad_norm
    # Clipping runs per param group: foreach kernels refuse to mix plain tensors with DTensors or
    # DTensors of two meshes, and param groups never do (optim.builder.param_groups).
    if grad_clip_value > 0 and math.isfinite(grad_norm):
        for ps in groups:
            torch.nn.utils.clip_grad_value_(ps, grad_clip_value)
        per_group, total = norms()  # the norm clip acts on the value-clipped gradients
    if grad_clip > 0 and math.isfinite(grad_norm):
        for ps in groups:
            torch.nn.utils.clip_grads_with_norm_(ps, grad_clip, total)
    if group_stats:
        for i, (g, ns) in enumerate(zip(optimizer.param_groups, per_group)):
            if ns:
                sq = comm.reduce_norm_sq(torch.linalg.vector_norm(torch.stack(ns), 2.0).square())
                result.group_grad_norms[_group_name(i, g)] = float(sq.sqrt())
        before = [[p.detach().clone() for p in ps] for ps in groups]
    finite = math.isfinite(grad_norm) and math.isfinite(result.loss)
    if scaler is not None:
        # The scaler's (job-wide) verdict, not this rank's norm: under DDP a rank-local fault after the
        # all-reduce leaves one rank's norm finite and another's not, yet both skip.
        overflow = scaler.overflowed(optimizer)
        scaler.step(optimizer)  # skips the update itself when grads overflowed, then lowers the scale
        scaler.update()
        result.skipped = overflow or not finite
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
