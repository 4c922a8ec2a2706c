"""Span-corruption setup: the objective learns the tokenizer's sentinel ids (<extra_id_k>) and its EOS."""

from __future__ import annotations

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.engine.objectives.span_corruption import SpanCorruption


class SpanCorruptionSetup(MethodSetup):
    names = (SpanCorruption.name,)

    def attach(self, objective, ctx: SetupContext):
        if isinstance(objective, SpanCorruption) and objective.sentinels is None:
            objective.bind(ctx.tokenizer)
        return None

    def attach_eval(self, run, data) -> None:
        if isinstance(run.objective, SpanCorruption) and run.objective.sentinels is None:
            run.objective.bind(run.tokenizer)
