"""Token losses shared by the objectives (and by the Sophia Hessian estimate)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lmforge.data.batch import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy in fp32; targets equal to IGNORE_INDEX do not count."""
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, a Hugging Face output's `.logits`, or the
    first element of a tuple (so any module that returns logits can be trained)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returned {type(output).__name__}; a language model must return its logits "
                    "(B, T, vocab) as a tensor, a tuple starting with them, or an object with .logits")
