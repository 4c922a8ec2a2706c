"""Reward modelling (objective reward): a scalar score per sequence from the model's `score` head at
the sequence's last token, trained on preference pairs with the Bradley-Terry loss

    -log sigmoid(r_chosen - r_rejected - margin) + c (r_chosen + r_rejected)^2

summed over pairs (the step divides by the pairs of the whole step). `margin` is the pair's own (a
'margin' field of its record; 0 without one) and c is preference.center_rewards_coefficient (Eisenstein
et al. 2023's centring; 0: off), both as TRL's RewardTrainer, which the parity test compares with.
Metrics (means per pair): accuracy (the chosen sequence scores higher), margin, the chosen and
rejected scores.

The last token of a row is the one after its last target (a prepared pair's targets cover the
completion, which ends the sequence), which for right-padded rows is the last non-padding token:
what transformers' ...ForSequenceClassification reads for an exported reward model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, PreferenceBatch
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.errors import ConfigError


def last_positions(targets: torch.Tensor) -> torch.Tensor:
    """Index (B,) of each row's last token: one past its last target position."""
    pos = torch.arange(targets.size(1), device=targets.device).expand_as(targets)
    return torch.where(targets != IGNORE_INDEX, pos, -1).amax(-1) + 1


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The score head's value (B,) at each row's last token, fp32."""
    hidden = model(input_ids, head=lambda h, w: h)  # (B, T, d_model) after the final norm
    last = hidden[torch.arange(hidden.size(0), device=hidden.device), last_positions(targets)]  # (B, d)
    return model.score(last).squeeze(-1).float()


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                  center_coefficient: float = 0.0) -> torch.Tensor:
    """Per-pair loss (P,): -log sigmoid(chosen - rejected - margin) + c (chosen + rejected)^2."""
    diff = chosen - rejected if margin is None else chosen - rejected - margin
    loss = -F.logsigmoid(diff)
    if center_coefficient:
        loss = loss + center_coefficient * (chosen + rejected).square()
    return loss


class RewardModel(Objective):
    name = "reward"
    batch_type = PreferenceBatch

    def __init__(self, center_coefficient: float = 0.0) -> None:
        self.center_coefficient = center_coefficient

    @classmethod
    def from_config(cls, cfg) -> RewardModel:
        if cfg.train.loss_chunk_tokens:
            raise ConfigError("train.loss_chunk_tokens is for the output projection; objective reward uses "
                              "the score head instead: set it to 0")
        return cls(center_coefficient=cfg.preference.center_rewards_coefficient)

    def check_model(self, model: nn.Module) -> None:
        if not isinstance(getattr(model, "score", None), nn.Module):
            raise ConfigError("objective reward needs a model with a score head (model.score_head: true; the "
                              "assembly adds one to lmforge's Transformer)")

    def num_targets(self, batch: PreferenceBatch) -> int:
        return batch.pairs

    def __call__(self, model: nn.Module, batch: PreferenceBatch) -> ObjectiveOutput:
        scores = sequence_scores(model, batch.input_ids, batch.targets)
        p = batch.pairs
        chosen, rejected = scores[:p], scores[p:]
        losses = bradley_terry(chosen, rejected, batch.margins, self.center_coefficient)
        c, r = chosen.detach(), rejected.detach()
        return ObjectiveOutput(losses.sum(), {
            "accuracy": (c > r).float().sum(),
            "margin": (c - r).sum(),
            "reward_chosen": c.sum(),
            "reward_rejected": r.sum(),
        })
