"""Activation checkpointing applied from outside the model, per transformer block.

Wrapping with torch's `checkpoint_wrapper` keeps state_dict keys unchanged (it strips its own
prefix), so checkpoints do not depend on whether recomputation was on.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> int:
    """Recompute activations of blocks in `model.layers` during backward.

    mode: "none", "full" (every block) or "every_k" (blocks 0, k, 2k, ...). Returns how many
    blocks were wrapped. `model.layers` is a ModuleList, or a pipeline stage's ModuleDict keyed by
    global layer index (so every_k picks the same blocks however the model is split).
    """
    if mode == "none":
        return 0
    wrap = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True)
    wrapped = 0
    for name, block in list(model.layers.named_children()):
        if mode == "full" or int(name) % every == 0:
            model.layers.register_module(name, wrap(block))
            wrapped += 1
    return wrapped
