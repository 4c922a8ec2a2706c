"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

One state tensor per parameter (the momentum m), so half of Adam's optimizer memory:

    p <- p * (1 - lr * wd)                       decoupled weight decay
    p <- p - lr * sign(beta1 * m + (1 - beta1) * g)
    m <- beta2 * m + (1 - beta2) * g

Same update order and arithmetic as `lion_pytorch.Lion`. The sign update has unit magnitude per
coordinate, so Lion wants a learning rate 3-10x smaller than AdamW and a weight decay 3-10x larger;
the paper's betas are (0.9, 0.99).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class Lion(torch.optim.Optimizer):
    """Lion with decoupled weight decay; state: `exp_avg` (the momentum m), same dtype as p."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ):
        if lr <= 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1], got {list(betas)}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                update = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss
