"""Sophia (Liu et al. 2023, "Sophia: A Scalable Stochastic Second-order Optimizer"), SophiaG form.

Per coordinate, with m the gradient EMA and h an EMA of a Hessian-diagonal estimate hhat:

    m <- beta1 * m + (1 - beta1) * g                          every step
    h <- beta2 * h + (1 - beta2) * hhat                       every k-th step (`update_hessian`)
    p <- p * (1 - lr * wd)                                    decoupled weight decay
    p <- p - lr * sign(m) * min(|m| / max(rho * h, eps), 1)

This is the released code's form: rho multiplies h, and the batch size the paper divides by is
folded into hhat by the estimator (GNB: hhat = B * g * g). Where h is tiny (or not estimated yet)
the step saturates at lr * sign(m), so Sophia never moves a coordinate by more than lr per step.
eps is `optim.eps`: the paper's floor of rho * h; it only matters where |m| < eps (released code:
1e-15 added instead), and with Adam's 1e-8 such a coordinate moves by at most lr * |m| / 1e-8.

The Hessian estimate needs the model, so it lives outside `step`: the optimizer's spec attaches a
`HessianRefresh` hook to the training step, which after an applied update asks `hessian_due()` and,
if so, runs `estimate_hessian` on that step's micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmforge.data.batch import IGNORE_INDEX
from lmforge.engine.comm import Comm
from lmforge.engine.loss import token_loss_sum
from lmforge.engine.objectives import CausalLM, TokenObjective
from lmforge.engine.precision import Precision
from lmforge.engine.step import StepContext

ESTIMATORS = ("gnb", "hutchinson")


class Sophia(torch.optim.Optimizer):
    """SophiaG with decoupled weight decay; state: `step`, `exp_avg` (m), `hessian` (h)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.965, 0.99),
        rho: float = 0.04,
        weight_decay: float = 0.1,
        eps: float = 1e-8,
        hessian_every: int = 10,
        estimator: str = "gnb",
    ):
        if lr <= 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {list(betas)}")
        if rho <= 0.0 or eps <= 0.0:
            raise ValueError(f"rho and eps must be > 0, got rho={rho}, eps={eps}")
        if hessian_every < 1:
            raise ValueError(f"hessian_every must be >= 1, got {hessian_every}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        # Not in the groups: how often and how to estimate is the run's config, not saved state.
        self.hessian_every = hessian_every
        self.estimator = estimator
        defaults = {"lr": lr, "betas": tuple(betas), "rho": rho, "weight_decay": weight_decay, "eps": eps}
        super().__init__(params, defaults)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)  # on the CPU: hessian_due reads it every step without a sync
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["hessian"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def steps_taken(self) -> int:
        return next((int(s["step"]) for s in self.state.values() if "step" in s), 0)

    def hessian_due(self) -> bool:
        """True after steps 1, 1 + k, 1 + 2k, ... (k = hessian_every): the estimate made then is the
        h of the next k steps. The paper refreshes before steps 1, 1 + k, ...; estimating after the
        step instead (on its micro-batches, at the new weights) shifts that by one step, so only step
        1, under warm-up's smallest lr, runs on h = 0, i.e. as lr * sign(m)."""
        n = self.steps_taken()
        return n > 0 and (n - 1) % self.hessian_every == 0

    @torch.no_grad()
    def update_hessian(self) -> None:
        """h <- beta2 * h + (1 - beta2) * hhat, with hhat read from p.grad (the estimator put it there)."""
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._state(p)["hessian"].mul_(beta2).add_(p.grad, alpha=1 - beta2)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, rho, eps = group["lr"], group["weight_decay"], group["rho"], group["eps"]
            beta1 = group["betas"][0]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Sophia does not support sparse gradients")
                state = self._state(p)
                state["step"] += 1
                exp_avg = state["exp_avg"]
                p.mul_(1 - lr * wd)
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                ratio = (exp_avg.abs() / (rho * state["hessian"]).clamp_(min=eps)).clamp_(max=1.0)
                p.addcmul_(exp_avg.sign(), ratio, value=-lr)
        return loss


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


def _backward(loss: torch.Tensor, precision: Precision) -> None:
    # fp16 gradients of a mean over many tokens underflow without the run's loss scale.
    scaler = precision.scaler
    (loss * scaler.get_scale() if scaler is not None else loss).backward()


def _unscale(grads: list[torch.Tensor], precision: Precision) -> None:
    if precision.scaler is not None:
        scale = precision.scaler.get_scale()
        for g in grads:
            g.div_(scale)


def _gnb(model: nn.Module, params: list[torch.Tensor], batches, precision: Precision, comm: Comm | None,
         objective: TokenObjective) -> None:
    """Gauss-Newton-Bartlett: labels drawn from the model's own softmax, hhat = B * g * g with g the
    gradient of the mean loss over the B tokens that carry a loss. E[hhat] is the diagonal of the
    Gauss-Newton matrix of the mean loss (the cross terms of independent samples vanish)."""
    n_tokens = sum(objective.num_targets(b) for b in batches)
    # Data-parallel: the mean is over every rank's tokens (gradients are summed across ranks).
    n_tokens = max(comm.sum_count(n_tokens) if comm is not None else n_tokens, 1)
    for batch in batches:
        y = batch.targets
        with precision.autocast():
            logits = objective.logits(model, batch)
        with torch.no_grad():
            probs = torch.softmax(logits.float().view(-1, logits.size(-1)), dim=-1)
            sampled = torch.multinomial(probs, 1).view(y.shape)
            sampled = torch.where(y == IGNORE_INDEX, IGNORE_INDEX, sampled)
        _backward(token_loss_sum(logits, sampled) / n_tokens, precision)
    grads = [p.grad for p in params if p.grad is not None]
    _unscale(grads, precision)
    for g in grads:
        g.mul_(g).mul_(n_tokens)


def _hutchinson(model: nn.Module, params: list[torch.Tensor], batches, precision: Precision,
                objective: TokenObjective) -> None:
    """hhat = u * (H u), u Rademacher, H the Hessian of the step's real (mean) loss; E[hhat] = diag(H).
    One u for the whole step; H u is summed over micro-batches like a gradient.

    No fp16 loss scale here: H u would carry it through both backward passes, and the scaled
    estimate of the debug model overflowed fp16 (unscaled, it matches fp32 to 7e-4)."""
    n_tokens = max(sum(objective.num_targets(b) for b in batches), 1)
    us = [torch.randint(0, 2, p.shape, device=p.device).to(p.dtype).mul_(2).sub_(1) for p in params]
    hvp = [torch.zeros_like(p) for p in params]
    for batch in batches:
        # The fused SDPA kernels have no double backward; the math one is plain differentiable ops.
        with precision.autocast(), sdpa_kernel(SDPBackend.MATH):
            logits = objective.logits(model, batch)
        loss = token_loss_sum(logits, batch.targets) / n_tokens
        grads = torch.autograd.grad(loss, params, create_graph=True, materialize_grads=True)
        dot = sum((g * u).sum() for g, u in zip(grads, us) if g.requires_grad)
        if not isinstance(dot, torch.Tensor):  # the loss is linear in every parameter: H = 0
            continue
        for acc, hu in zip(hvp, torch.autograd.grad(dot, params, materialize_grads=True)):
            acc.add_(hu)
    for p, u, hu in zip(params, us, hvp):
        p.grad = u.mul_(hu)


def estimate_hessian(model: nn.Module, optimizer: Sophia, micro_batches: Sequence[Any], precision: Precision,
                     comm: Comm | None = None, objective: TokenObjective | None = None) -> None:
    """Refresh Sophia's Hessian EMA from the optimizer's estimator on `micro_batches` (batches of the
    token-level `objective`, default causal LM; GNB uses the targets only for which positions carry
    a loss).

    Zeroes the gradients before and after. An estimate with a non-finite entry is dropped (h keeps
    its value), as the trainer drops such gradients. Hutchinson differentiates twice, which needs
    an eager (not torch.compile'd) model. `comm` (lmforge.engine.comm.Comm) makes the GNB mean
    global in a data-parallel job; Hutchinson is single-replica only (its second backward
    bypasses the data-parallel gradient reduction).
    """
    objective = objective or CausalLM()
    batches = [objective.batch_of(b) for b in micro_batches]
    params = _params(optimizer)
    optimizer.zero_grad(set_to_none=True)
    try:
        if optimizer.estimator == "gnb":
            _gnb(model, params, batches, precision, comm, objective)
        else:
            _hutchinson(model, params, batches, precision, objective)
        grads = [p.grad for p in params if p.grad is not None]
        if grads and bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            optimizer.update_hessian()
    finally:
        optimizer.zero_grad(set_to_none=True)


class HessianRefresh:
    """The step hook Sophia's spec attaches: after steps 1, 1 + k, ... re-estimate the Hessian
    diagonal on the step's own micro-batches, with the eager model and the step's collectives."""

    def __init__(self, optimizer: Sophia) -> None:
        self.optimizer = optimizer

    def __call__(self, ctx: StepContext) -> None:
        if self.optimizer.hessian_due():
            estimate_hessian(ctx.model, self.optimizer, ctx.batches, ctx.precision, ctx.comm, ctx.objective)
