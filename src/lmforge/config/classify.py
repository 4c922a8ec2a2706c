"""The `classify` section: sequence classification and regression (objective classify) on labelled
records, GLUE's shapes: {sentence, label} or pairs {sentence1, sentence2, label}."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config.section import Section

MAX_LABELS = 1000  # a classifier's head, the label map and the per-class report stay small


class ClassifyConfig(Section):
    """Labelled data and the head of a classifier (num_labels >= 2) or a regressor (num_labels = 1)."""

    data: list[str] = Field(
        default_factory=list, description="Labelled records: .jsonl / .parquet files or folders of them, "
        "one record per example with the text field(s) and the label field (`lmforge tasks --labelled` "
        "writes a shipped set)."
    )
    val_data: list[str] = Field(
        default_factory=list, description="Held-out labelled records (empty: classify.val_fraction of "
        "classify.data)."
    )
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Fraction of the records held out.")
    num_labels: int = Field(
        2, ge=1, le=MAX_LABELS, description="Outputs of the head: the number of classes (cross-entropy), or "
        "1 for regression (mean squared error on a number label)."
    )
    text_field: str = Field("sentence", min_length=1, description="The record's text field (GLUE: sentence; "
                            "a pair's first text, e.g. sentence1).")
    text_pair_field: str | None = Field(
        None, min_length=1, description="The record's second text for pair tasks (GLUE: sentence2; None: "
        "single sentences). The two texts are joined by a newline."
    )
    label_field: str = Field("label", min_length=1, description="The record's label field: a class name "
                             "(string) or index (integer), or a number for regression.")
    class_weights: Literal["none", "balanced"] | list[float] = Field(
        "none", description="Weights of the classes in the loss, for imbalanced labels: none, balanced "
        "(n_examples / (num_labels x class count) of the training split, scikit-learn's rule), or one "
        "positive weight per class in the label map's order."
    )

    @field_validator("class_weights")
    @classmethod
    def _check_weights(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(math.isfinite(w) and w > 0 for w in v):
            raise ValueError(f"classify.class_weights {v}: each weight must be a positive finite number")
        return v

    @model_validator(mode="after")
    def _check(self) -> ClassifyConfig:
        if isinstance(self.class_weights, list) and len(self.class_weights) != self.num_labels:
            raise ValueError(f"classify.class_weights has {len(self.class_weights)} weights for "
                             f"classify.num_labels={self.num_labels}: give one per class")
        if self.num_labels == 1 and self.class_weights != "none":
            raise ValueError("classify.class_weights is for classification; classify.num_labels=1 is "
                             "regression: set class_weights to none")
        if self.text_pair_field == self.text_field or self.label_field in (self.text_field,
                                                                            self.text_pair_field):
            raise ValueError("classify.text_field, text_pair_field and label_field must be different fields")
        return self
