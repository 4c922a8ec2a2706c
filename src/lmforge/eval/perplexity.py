"""Validation loss, perplexity and bits per byte over a stream of (inputs, targets) batches."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from lmforge.train.precision import Precision
from lmforge.train.step import IGNORE_INDEX, token_loss_sum


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    precision: Precision,
    token_bytes: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Mean loss per target token, perplexity, and (with `token_bytes`) bits per UTF-8 byte.

    Bits per byte divides the summed loss (in bits) by the bytes the target tokens decode to,
    which makes models with different tokenizers comparable.
    """
    was_training = model.training
    model.eval()
    loss_sum, n_tokens, n_bytes = 0.0, 0, 0
    for x, y in batches:
        if device is not None:
            x, y = x.to(device), y.to(device)
        with precision.autocast():
            logits = model(x)
        loss_sum += float(token_loss_sum(logits, y))
        mask = y != IGNORE_INDEX
        n_tokens += int(mask.sum())
        if token_bytes is not None:
            n_bytes += int(token_bytes.to(y.device)[y[mask]].sum())
    model.train(was_training)
    if n_tokens == 0:
        raise ValueError("evaluation saw no target tokens")
    loss = loss_sum / n_tokens
    out = {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": n_tokens}
    if token_bytes is not None and n_bytes > 0:
        out["bpb"] = loss_sum / math.log(2) / n_bytes
    return out
