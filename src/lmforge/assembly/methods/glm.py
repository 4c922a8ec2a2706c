"""GLM blank-infilling setup (objective glm, over token data): the objective learns the tokenizer's
end-of-document, [MASK], [START] and [END] ids (`lmforge prepare` adds the last three for this method)."""

from __future__ import annotations

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.config.infill import GLM_TOKENS
from lmforge.engine.objectives.glm import GLM
from lmforge.errors import ConfigError


def _bind(objective, tokenizer) -> None:
    if not isinstance(objective, GLM) or objective.ids is not None:
        return
    ids = [None if tokenizer is None else tokenizer.token_id(t) for t in GLM_TOKENS]
    eos = None if tokenizer is None else tokenizer.eos_id
    if eos is None or None in ids:
        missing = [t for t, i in zip(GLM_TOKENS, ids, strict=True) if i is None]
        lacks = " ".join(missing) or "the last"
        raise ConfigError(f"objective {objective.name} needs the tokens {' '.join(GLM_TOKENS)} and an "
                          f"end-of-document token; this run's tokenizer lacks {lacks}: "
                          "prepare the data with objective.name=glm set (a new data.dir: `lmforge prepare` "
                          "adds them), or give a tokenizer that has them")
    objective.bind_tokens(eos, *ids)


class GLMSetup(MethodSetup):
    names = (GLM.name,)

    def attach(self, objective, ctx: SetupContext):
        _bind(objective, ctx.tokenizer)
        return None

    def attach_eval(self, run, data) -> None:
        _bind(run.objective, run.tokenizer)
