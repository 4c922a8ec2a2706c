"""The run's identity (`run`) and its text data (`data`, `data.tokenizer`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmforge.config.section import SEED_MAX, Section


class RunConfig(Section):
    name: str = Field("run", description="Human-readable run name (used in logs and reports).")
    dir: str = Field("runs/run", description="Run directory: config, metrics, plots and checkpoints go here.")
    seed: int = Field(1337, ge=0, le=SEED_MAX, description="Seed for model init, dropout and data order.")
    overwrite: bool = Field(
        False, description="Allow training into a run dir that already holds another run (deletes it)."
    )


class TokenizerConfig(Section):
    path: str | None = Field(
        None, description="Existing tokenizer.json to use; when unset a byte-level BPE is trained."
    )
    vocab_size: int = Field(8192, ge=260, le=1_000_000, description="Vocabulary size of a trained BPE.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    train_chars: int = Field(
        50_000_000, ge=1000, description="At most this many characters of the corpus train the tokenizer."
    )


class DataConfig(Section):
    sources: list[str] = Field(
        default_factory=lambda: ["builtin:python"],
        description="Text sources: files or folders of .txt/.md/.jsonl, or 'builtin:python' "
        "(the docs and stdlib source of the running Python).",
    )
    dir: str | None = Field(
        None, description="Where prepared shards and the tokenizer go (default: <run.dir>/data)."
    )
    text_key: str = Field("text", description="Field holding the document text in JSONL records.")
    val_fraction: float = Field(
        0.02, gt=0.0, lt=0.5, description="Fraction of documents held out for validation."
    )
    val_sources: list[str] = Field(
        default_factory=list, description="Validation text of your choosing (files or folders, read like "
        "data.sources): with it every document of data.sources trains and val_fraction is not used."
    )
    max_chars: int | None = Field(
        None, ge=1, description="Stop reading sources after this many characters (None: read all); "
        "data.val_sources gets as many again."
    )
    on_bad_utf8: Literal["skip", "fail"] = Field(
        "skip", description="A file that is not UTF-8: skip it and count it, or fail with its path."
    )
    on_bad_json: Literal["skip", "fail"] = Field(
        "fail", description="A malformed JSONL line: skip it and count it, or fail with file and line."
    )
    shard_tokens: int = Field(
        1 << 24, ge=1024, description="Tokens per shard file (shards are memory-mapped when loading)."
    )
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer settings.")
