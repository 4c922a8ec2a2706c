"""Sequence classification and regression (objective classify): the model's `score` head (d_model ->
num_labels: transformers' ...ForSequenceClassification head) read where the model summarises the text.
A decoder's (no bias) reads each row's last real token (rows are right-padded: position length - 1, the
last token that is not padding, which transformers pools); an encoder's is BERT's, tanh(pooler(hidden of
[CLS])) into a classifier with a bias, padding masked out of attention. Trained with

    classification (num_labels >= 2): sum_i w[y_i] * cross_entropy(logits_i, y_i)
    regression     (num_labels = 1):  sum_i (score_i - y_i)^2

summed over the batch's examples (the step divides by the examples of the whole step), transformers'
losses for problem_type single_label_classification / regression. `w` are classify.class_weights (all 1
without them), so each example's loss counts its class's weight. Metrics (means per example): accuracy,
or the absolute error of a regressor. The full report (macro-F1, MCC, per-class precision / recall / F1,
Pearson / Spearman) is `lmforge classify --report`, over the predictions of a whole split
(lmforge.eval.classification_metrics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.labelled import LabelledBatch
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.errors import ConfigError


def classify_logits(model: nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor,
                    token_types: torch.Tensor | None = None) -> torch.Tensor:
    """The score head's outputs (B, num_labels), fp32: a decoder's at each row's last real token, an
    encoder's (one with BERT's `pooler`) from tanh(pooler(hidden of [CLS])), padding masked out."""
    identity = lambda h, w: h  # noqa: E731 - the hidden states (B, T, d_model) after the final norm
    if isinstance(getattr(model, "pooler", None), nn.Module):
        real = torch.arange(input_ids.size(1), device=input_ids.device)[None] < lengths[:, None]
        hidden = model(input_ids, attention_mask=real.long(), token_type_ids=token_types, head=identity)
        return model.score(torch.tanh(model.pooler(hidden[:, 0]))).float()
    hidden = model(input_ids, head=identity)
    last = hidden[torch.arange(hidden.size(0), device=hidden.device), lengths - 1]  # (B, d_model)
    return model.score(last).float()


class Classify(Objective):
    name = "classify"
    batch_type = LabelledBatch

    def __init__(self, num_labels: int = 2, weights: list[float] | None = None) -> None:
        self.num_labels = num_labels
        self.weights = None if weights is None else torch.tensor(weights, dtype=torch.float32)

    @classmethod
    def from_config(cls, cfg) -> Classify:
        if cfg.train.loss_chunk_tokens:
            raise ConfigError("train.loss_chunk_tokens is for the output projection; objective classify uses "
                              "the score head instead: set it to 0")
        c = cfg.classify
        return cls(c.num_labels, c.class_weights if isinstance(c.class_weights, list) else None)

    @property
    def regression(self) -> bool:
        return self.num_labels == 1

    def check_model(self, model: nn.Module) -> None:
        score = getattr(model, "score", None)
        if not isinstance(score, nn.Module) or getattr(score, "out_features", None) != self.num_labels:
            raise ConfigError(f"objective classify needs a model with a score head of classify.num_labels="
                              f"{self.num_labels} outputs (the assembly adds one to lmforge's Transformer)")

    def num_targets(self, batch: LabelledBatch) -> int:
        return batch.examples

    def __call__(self, model: nn.Module, batch: LabelledBatch) -> ObjectiveOutput:
        logits = classify_logits(model, batch.input_ids, batch.lengths, batch.token_types)
        if self.regression:
            pred = logits.squeeze(-1)
            loss = (pred - batch.labels.float()).square().sum()
            return ObjectiveOutput(loss, {"abs_error": (pred.detach() - batch.labels).abs().sum()})
        weight = None if self.weights is None else self.weights.to(logits.device)
        loss = F.cross_entropy(logits, batch.labels, weight=weight, reduction="sum")
        hits = (logits.detach().argmax(-1) == batch.labels).float().sum()
        return ObjectiveOutput(loss, {"accuracy": hits})
