"""The `distill` section: knowledge distillation's teacher and losses (objective distill). Moved here from
config/methods.py (its 600-line cap); config.methods and config.schema re-export it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmforge.config.section import Section


class DistillConfig(Section):
    """Knowledge distillation (objective distill): the teacher and how its distributions are matched."""

    teacher: str | None = Field(
        None, description="The teacher: a run dir, checkpoint dir or Hugging Face dir (a quantized run "
        "too) whose vocabulary is the student's; required by objective distill."
    )
    teacher_weights: Literal["model", "ema", "swa"] = Field(
        "model", description="The teacher run's trained weights or their EMA / SWA average."
    )
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl", description="forward_kl: KL(teacher || student) (Hinton); reverse_kl: KL(student || "
        "teacher) (MiniLLM); jsd: generalised Jensen-Shannon with distill.beta (GKD)."
    )
    temperature: float = Field(
        1.0, gt=0.0, description="Both logits are divided by it; the divergence is scaled by its square."
    )
    beta: float = Field(
        0.5, ge=0.0, le=1.0, description="jsd: the teacher's weight in the mixture (0: forward KL, 1: "
        "reverse KL), TRL's convention."
    )
    kd_ratio: float = Field(
        0.5, ge=0.0, le=1.0, description="loss = kd_ratio * divergence + (1 - kd_ratio) * cross-entropy "
        "on the data's tokens."
    )
    topk_cache: str | None = Field(
        None, description="A teacher top-k cache dir (lmforge distill --precompute-topk writes it): the "
        "teacher's k largest logits of every row the run reads, instead of running the teacher each step "
        "(forward_kl only)."
    )
    topk: int = Field(32, ge=1, description="Logits per position kept by --precompute-topk.")
