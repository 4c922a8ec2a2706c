"""Trainable rows for a few tokens of a frozen embedding (PEFT's `trainable_token_indices`).

A chat template's new control tokens (`<|im_start|>`, `<|im_end|>`) start at the mean row; with the base
frozen under LoRA they would stay there, and a model that cannot move `<|im_end|>`'s output row hardly
learns to end its turn. Here the rows of those ids (input embedding, and the output head when untied)
are small parameters of their own, written over the frozen table when it is read, so the optimizer holds
k x d numbers per table, not the table. `fold_token_rows` writes them into the table for good (merge and
export)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from lmforge.errors import ConfigError


class RowOverride(nn.Module):
    """weight -> weight with rows `ids` replaced by the trainable `rows`."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("ids", ids.clone())
        self.rows = nn.Parameter(rows.detach().clone())
        self.disabled = False  # the frozen table's own rows (finetune.lora.adapters_disabled)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.disabled:
            return weight
        return weight.index_put((self.ids,), self.rows.to(weight.dtype))


def _tables(model: nn.Module) -> list[nn.Module]:
    tables = [model.tok_embeddings]
    if not model.cfg.tie_embeddings:
        tables.append(model.output)
    return tables


def train_token_rows(model: nn.Module, ids: list[int]) -> int:
    """Make the rows of `ids` trainable in the token table (and the untied head); returns the number of
    trainable values added. Call after the base weights are loaded and frozen."""
    if not ids:
        return 0
    vocab = model.cfg.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ConfigError(f"finetune.train_tokens has ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    index = torch.as_tensor(sorted(set(ids)), dtype=torch.long, device=model.tok_embeddings.weight.device)
    added = 0
    for table in _tables(model):
        with torch.no_grad():
            rows = table.weight[index].float()
        parametrize.register_parametrization(table, "weight", RowOverride(index, rows))
        added += rows.numel()
    return added


@torch.no_grad()
def fold_token_rows(model: nn.Module) -> None:
    """Write trained rows into their tables and remove the overrides (state_dict names as before)."""
    for table in _tables(model):
        if parametrize.is_parametrized(table, "weight"):
            parametrize.remove_parametrizations(table, "weight", leave_parametrized=True)
