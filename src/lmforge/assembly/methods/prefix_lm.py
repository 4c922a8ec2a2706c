"""Prefix-LM setup (objective prefix_lm, over token data): the objective learns the tokenizer's
end-of-document id, where it splits the stream's windows into documents."""

from __future__ import annotations

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.engine.objectives.prefix_lm import PrefixLM
from lmforge.errors import ConfigError


def _bind(objective, tokenizer) -> None:
    if isinstance(objective, PrefixLM) and objective.eos is None:
        eos = None if tokenizer is None else tokenizer.eos_id
        if eos is None:
            raise ConfigError(f"objective {objective.name} splits the token stream into documents at the "
                              "tokenizer's end-of-document id, and this run's tokenizer has none: prepare "
                              "the data with `lmforge prepare` (it ends every document with one)")
        objective.bind(eos)


class PrefixLMSetup(MethodSetup):
    names = (PrefixLM.name,)

    def attach(self, objective, ctx: SetupContext):
        _bind(objective, ctx.tokenizer)
        return None

    def attach_eval(self, run, data) -> None:
        _bind(run.objective, run.tokenizer)
