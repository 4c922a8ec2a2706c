"""Generalized knowledge distillation on chat data (objective gkd; Agarwal et al. 2024, "On-Policy
Distillation of Language Models"; TRL's GKDTrainer). A student learns from a frozen teacher that shares
its tokenizer, on the completion tokens of chat data:

    loss = sum over completion targets of JSD_beta(teacher_T || student_T)

where `_T` is the next-token distribution of logits / temperature and JSD_beta the generalised
Jensen-Shannon divergence of engine/kd_loss.py (beta 0: forward KL(teacher || student), beta 1: reverse
KL(student || teacher), TRL's convention). There is no temperature**2 factor: each position's value is
TRL's `GKDTrainer.generalized_jsd_loss` at the same beta and temperature (tests/parity/test_gkd_trl.py).
TRL's trainer samples at its `temperature` but calls that loss at temperature 1; here gkd.temperature is
both (at 1 the two agree).

Reduction: TRL's `reduction="batchmean"` divides the summed divergence by the number of label tokens
(labels != -100) of the batch; with gradient accumulation it divides by the step's count
(`num_items_in_batch`). Here the objective returns the sum over the batch's targets and `num_targets`
their count; the step divides every micro-batch's sum by the count of the WHOLE step (all micro-batches,
all data-parallel ranks), so one micro-batch gives exactly TRL's batchmean, and accumulation and DDP give
the batchmean of the one big batch they stand for.

On-policy steps: with probability `lmbda` a training micro-batch's completions are replaced by ones the
student samples itself for the same prompts (the prompt of a conversation: its tokens before its last
run of loss targets, i.e. its last assistant turn), and the loss is computed on those. The draw and the
samples come from the batch's seed (`GKDBatch.seed`, fixed by the loader from the run seed, rank, epoch
and position), so a resumed run makes the same draws and samples the same tokens. The sampling itself
(the student's weights, KV cache, stop tokens) is `sampler`, a callable the assembly supplies; the
teacher is `teacher`, batch -> logits. Validation batches are plain `ChatBatch`es and never sampled:
they score the held-out data's completions, as TRL's evaluation does.

Metrics: `ce`, the student's cross-entropy of the targets the loss is over (the data's completion, or
on an on-policy step its own sample), so validation reports a perplexity of the held-out completions
(`cross_entropy_metric`); `on_policy`, the fraction of the step's targets that were sampled.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, ChatBatch
from lmforge.engine.kd_loss import kd_divergence
from lmforge.engine.loss import logits_of, token_loss_sum
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.errors import ConfigError


@dataclass(frozen=True)
class GKDBatch(ChatBatch):
    """A training batch of chat rows with the seed of its on-policy draw and samples; `sampled`: its
    completions are the student's own (an on-policy batch the sampler made)."""

    seed: int = 0
    sampled: bool = False

    def to(self, device: torch.device | str, non_blocking: bool = False) -> GKDBatch:
        moved = super().to(device, non_blocking)
        return GKDBatch(**{f: getattr(moved, f) for f in _CHAT_FIELDS}, seed=self.seed, sampled=self.sampled)

    def pin_memory(self) -> GKDBatch:
        pinned = super().pin_memory()
        return GKDBatch(**{f: getattr(pinned, f) for f in _CHAT_FIELDS}, seed=self.seed, sampled=self.sampled)


_CHAT_FIELDS = tuple(ChatBatch.__dataclass_fields__)

Teacher = Callable[[ChatBatch], torch.Tensor]  # batch -> the teacher's logits (B, T, V)
Sampler = Callable[[ChatBatch, int], "ChatBatch | None"]  # (batch, seed) -> its prompts, sampled completions


def on_policy_draw(seed: int, lmbda: float) -> bool:
    """Whether the batch of `seed` trains on the student's own samples: a uniform draw below lmbda
    (lmbda 0: never, 1: always). Drawn from a stream of its own (numpy's SeedSequence of (seed, 1)), not
    the first number of the sampler's torch generator, which `seed` also seeds: the draw and the samples
    stay independent."""
    return bool(np.random.default_rng([seed, 1]).random() < lmbda)


def gkd_loss_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                 beta: float, temperature: float) -> torch.Tensor:
    """The generalised JSD summed over the positions whose target is not IGNORE_INDEX (fp32)."""
    div = kd_divergence(student_logits, teacher_logits, "jsd", temperature, beta)  # (B, T)
    return torch.where(targets != IGNORE_INDEX, div, torch.zeros_like(div)).sum()


class GKD(Objective):
    name = "gkd"
    batch_type = ChatBatch
    cross_entropy_metric = "ce"  # validation perplexity: of the held-out completions

    def __init__(self, beta: float = 0.5, temperature: float = 0.9, lmbda: float = 0.5,
                 packing: bool = True) -> None:
        if not (0.0 <= beta <= 1.0 and 0.0 <= lmbda <= 1.0 and 0 < temperature < math.inf):
            raise ConfigError(f"gkd: beta={beta} and lmbda={lmbda} must lie in [0, 1] and temperature="
                              f"{temperature} be a positive number")
        self.beta, self.temperature, self.lmbda, self.packing = beta, temperature, lmbda, packing
        self.teacher: Teacher | None = None
        self.sampler: Sampler | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> GKD:
        if cfg.train.loss_chunk_tokens:
            raise ConfigError("objective gkd compares whole vocabulary rows of teacher and student: set "
                              "train.loss_chunk_tokens=0")
        g = cfg.gkd
        return cls(beta=g.beta, temperature=g.temperature, lmbda=g.lmbda, packing=cfg.sft.packing)

    def batch_of(self, raw: Any) -> ChatBatch:
        """A training batch drawn on-policy becomes the student's own completions here (before the
        forward, without gradients); every other batch is trained on as the data has it."""
        batch = super().batch_of(raw)
        if isinstance(batch, GKDBatch) and not batch.sampled and self.lmbda > 0 \
                and on_policy_draw(batch.seed, self.lmbda):
            if self.sampler is None:
                raise ConfigError("objective gkd with gkd.lmbda > 0 samples completions from the student "
                                  "through a sampler, which the assembly gives it; none is set")
            sampled = self.sampler(batch, batch.seed)
            if sampled is not None:  # None: no conversation of the batch has a completion to replace
                return GKDBatch(**{f: getattr(sampled, f) for f in _CHAT_FIELDS}, seed=batch.seed,
                                sampled=True)
        return batch

    def num_targets(self, batch: ChatBatch) -> int:
        return batch.target_count()  # counted on the host (a sampled batch carries its count)

    def target_ids(self, batch: ChatBatch) -> torch.Tensor:
        return batch.targets[batch.targets != IGNORE_INDEX]

    def __call__(self, model: nn.Module, batch: ChatBatch) -> ObjectiveOutput:
        if self.teacher is None:
            raise ConfigError("objective gkd has no teacher: set gkd.teacher (a run, checkpoint or Hugging "
                              "Face dir with the student's tokenizer)")
        kwargs = {} if batch.segment_ids is None else {"position_ids": batch.position_ids,
                                                        "segment_ids": batch.segment_ids}
        logits = logits_of(model(batch.input_ids, **kwargs))  # (B, T, V)
        with torch.no_grad():
            teacher = self.teacher(batch)
        if teacher.shape != logits.shape:
            raise ConfigError(f"the teacher's logits have shape {tuple(teacher.shape)}, the student's "
                              f"{tuple(logits.shape)}: teacher and student need the same vocabulary size")
        loss = gkd_loss_sum(logits, teacher, batch.targets, self.beta, self.temperature)
        ce = token_loss_sum(logits, batch.targets).detach()
        sampled = isinstance(batch, GKDBatch) and batch.sampled
        on_policy = torch.full((), float(self.num_targets(batch)) if sampled else 0.0, device=ce.device)
        return ObjectiveOutput(loss, {"ce": ce, "on_policy": on_policy})

    def check_model(self, model: nn.Module) -> None:
        params = inspect.signature(model.forward).parameters
        if self.packing and ("segment_ids" not in params or "position_ids" not in params):
            raise ConfigError("objective gkd packs conversations (sft.packing) and needs a model whose "
                              "forward takes position_ids= and segment_ids= (lmforge's Transformer); "
                              f"{type(model).__name__} does not: set sft.packing=false")
