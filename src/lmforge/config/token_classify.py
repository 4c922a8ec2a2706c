"""The `token_classify` section: token classification (NER-style tagging, objective tag) on
CoNLL-like records {tokens: [words], tags: [labels]}."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config.classify import MAX_LABELS
from lmforge.config.section import Section


class TokenClassifyConfig(Section):
    """Tagged words and the per-token head of a tagger."""

    data: list[str] = Field(
        default_factory=list, description="Tagged records: .jsonl / .parquet files or folders of them, one "
        "sentence per record with its words and one tag per word (`lmforge tasks --tagged` writes a "
        "shipped set)."
    )
    val_data: list[str] = Field(
        default_factory=list, description="Held-out tagged records (empty: token_classify.val_fraction of "
        "token_classify.data)."
    )
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Fraction of the records held out.")
    num_labels: int = Field(
        2, ge=2, le=MAX_LABELS, description="Outputs of the per-token head: the number of tags (with "
        "token_classify.label_names: their count)."
    )
    tokens_field: str = Field("tokens", min_length=1, description="The record's list of words (CoNLL: "
                              "tokens).")
    tags_field: str = Field("tags", min_length=1, description="The record's list of tags, one per word: "
                            "names (B-PER, I-PER, O, ...) or indices into token_classify.label_names "
                            "(CoNLL-2003 on the Hub: ner_tags).")
    label_names: list[str] = Field(
        default_factory=list, description="The tags in index order (empty: the training split's sorted tag "
        "names). Needed for integer tags to have names; entity-level metrics read BIO / IOB2 names."
    )
    class_weights: Literal["none", "balanced"] | list[float] = Field(
        "none", description="Weights of the tags in the loss, for imbalanced tags: none, balanced "
        "(labelled tokens / (num_labels x tag count) of the training split, scikit-learn's rule), or one "
        "positive weight per tag in the label map's order."
    )

    @field_validator("class_weights")
    @classmethod
    def _check_weights(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(math.isfinite(w) and w > 0 for w in v):
            raise ValueError(f"token_classify.class_weights {v}: each weight must be a positive finite "
                             "number")
        return v

    @model_validator(mode="after")
    def _check(self) -> TokenClassifyConfig:
        if self.label_names:
            if len(set(self.label_names)) != len(self.label_names) or not all(self.label_names):
                raise ValueError(f"token_classify.label_names {self.label_names[:10]}: names must be "
                                 "distinct and non-empty")
            if len(self.label_names) != self.num_labels:
                raise ValueError(f"token_classify.label_names has {len(self.label_names)} names for "
                                 f"token_classify.num_labels={self.num_labels}: give one per tag")
        if isinstance(self.class_weights, list) and len(self.class_weights) != self.num_labels:
            raise ValueError(f"token_classify.class_weights has {len(self.class_weights)} weights for "
                             f"token_classify.num_labels={self.num_labels}: give one per tag")
        if self.tokens_field == self.tags_field:
            raise ValueError("token_classify.tokens_field and tags_field must be different fields")
        return self
