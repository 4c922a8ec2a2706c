"""Knowledge-distillation setup: the teacher (a model that shares the student's tokenizer, or its
precomputed top-k logits), for training and for evaluating a distilled run."""

from __future__ import annotations

import torch

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.config.schema import Config
from lmforge.engine.objectives.distill import Distill
from lmforge.errors import ConfigError


class DistillSetup(MethodSetup):
    names = (Distill.name,)

    def attach(self, objective, ctx: SetupContext):
        if isinstance(objective, Distill) and objective.teacher is None:
            if ctx.dims.tp > 1:
                raise ConfigError("objective distill keeps the whole teacher on each rank and compares whole "
                                  "vocabulary rows: one process, DDP or FSDP, not tensor parallelism")
            objective.teacher = teacher(ctx.cfg, ctx.tokenizer, ctx.device, ctx.say)
        return None

    def attach_eval(self, run, data) -> None:
        if isinstance(run.objective, Distill) and run.objective.teacher is None:
            run.objective.teacher = teacher(run.cfg, run.tokenizer, run.device, lambda *_: None)


def teacher(cfg: Config, tokenizer, device: torch.device, say):
    """Objective distill's teacher as batch -> logits, or a reader of its precomputed top-k cache."""
    from lmforge.finetune.teacher import load_teacher, teacher_logits

    if not cfg.distill.teacher and not cfg.distill.topk_cache:
        raise ConfigError("objective distill needs a teacher: set distill.teacher to a run dir, checkpoint "
                          "dir or Hugging Face dir that shares the student's tokenizer")
    if cfg.distill.topk_cache:
        from lmforge.finetune.topk_cache import TopKCache

        if cfg.distill.loss != "forward_kl":
            raise ConfigError(f"distill.topk_cache keeps only the teacher's top-k logits, which determine "
                              f"the forward KL only; distill.loss={cfg.distill.loss} needs the teacher: "
                              "unset distill.topk_cache")
        cache = TopKCache(cfg.distill.topk_cache, cfg.seq_len, cfg.distill.temperature, tokenizer, device)
        say(f"teacher: top-{cache.k} logits of {len(cache):,} windows from {cfg.distill.topk_cache}")
        return cache
    teacher = load_teacher(cfg.distill.teacher, cfg.distill.teacher_weights, cfg.model.vocab_size, tokenizer,
                           device, say)
    return teacher_logits(teacher)
