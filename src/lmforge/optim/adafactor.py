"""Adafactor (Shazeer & Stern 2018) with the semantics of `transformers.optimization.Adafactor`.

Second moments of a >=2-D parameter are factored into a row and a column running mean of g^2
(memory O(rows + cols) instead of O(rows * cols)); 1-D parameters keep a full running mean. The
running-mean rate grows with the step, beta2_t = 1 - t^decay_rate; updates are clipped to RMS
<= clip_threshold; the first moment (beta1) is optional (None: no first-moment state at all).

Step size: with relative_step=False the group's lr (set by the schedule) is used; with
relative_step=True it is min(1e-2, 1/sqrt(t)) (min(1e-6 t, 1/sqrt(t)) with warmup_init) and the
group's lr is ignored. scale_parameter multiplies the step by max(eps[1], RMS(p)). Weight decay is
p <- p - wd * step * p, applied before the update, as transformers does.

The arithmetic follows transformers op for op, so results are bit-identical to it. Unlike
transformers, the step count is kept as a tensor and the parameter RMS is not stored in the state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


class Adafactor(torch.optim.Optimizer):
    """Adafactor; state: `step`, `exp_avg_sq_row`/`exp_avg_sq_col` (factored) or `exp_avg_sq`,
    and `exp_avg` when beta1 is set."""

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
    ):
        if lr is None and not relative_step:
            raise ValueError("Adafactor needs an lr when relative_step=False")
        if warmup_init and not relative_step:
            raise ValueError("warmup_init=True requires relative_step=True")
        if beta1 is not None and not 0.0 <= beta1 < 1.0:
            raise ValueError(f"beta1 must lie in [0, 1), got {beta1}")
        if decay_rate >= 0.0:
            raise ValueError(f"decay_rate must be < 0, got {decay_rate}")
        defaults = {
            "lr": lr,
            "eps": tuple(eps),
            "clip_threshold": clip_threshold,
            "decay_rate": decay_rate,
            "beta1": beta1,
            "weight_decay": weight_decay,
            "scale_parameter": scale_parameter,
            "relative_step": relative_step,
            "warmup_init": warmup_init,
        }
        super().__init__(params, defaults)

    @staticmethod
    def _rms(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.norm(2) / (tensor.numel() ** 0.5)

    @staticmethod
    def _step_size(group: dict, step: int, param_rms: torch.Tensor | None) -> float | torch.Tensor:
        size = group["lr"]
        if group["relative_step"]:
            min_step = 1e-6 * step if group["warmup_init"] else 1e-2
            size = min(min_step, 1.0 / math.sqrt(step))
        if group["scale_parameter"]:
            return max(group["eps"][1], param_rms) * size
        return 1.0 * size

    @staticmethod
    def _approx_sq_grad(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
        c_factor = col.unsqueeze(-2).rsqrt()
        return torch.mul(r_factor, c_factor)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1 = group["beta1"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.dtype in (torch.float16, torch.bfloat16):
                    grad = grad.float()
                if grad.is_sparse:
                    raise RuntimeError("Adafactor does not support sparse gradients")
                shape = grad.shape
                factored = len(shape) >= 2
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    if beta1 is not None:
                        state["exp_avg"] = torch.zeros_like(grad)
                    if factored:
                        state["exp_avg_sq_row"] = torch.zeros(shape[:-1]).to(grad)
                        state["exp_avg_sq_col"] = torch.zeros(shape[:-2] + shape[-1:]).to(grad)
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(grad)

                p32 = p.float() if p.dtype in (torch.float16, torch.bfloat16) else p
                state["step"] += 1
                step = int(state["step"].item())
                param_rms = self._rms(p32) if group["scale_parameter"] else None
                lr = self._step_size(group, step, param_rms)
                beta2t = 1.0 - math.pow(step, group["decay_rate"])

                update = (grad**2) + group["eps"][0]
                if factored:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    update = self._approx_sq_grad(row, col)
                    update.mul_(grad)
                else:
                    exp_avg_sq = state["exp_avg_sq"]
                    exp_avg_sq.mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = exp_avg_sq.rsqrt().mul_(grad)

                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                update.mul_(lr)
                if beta1 is not None:
                    exp_avg = state["exp_avg"]
                    exp_avg.mul_(beta1).add_(update, alpha=1 - beta1)
                    update = exp_avg
                if group["weight_decay"] != 0:
                    p32.add_(p32, alpha=float(-group["weight_decay"] * lr))
                p32.add_(-update)
                if p32 is not p:
                    p.copy_(p32)
        return loss
