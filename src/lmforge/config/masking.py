"""The masking objectives' settings sections: `mlm` (BERT's masked LM of an encoder) and
`span_corruption` (T5's span corruption of an encoder-decoder). Each corruption is drawn from a generator
seeded by the section's seed and the row's own tokens (resume-exact, no RNG state)."""

from __future__ import annotations

from pydantic import Field, model_validator

from lmforge.config.section import SEED_MAX, Section


class MLMConfig(Section):
    """Masked-LM corruption (objective mlm), BERT's recipe: of the positions picked, replace 80% by the
    mask token, 10% by a random token, keep 10%; the loss is over the picked positions only."""

    mask_prob: float = Field(0.15, gt=0.0, lt=1.0, description="Fraction of (non-special) positions picked.")
    replace_prob: float = Field(0.8, ge=0.0, le=1.0, description="Of the picked: replaced by the mask token.")
    random_prob: float = Field(0.1, ge=0.0, le=1.0, description="Of the picked: replaced by a random token "
                               "(the rest are kept as they are).")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Seed of the masks (None: run.seed); each "
                             "row's mask is a function of this seed and the row's tokens.")

    @model_validator(mode="after")
    def _check_split(self) -> MLMConfig:
        if self.replace_prob + self.random_prob > 1.0:
            raise ValueError(f"mlm.replace_prob + mlm.random_prob = {self.replace_prob + self.random_prob:g} "
                             "exceeds 1 (the rest, kept unchanged, cannot be negative)")
        return self


class SpanCorruptionConfig(Section):
    """T5's span corruption (objective span_corruption; Raffel et al. 2020, random_spans_noise_mask): of
    each window of train.seq_len tokens, round(seq_len * noise_density) tokens in round(that /
    mean_noise_span_length) spans are removed; the encoder reads the rest with a sentinel <extra_id_k> in
    place of span k and EOS, the decoder predicts each sentinel followed by its span, then EOS."""

    noise_density: float = Field(0.15, gt=0.0, lt=1.0, description="Fraction of each window's tokens "
                                 "removed (T5: 0.15).")
    mean_noise_span_length: float = Field(3.0, ge=1.0, description="Mean length of a removed span (T5: 3).")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Seed of the spans (None: run.seed); each "
                             "window's spans are a function of this seed and the window's tokens.")
