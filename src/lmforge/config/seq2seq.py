"""The `seq2seq` section: sequence-to-sequence fine-tuning of the encoder-decoder (objective seq2seq,
what `lmforge sft` trains on a model.arch=t5 model) on input -> target records: plain {input, target}
records (field names set here) or the chat records `lmforge tasks` writes (the user's turn is the input,
the assistant's reply the target; data/seq2seq_data.py says how other shapes map)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lmforge.config.section import Section


class Seq2SeqConfig(Section):
    """Input -> target records, their field names and what happens to a record too long."""

    data: list[str] = Field(
        default_factory=list, description="Input -> target records: .jsonl / .parquet files or folders of "
        "them; each either has seq2seq.input_field and seq2seq.target_field (strings), or is a chat record "
        "(messages, prompt/completion, Alpaca, ShareGPT: `lmforge tasks` writes them) with one user turn "
        "and one assistant reply."
    )
    val_data: list[str] = Field(
        default_factory=list, description="Held-out records (empty: seq2seq.val_fraction of seq2seq.data)."
    )
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of the records held out.")
    input_field: str = Field("input", min_length=1, description="The plain record's encoder input text.")
    target_field: str = Field("target", min_length=1, description="The plain record's target text (what "
                              "the decoder learns to write).")
    system: Literal["prepend", "refuse"] = Field(
        "prepend", description="A chat record's system prompt: put before the user's text in the input "
        "(separated by a blank line), or refuse the record (its file:line)."
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="An input longer than train.seq_len or a target longer than model."
        "max_seq_len (EOS included): keep its start (and the EOS), or drop the record (counted)."
    )

    @model_validator(mode="after")
    def _check(self) -> Seq2SeqConfig:
        if self.input_field == self.target_field:
            raise ValueError(f"seq2seq.input_field and seq2seq.target_field are both {self.input_field!r}: "
                             "name two different fields")
        return self
