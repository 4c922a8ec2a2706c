"""Knowledge distillation: a student learns the teacher's next-token distributions (a divergence of
engine/kd_loss.py, at a temperature) mixed with the hard-label cross-entropy of the data:

    loss = kd_ratio * T^2 * divergence(teacher, student) + (1 - kd_ratio) * cross-entropy

both summed over the target tokens. The teacher is a callable set by the assembly
(lmforge.finetune.teacher): batch -> the teacher's logits (B, T, V) computed on the fly by a frozen
model in eval mode without gradients, or `TopK` logits read from a precomputed cache. Metrics `kd` and
`ce` are the two parts, reported per target; validation reports them too, so a distilled student's
`ce` compares directly with a student trained on the data alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.kd_loss import KD_LOSSES, kd_loss_sum, topk_forward_kl_sum
from lmforge.engine.loss import token_loss_sum
from lmforge.engine.objectives.base import ObjectiveOutput, TokenObjective
from lmforge.errors import ConfigError


class TopK(NamedTuple):
    """A teacher known by its k most likely tokens per position: ids (B, T, k), logits (B, T, k), and
    lse (B, T), its logsumexp(logits / distill.temperature) over the whole vocabulary."""

    ids: torch.Tensor
    logits: torch.Tensor
    lse: torch.Tensor


Teacher = Callable[[TokenBatch], "torch.Tensor | TopK"]


class Distill(TokenObjective):
    name = "distill"
    supports_pipeline = False  # the teacher needs the batch, which a pipeline's last stage has not got
    cross_entropy_metric = "ce"  # validation perplexity / bits per byte: of the data's tokens

    def __init__(self, loss: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5,
                 kd_ratio: float = 0.5) -> None:
        if loss not in KD_LOSSES:
            raise ConfigError(f"distill.loss={loss!r} is not one of {', '.join(KD_LOSSES)}")
        self.loss, self.temperature, self.beta, self.kd_ratio = loss, temperature, beta, kd_ratio
        self.teacher: Teacher | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> Distill:
        d = cfg.distill
        if cfg.train.loss_chunk_tokens:
            raise ConfigError("objective distill compares whole vocabulary rows of teacher and student: set "
                              "train.loss_chunk_tokens=0")
        return cls(loss=d.loss, temperature=d.temperature, beta=d.beta, kd_ratio=d.kd_ratio)

    def __call__(self, model: nn.Module, batch: TokenBatch) -> ObjectiveOutput:
        if self.teacher is None:
            raise ConfigError("objective distill has no teacher: set distill.teacher (a run, checkpoint or "
                              "Hugging Face dir with the student's vocabulary)")
        logits = self.logits(model, batch)  # (B, T, V)
        targets = batch.targets
        with torch.no_grad():
            teacher = self.teacher(batch)
        mask = targets != IGNORE_INDEX  # (B, T)
        if isinstance(teacher, TopK):
            kd = topk_forward_kl_sum(logits, teacher.ids, teacher.logits, teacher.lse, mask, self.temperature)
        else:
            if teacher.shape != logits.shape:
                raise ConfigError(f"the teacher's logits have shape {tuple(teacher.shape)}, the student's "
                                  f"{tuple(logits.shape)}: teacher and student need the same vocabulary size")
            kd = kd_loss_sum(logits, teacher, mask, self.loss, self.temperature, self.beta)
        ce = token_loss_sum(logits, targets)
        loss = self.kd_ratio * kd + (1 - self.kd_ratio) * ce
        return ObjectiveOutput(loss, {"kd": kd.detach(), "ce": ce.detach()})

    def stage_loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        # check_layout refuses parallel.pp > 1 for objectives without supports_pipeline before any step
        raise ConfigError("objective distill needs the teacher's view of the batch, which a pipeline's last "
                          "stage does not have: set parallel.pp=1")
