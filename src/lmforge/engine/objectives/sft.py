"""Supervised fine-tuning: next-token prediction on the tokens the chat data marks (assistant turns,
by default), over `ChatBatch`es whose packed rows carry restarting positions and segment ids.

The loss is the causal LM's (summed over the targets that are not IGNORE_INDEX, normalised by the
step's target count), so a masked token costs nothing and a packed row learns each conversation as
if it were alone (the model attends within a segment only)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, ChatBatch
from lmforge.engine.chunked_loss import chunked_linear_cross_entropy
from lmforge.engine.loss import logits_of, token_loss_sum
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.errors import ConfigError


class SFT(Objective):
    name = "sft"
    batch_type = ChatBatch

    def __init__(self, chunk_tokens: int = 0, packing: bool = True) -> None:
        self.chunk_tokens, self.packing = chunk_tokens, packing

    @classmethod
    def from_config(cls, cfg: Any) -> SFT:
        return cls(chunk_tokens=cfg.train.loss_chunk_tokens, packing=cfg.sft.packing)

    def num_targets(self, batch: ChatBatch) -> int:
        return batch.target_count()  # counted on the host before the batch moved

    def target_ids(self, batch: ChatBatch) -> torch.Tensor:
        return batch.targets[batch.targets != IGNORE_INDEX]

    def _inputs(self, batch: ChatBatch) -> dict[str, Any]:
        if batch.segment_ids is None:
            return {}
        return {"position_ids": batch.position_ids, "segment_ids": batch.segment_ids}

    def __call__(self, model: nn.Module, batch: ChatBatch) -> ObjectiveOutput:
        kwargs = self._inputs(batch)
        if self.chunk_tokens:
            targets, chunk = batch.targets, self.chunk_tokens

            def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return chunked_linear_cross_entropy(hidden, weight, targets, chunk, IGNORE_INDEX)

            return ObjectiveOutput(model(batch.input_ids, head=head, **kwargs), {})
        return ObjectiveOutput(token_loss_sum(logits_of(model(batch.input_ids, **kwargs)), batch.targets), {})

    def check_model(self, model: nn.Module) -> None:
        params = inspect.signature(model.forward).parameters
        if self.packing and ("segment_ids" not in params or "position_ids" not in params):
            raise ConfigError(
                f"objective sft packs conversations and needs a model whose forward takes position_ids= and "
                f"segment_ids= (lmforge's Transformer); {type(model).__name__} does not: set "
                "sft.packing=false"
            )
        if self.chunk_tokens and "head" not in params:
            raise ConfigError(
                f"train.loss_chunk_tokens={self.chunk_tokens} needs lmforge's Transformer; "
                "set train.loss_chunk_tokens=0"
            )
