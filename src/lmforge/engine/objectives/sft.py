"""Supervised fine-tuning: next-token prediction on the tokens the chat data marks (assistant turns,
by default), over `ChatBatch`es whose packed rows carry restarting positions and segment ids.

The loss is the causal LM's (summed over the targets that are not IGNORE_INDEX, normalised by the
step's target count), so a masked token costs nothing and a packed row learns each conversation as
if it were alone (the model attends within a segment only).

A masked token also costs no output projection: the hidden states of the positions that carry a
target are gathered first and only they go through the head and the cross-entropy (in the demo's
task data 13% of the tokens are targets; the head and its loss were a quarter of the step). The sum
is the same over fewer terms. This runs where the targets are on the CPU (on a GPU, gathering by a
mask would wait for the device) and the whole output projection is on the rank (no tensor or
pipeline parallelism); elsewhere every position goes through the head as before."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, ChatBatch
from lmforge.engine.chunked_loss import chunked_linear_cross_entropy
from lmforge.engine.loss import logits_of, token_loss_sum
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.errors import ConfigError


class SFT(Objective):
    name = "sft"
    batch_type = ChatBatch

    def __init__(self, chunk_tokens: int = 0, packing: bool = True, target_rows: bool = False) -> None:
        """target_rows: project only the positions that carry a target (the module docstring); needs a
        model whose forward takes head= and holds the whole output projection."""
        self.chunk_tokens, self.packing, self.target_rows = chunk_tokens, packing, target_rows

    @classmethod
    def from_config(cls, cfg: Any) -> SFT:
        whole_head = cfg.parallel.tp == 1 and cfg.parallel.pp == 1
        return cls(chunk_tokens=cfg.train.loss_chunk_tokens, packing=cfg.sft.packing, target_rows=whole_head)

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
        rows = self._rows(batch)
        if rows is not None:
            targets, chunk = batch.targets.reshape(-1).index_select(0, rows), self.chunk_tokens

            def head_on_rows(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                h = hidden.reshape(-1, hidden.size(-1)).index_select(0, rows)  # (targets, d)
                if chunk:
                    return chunked_linear_cross_entropy(h, weight, targets, chunk, IGNORE_INDEX)
                return token_loss_sum(F.linear(h, weight), targets)

            return ObjectiveOutput(model(batch.input_ids, head=head_on_rows, **kwargs), {})
        if self.chunk_tokens:
            targets, chunk = batch.targets, self.chunk_tokens

            def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return chunked_linear_cross_entropy(hidden, weight, targets, chunk, IGNORE_INDEX)

            return ObjectiveOutput(model(batch.input_ids, head=head, **kwargs), {})
        return ObjectiveOutput(token_loss_sum(logits_of(model(batch.input_ids, **kwargs)), batch.targets), {})

    def _rows(self, batch: ChatBatch) -> torch.Tensor | None:
        """Flat indices of the positions with a target, where projecting only them applies (else None)."""
        targets = batch.targets
        if (not self.target_rows or targets.device.type != "cpu" or torch.compiler.is_compiling()
                or batch.target_count() >= targets.numel()):
            return None  # compiled: a data-dependent shape would break the graph
        return (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)

    def check_model(self, model: nn.Module) -> None:
        params = inspect.signature(model.forward).parameters
        if ("head" not in params or getattr(getattr(model, "output", None), "dropout_p", 0.0) > 0
                or getattr(getattr(model, "cfg", None), "final_logit_softcap", None) is not None):
            # A model of its own computes its logits whole; so does an adapted head with dropout (the
            # head= path hands over its weight, which has no dropout), and soft-capped logits (a
            # transform after the projection that head= would skip).
            self.target_rows = False
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
