"""The `qa` section: extractive question answering (objective qa, a start/end span head) on SQuAD-like
records {context, question, answers: {text: [...], answer_start: [...]}}."""

from __future__ import annotations

from pydantic import Field, model_validator

from lmforge.config.section import Section

MAX_WINDOWS = 64  # windows one long context is cut into: bounds the work one record can ask for


class QAConfig(Section):
    """SQuAD-like records, how a long context is windowed and the longest answer predicted."""

    data: list[str] = Field(
        default_factory=list, description="SQuAD-like records: .jsonl / .parquet files or folders of them, "
        "one question per record with its context and answers (`lmforge tasks --qa` writes a shipped set)."
    )
    val_data: list[str] = Field(
        default_factory=list, description="Held-out records (empty: qa.val_fraction of qa.data)."
    )
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Fraction of the records held out.")
    context_field: str = Field("context", min_length=1, description="The record's passage.")
    question_field: str = Field("question", min_length=1, description="The record's question.")
    answers_field: str = Field("answers", min_length=1, description="The record's answers: {text: [...], "
                               "answer_start: [...]} (character offsets into the context, SQuAD's shape); "
                               "the first answer is trained on, every one counts in exact match and F1.")
    doc_stride: int = Field(
        32, ge=1, description="Tokens of context two consecutive windows of a long context share "
        "(transformers' run_qa doc_stride): a context longer than a window is read in overlapping windows."
    )
    max_windows: int = Field(8, ge=1, le=MAX_WINDOWS, description="At most this many windows per record "
                             "(the rest of a longer context is not read).")
    max_answer_tokens: int = Field(30, ge=1, description="The longest answer span predicted, in tokens "
                                   "(run_qa's max_answer_length).")

    @model_validator(mode="after")
    def _check(self) -> QAConfig:
        names = (self.context_field, self.question_field, self.answers_field)
        if len(set(names)) != 3:
            raise ValueError("qa.context_field, question_field and answers_field must be different fields")
        return self
