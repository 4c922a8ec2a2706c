"""The collectives one optimizer step needs. For one process each is the identity; `lmforge.parallel`
supplies the distributed one, so the step and the evaluation never import distributed code."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class Comm:
    """Collectives of a training step; for one process each is the identity."""

    def sum_count(self, n: int) -> int:
        """Target tokens (or pairs, ...) of the step summed over data-parallel ranks."""
        return n

    def sum_counts(self, *ns: int) -> list[int]:
        """Several counts summed over data-parallel ranks at once (one collective)."""
        return list(ns)

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward; `enabled=False` defers the gradient all-reduce."""
        return contextlib.nullcontext()

    def finish_grads(self) -> None:
        """Reduce the gradients no data-parallel wrapper reduces (expert-parallel experts over the ranks
        holding the same experts); called once per step, after the last micro-batch's backward."""

    def norms(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-tensor L2 norms of the full (unsharded) gradients, as 0-dim tensors."""
        return list(torch._foreach_norm(grads, 2.0)) if grads else []

    def reduce_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        """Sum a squared norm over ranks that hold disjoint parameters (pipeline stages)."""
        return sq

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss as the whole job sees it: each rank holds its share (already divided by
        the global target count), so the shares are summed."""
        return loss

    def any_overflow(self, found: torch.Tensor) -> torch.Tensor:
        """A loss scaler's found-inf flag (> 0: a gradient this rank holds is not finite) as the whole
        job sees it: the largest over every rank, so all ranks skip the same steps and keep one scale."""
        return found


LOCAL = Comm()
