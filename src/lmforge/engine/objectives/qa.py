"""Extractive question answering (objective qa): the model's per-token `score` head of 2 outputs with a
bias (start and end logits: transformers' ...ForQuestionAnswering `qa_outputs`; model.score_reads=span)
on every position of a window (question, then a stretch of its context). Trained with

    sum over windows of  (cross_entropy(start_logits, start) + cross_entropy(end_logits, end)) / 2

transformers' QA loss (summed over the batch; the step divides by the windows of the whole step), where a
window without the answer has start = end = 0. Padding positions are no candidates (their logits are
-inf in the loss): a padded batch trains as its rows would alone. Metric: span_accuracy, the windows
whose argmax start and end are both right. Exact match and F1 of the predicted answers (the best valid
span over a record's windows) are `lmforge qa --report` (lmforge.eval.span_metrics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.squad import SpanBatch
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.engine.objectives.token_classify import check_token_head
from lmforge.errors import ConfigError


def span_logits(model: nn.Module, batch: SpanBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) logits (B, T) fp32, padding positions -inf."""
    identity = lambda h, w: h  # noqa: E731 - the hidden states (B, T, d_model) after the final norm
    ids, lengths = batch.input_ids, batch.lengths
    real = torch.arange(ids.size(1), device=ids.device)[None] < lengths[:, None]
    if getattr(model.cfg, "arch", "decoder") == "encoder":
        hidden = model(ids, attention_mask=real.long(), token_type_ids=batch.token_types, head=identity)
    else:
        hidden = model(ids, head=identity)
    logits = model.score(hidden).float().masked_fill(~real[..., None], float("-inf"))  # (B, T, 2)
    return logits[..., 0], logits[..., 1]


class QA(Objective):
    name = "qa"
    batch_type = SpanBatch

    @classmethod
    def from_config(cls, cfg) -> QA:
        if cfg.train.loss_chunk_tokens:
            raise ConfigError("train.loss_chunk_tokens is for the output projection; objective qa uses the "
                              "score head instead: set it to 0")
        return cls()

    def check_model(self, model: nn.Module) -> None:
        check_token_head(model, 2, "span", self.name)

    def num_targets(self, batch: SpanBatch) -> int:
        return batch.examples

    def __call__(self, model: nn.Module, batch: SpanBatch) -> ObjectiveOutput:
        start, end = span_logits(model, batch)
        loss = (F.cross_entropy(start, batch.start, reduction="sum")
                + F.cross_entropy(end, batch.end, reduction="sum")) / 2
        hits = ((start.detach().argmax(-1) == batch.start) & (end.detach().argmax(-1) == batch.end)).float()
        return ObjectiveOutput(loss, {"span_accuracy": hits.sum()})
