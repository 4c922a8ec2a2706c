"""Causal language modelling: predict every next token (pretraining), the loss summed over the
targets that are not IGNORE_INDEX. With `chunk_tokens` the output projection and cross-entropy run
a chunk of rows at a time, so the (tokens x vocab) logits never exist whole."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.chunked_loss import chunked_linear_cross_entropy
from lmforge.engine.loss import logits_of, token_loss_sum
from lmforge.engine.objectives.base import ObjectiveOutput, TokenObjective
from lmforge.errors import ConfigError


class CausalLM(TokenObjective):
    name = "causal_lm"

    def __init__(self, chunk_tokens: int = 0) -> None:
        self.chunk_tokens = chunk_tokens

    @classmethod
    def from_config(cls, cfg: Any) -> CausalLM:
        return cls(chunk_tokens=cfg.train.loss_chunk_tokens)

    def __call__(self, model: nn.Module, batch: TokenBatch) -> ObjectiveOutput:
        if self.chunk_tokens:
            targets, chunk = batch.targets, self.chunk_tokens

            def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return chunked_linear_cross_entropy(hidden, weight, targets, chunk, IGNORE_INDEX)

            return ObjectiveOutput(model(batch.input_ids, head=head), {})
        return ObjectiveOutput(token_loss_sum(self.logits(model, batch), batch.targets), {})

    def check_model(self, model: nn.Module) -> None:
        if getattr(getattr(model, "cfg", None), "arch", None) == "encoder":
            raise ConfigError(f"objective {self.name} predicts the next token, which a bidirectional encoder "
                              "(model.arch=encoder) sees: train it with objective mlm")
        if self.chunk_tokens and "head" not in inspect.signature(model.forward).parameters:
            raise ConfigError(
                f"train.loss_chunk_tokens={self.chunk_tokens} needs a model whose forward takes "
                f"`head=` (lmforge's Transformer); {type(model).__name__} does not: set "
                "train.loss_chunk_tokens=0"
            )

    def stage_loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits_of(output), targets)
