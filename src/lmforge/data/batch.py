"""Batch types: what loaders hand out and objectives consume.

A batch is a small frozen dataclass of tensors. Each objective declares the batch type it takes
(`Objective.batch_type`); new training methods add a type here (pairs for preference data, token
weights for RL) instead of changing the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # a target that carries no loss (padding, prompt tokens, positions past a document)


@dataclass(frozen=True)
class TokenBatch:
    """Next-token prediction: `input_ids` (B, T) and `targets` (B, T), targets[i] = the token after
    input_ids[i], IGNORE_INDEX where no loss is taken."""

    input_ids: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, batch: TokenBatch | tuple[torch.Tensor, torch.Tensor]) -> TokenBatch:
        """A TokenBatch from itself or an (inputs, targets) pair."""
        if isinstance(batch, TokenBatch):
            return batch
        x, y = batch
        return cls(x, y)

    @classmethod
    def cat(cls, batches: list[TokenBatch]) -> TokenBatch:
        """One batch of all rows of `batches` (a pipeline runs a step's micro-batches as one)."""
        return cls(torch.cat([b.input_ids for b in batches]), torch.cat([b.targets for b in batches]))

    def __iter__(self):
        """Unpacks as `x, y = batch` (inputs, targets), like the pair it replaces."""
        return iter((self.input_ids, self.targets))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TokenBatch:
        return TokenBatch(self.input_ids.to(device, non_blocking=non_blocking),
                          self.targets.to(device, non_blocking=non_blocking))

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_tokens(self) -> int:
        """Input tokens (what throughput counts)."""
        return self.input_ids.numel()

    @property
    def rows(self) -> int:
        return self.input_ids.size(0)
