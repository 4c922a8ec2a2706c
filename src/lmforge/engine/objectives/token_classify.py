"""Token classification (objective tag): the model's per-token `score` head (d_model ->
num_labels with a bias: transformers' ...ForTokenClassification head; model.score_reads=token) on every
position's final hidden state: a decoder's causal ones, an encoder's bidirectional ones (padding masked
out of attention). Trained with

    sum over labelled tokens t of  w[y_t] * cross_entropy(logits_t, y_t)

where the labelled tokens are each word's first sub-word (the rest carry -100 and no loss,
transformers' convention), summed over the batch (the step divides by the labelled tokens of the whole
step) and `w` are token_classify.class_weights (all 1 without them). Metric: token accuracy over the
labelled tokens. The entity-level report (seqeval's precision / recall / F1 of BIO / IOB2 spans, per
entity type) is `lmforge tag --report` (lmforge.eval.span_metrics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.batch import IGNORE_INDEX
from lmforge.data.labelled_tokens import TaggedBatch
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.errors import ConfigError


def token_scores(model: nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The score head on every position (B, T, outputs), fp32; an encoder's padding masked out."""
    identity = lambda h, w: h  # noqa: E731 - the hidden states (B, T, d_model) after the final norm
    if getattr(model.cfg, "arch", "decoder") == "encoder":
        real = torch.arange(input_ids.size(1), device=input_ids.device)[None] < lengths[:, None]
        hidden = model(input_ids, attention_mask=real.long(), head=identity)
    else:
        hidden = model(input_ids, head=identity)  # causal: padding after a row's tokens never reaches them
    return model.score(hidden).float()


def check_token_head(model: nn.Module, outputs: int, reads: str, what: str) -> None:
    score = getattr(model, "score", None)
    if (not isinstance(score, nn.Module) or getattr(score, "out_features", None) != outputs
            or getattr(model.cfg, "score_reads", None) != reads):
        raise ConfigError(f"objective {what} needs a model with a per-token score head of {outputs} outputs "
                          f"(model.score_reads={reads}; the assembly adds one to lmforge's models)")


class TokenClassify(Objective):
    name = "tag"
    batch_type = TaggedBatch

    def __init__(self, num_labels: int = 2, weights: list[float] | None = None) -> None:
        self.num_labels = num_labels
        self.weights = None if weights is None else torch.tensor(weights, dtype=torch.float32)

    @classmethod
    def from_config(cls, cfg) -> TokenClassify:
        if cfg.train.loss_chunk_tokens:
            raise ConfigError("train.loss_chunk_tokens is for the output projection; objective tag uses the "
                              "score head instead: set it to 0")
        c = cfg.token_classify
        return cls(c.num_labels, c.class_weights if isinstance(c.class_weights, list) else None)

    def check_model(self, model: nn.Module) -> None:
        check_token_head(model, self.num_labels, "token", self.name)

    def num_targets(self, batch: TaggedBatch) -> int:
        return int((batch.labels != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: TaggedBatch) -> ObjectiveOutput:
        logits = token_scores(model, batch.input_ids, batch.lengths)  # (B, T, L)
        weight = None if self.weights is None else self.weights.to(logits.device)
        flat, labels = logits.flatten(0, 1), batch.labels.flatten()
        loss = F.cross_entropy(flat, labels, weight=weight, ignore_index=IGNORE_INDEX, reduction="sum")
        hits = ((flat.detach().argmax(-1) == labels) & (labels != IGNORE_INDEX)).float().sum()
        return ObjectiveOutput(loss, {"accuracy": hits})
