"""Masked-LM setup: the objective learns the tokenizer's special ids ([CLS] / [SEP] / [MASK])."""

from __future__ import annotations

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.engine.objectives.mlm import MaskedLM


class MLMSetup(MethodSetup):
    names = (MaskedLM.name,)

    def attach(self, objective, ctx: SetupContext):
        if isinstance(objective, MaskedLM) and objective.ids is None:
            objective.bind(ctx.tokenizer)  # its [CLS] / [SEP] / [MASK] ids
        return None

    def attach_eval(self, run, data) -> None:
        if isinstance(run.objective, MaskedLM) and run.objective.ids is None:
            run.objective.bind(run.tokenizer)
