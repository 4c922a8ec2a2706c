"""The settings sections of the decoder objectives with a bidirectional part: `prefix_lm` (a prefix
attended both ways, the continuation predicted) and `glm` (GLM's blank infilling)."""

from __future__ import annotations

from pydantic import Field, model_validator

from lmforge.config.section import SEED_MAX, Section


class PrefixLMConfig(Section):
    """Where each document's prefix ends (objective prefix_lm): a fraction f of its length drawn
    uniformly from [min_fraction, max_fraction] (seeded by the row's tokens, so resume is exact)."""

    min_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Smallest prefix, as a fraction of the "
                                "document's length (at least one token is always prefix).")
    max_fraction: float = Field(1.0, ge=0.0, le=1.0, description="Largest prefix, as a fraction of the "
                                "document's length (at least one token is always predicted).")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Seed of the boundaries (None: run.seed); "
                             "each row's boundaries are a function of this seed and the row's tokens.")

    @model_validator(mode="after")
    def _check_range(self) -> PrefixLMConfig:
        if self.min_fraction > self.max_fraction:
            raise ValueError(f"prefix_lm.min_fraction={self.min_fraction:g} exceeds prefix_lm.max_fraction="
                             f"{self.max_fraction:g}: give min_fraction <= max_fraction")
        return self


# GLM's [MASK], [START] and [END] as its tokenizers spell them: `lmforge prepare` adds those missing
GLM_TOKENS = ("[MASK]", "<|startofpiece|>", "<|endofpiece|>")


class GLMConfig(Section):
    """GLM's blank infilling (objective glm): spans of lengths ~ Poisson(mean_span) cover mask_prob of
    each document's tokens (GLM's 15% and lambda 3); each becomes one [MASK] in part A and is predicted
    after it in part B."""

    mask_prob: float = Field(0.15, gt=0.0, lt=1.0, description="Fraction of each document's tokens covered "
                             "by blanks.")
    mean_span: float = Field(3.0, gt=0.0, le=64.0, description="Mean (Poisson lambda) of a blank's length.")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Seed of the blanks (None: run.seed); each "
                             "row's blanks are a function of this seed and the row's tokens.")
