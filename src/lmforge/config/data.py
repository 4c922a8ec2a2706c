"""The run's identity (`run`) and its text data (`data`, `data.tokenizer`)."""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from lmforge.config.section import SEED_MAX, Section


class RunConfig(Section):
    name: str = Field("run", description="Human-readable run name (used in logs and reports).")
    dir: str = Field("runs/run", description="Run directory: config, metrics, plots and checkpoints go here.")
    seed: int = Field(1337, ge=0, le=SEED_MAX, description="Seed for model init, dropout and data order.")
    overwrite: bool = Field(
        False, description="Allow training into a run dir that already holds another run (deletes it)."
    )


_MIN_FREQUENCY = 2


class TokenizerConfig(Section):
    path: str | None = Field(
        None, description="Existing tokenizer.json to use; when unset a tokenizer of `kind` is trained."
    )
    kind: Literal["bpe", "wordpiece", "unigram"] = Field(
        "bpe", description="What to train when no path is given: 'bpe' (byte-level, GPT-2 style: any text, "
        "exact round trip), 'wordpiece' (BERT-cased normalisation and splitting, [UNK] for a word it cannot "
        "spell; decoding loses whitespace) or 'unigram' (SentencePiece-style with byte fallback: any text, "
        "exact round trip). See the tokenize page."
    )
    vocab_size: int = Field(8192, ge=260, le=1_000_000, description="Vocabulary size of a trained "
                            "tokenizer (a unigram's includes its 256 byte tokens).")
    min_frequency: int = Field(_MIN_FREQUENCY, ge=1, description="Minimum pair frequency for a BPE or "
                               "WordPiece merge (a unigram has none: a value other than 2 is refused "
                               "with kind unigram).")
    train_chars: int = Field(
        50_000_000, ge=1000, description="At most this many characters of the corpus train the tokenizer."
    )

    @model_validator(mode="after")
    def _kind_fits(self) -> TokenizerConfig:
        # honoured or refused, never ignored: kind and min_frequency describe a tokenizer to train
        if self.path is not None and self.kind != "bpe":
            raise ValueError(f"kind={self.kind!r} says what to train, but path={self.path!r} gives a "
                             "tokenizer already trained (its own file says its kind); drop one of the two")
        # (compared with the default, not model_fields_set: a run's saved config.yaml spells every key)
        if self.kind == "unigram" and self.min_frequency != _MIN_FREQUENCY:
            raise ValueError(f"min_frequency={self.min_frequency} is a BPE / WordPiece merge threshold; a "
                             "unigram tokenizer prunes its pieces by likelihood and has none: drop "
                             "min_frequency, or use kind bpe or wordpiece")
        return self


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class SourceEntry(Section):
    path: str = Field(description="A file or folder of .txt/.md/.jsonl, or 'builtin:python'.")
    weight: float = Field(
        1.0, gt=0.0, le=1e6, description="Relative sampling probability of this source in the mixture "
        "(normalised over all entries; a plain string entry weighs 1). A source that runs out starts "
        "another epoch of itself, reshuffled."
    )
    name: str | None = Field(
        None, description="Name in the logs (tokens_seen/<name>, epochs/<name>); default: the file or "
        "folder name without extension ('python' for builtin:python)."
    )

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.fullmatch(v):
            raise ValueError(f"source name {v!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
        return v


def source_path(entry: str | SourceEntry) -> str:
    """The path (or builtin name) of a data.sources entry."""
    return entry if isinstance(entry, str) else entry.path


def source_name(entry: str | SourceEntry) -> str:
    """The name a data.sources entry has in the logs."""
    if not isinstance(entry, str) and entry.name:
        return entry.name
    path = source_path(entry)
    if path == "builtin:python":
        return "python"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", PurePath(path).stem or "source")[:64]


class DataConfig(Section):
    sources: list[str | SourceEntry] = Field(
        default_factory=lambda: ["builtin:python"],
        description="Text sources: files or folders of .txt/.md/.jsonl, or 'builtin:python' "
        "(the docs and stdlib source of the running Python). An entry may be a mapping {path, weight, "
        "name}: then the training stream is a weighted mixture (see the pretrain page).",
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
    max_chars_from: Literal["start", "spread"] = Field(
        "start", description="Which documents data.max_chars keeps: 'start', the first ones in source order; "
        "'spread', documents spread evenly over the whole of data.sources (one kept while the characters "
        "kept stay within max_chars / the sources' total size, estimated from their file sizes in bytes: "
        "text that is not ASCII, or compressed Parquet, reads a little less or stops a little early), and "
        "the tokenizer's train_chars spread over those in turn. `--budget` uses 'spread', so a corpus whose "
        "files differ from start to end (docs, then code) trains on every kind it holds."
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
    workers: int | Literal["auto"] = Field(
        1, description="Processes that encode the documents in `lmforge prepare` (an integer 1..64, or "
        "'auto': the usable cores, at most 8). The shards are byte for byte the same with any number; "
        "more pay off on large corpora (see the tokenize page)."
    )
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer settings.")

    @field_validator("workers")
    @classmethod
    def _workers_ok(cls, v: int | str) -> int | str:
        if v != "auto" and not 1 <= int(v) <= 64:
            raise ValueError(f"data.workers={v}: give 1..64 worker processes, or 'auto'")
        return v

    @model_validator(mode="after")
    def _spread_needs_max_chars(self) -> DataConfig:
        if self.max_chars_from == "spread" and self.max_chars is None:
            raise ValueError("max_chars_from='spread' says how data.max_chars picks its documents, but "
                             "max_chars is not set (every document is read): set data.max_chars, or drop "
                             "max_chars_from")
        return self

    @field_validator("sources", mode="before")
    @classmethod
    def _entries(cls, v: object) -> object:
        # Each entry checked here, so an error names the entry and its key once (pydantic would report it
        # once per member of the str | mapping union).
        if not isinstance(v, list):
            return v
        out = []
        for i, e in enumerate(v):
            if isinstance(e, dict):
                try:
                    e = SourceEntry.model_validate(e)
                except ValidationError as err:
                    first = err.errors()[0]
                    key = ".".join(map(str, first["loc"])) or "entry"
                    raise ValueError(f"entry {i}: {key}: {first['msg']}; an entry is a path or a "
                                     "mapping {path, weight, name}") from None
            elif not isinstance(e, (str, SourceEntry)):
                raise ValueError(f"entry {i} is neither a path nor a mapping {{path, weight, name}}")
            out.append(e)
        return out

    @field_validator("sources")
    @classmethod
    def _names_unique(cls, v: list) -> list:
        if any(not isinstance(e, str) for e in v):
            names = [source_name(e) for e in v]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"two data.sources entries are both named {dup[0]!r}; give each a "
                                 "distinct name (e.g. {path: ..., weight: ..., name: web})")
        return v

    @property
    def source_paths(self) -> list[str]:
        """The paths of data.sources (mapping entries reduced to their path)."""
        return [source_path(e) for e in self.sources]

    @property
    def mixture(self) -> list[tuple[str, float]] | None:
        """(name, weight) per source when data.sources is a weighted mixture (an entry is a mapping),
        else None: the sources are then one stream, read in order, as always."""
        if all(isinstance(e, str) for e in self.sources):
            return None
        return [(source_name(e), 1.0 if isinstance(e, str) else e.weight) for e in self.sources]
