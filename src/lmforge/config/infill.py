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
