"""`lmforge tokenizer compare`'s measurements: tokenizers given as files or trained here (kind and vocab
size) on data.sources, measured on held-out text.

Per tokenizer, on the held-out documents: fertility (tokens per whitespace-separated word), bytes per token
(UTF-8 bytes of the text over its tokens), the fraction of the vocabulary the text uses, the rate of
unknown tokens, the fraction of documents that decode back exactly, and encode speed (the best of three
batch encodes). Everything read is bounded: the number of tokenizers, the size of a tokenizer file and the
characters of training and held-out text (a document is cut where the budget ends).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.config.schema import DataConfig
from lmforge.data.prepare import _LONG_DOC_CHARS, _pieces, split_of
from lmforge.data.sources import SourceStats, check_source, iter_documents
from lmforge.data.tokenizer import KINDS, Tokenizer
from lmforge.errors import DataError

MAX_TOKENIZERS = 8  # files and trained ones together: each is trained and/or measured in turn
MAX_FILE_BYTES = 256 << 20  # a tokenizer.json beyond this is refused before it is parsed
MAX_HELD_OUT_CHARS = 100_000_000
ENCODE_REPEATS = 3  # encode speed: the best of this many timed batch encodes


@dataclass(frozen=True)
class Spec:
    """One tokenizer to compare: a file (`path`), or a `kind` to train with `vocab_size`."""

    label: str
    path: str | None = None
    kind: str | None = None
    vocab_size: int | None = None


def parse_train(text: str, default_vocab: int) -> Spec:
    """A --train value, KIND or KIND:VOCAB (e.g. unigram:8192), as a Spec; DataError naming what is wrong."""
    kind, _, vocab = text.partition(":")
    if kind not in KINDS:
        raise DataError(f"--train {text}: kind {kind!r} is not one lmforge trains; give one of "
                        f"{', '.join(KINDS)}, optionally with :VOCAB (e.g. unigram:8192)")
    try:
        size = int(vocab) if vocab else default_vocab
    except ValueError:
        raise DataError(f"--train {text}: vocabulary size {vocab!r} is not a whole number; give KIND:VOCAB, "
                        "e.g. unigram:8192") from None
    if not 260 <= size <= 1_000_000:
        raise DataError(f"--train {text}: vocabulary size {size} is outside 260..1000000")
    return Spec(f"{kind}-{size}", kind=kind, vocab_size=size)


def check_specs(specs: list[Spec]) -> None:
    """Refuse, before any work, too many tokenizers, a missing or oversized file, a label given twice."""
    if not specs:
        raise DataError("nothing to compare: give tokenizer files (--tokenizer PATH) and/or kinds to train "
                        "(--train KIND[:VOCAB]), at least one in all")
    if len(specs) > MAX_TOKENIZERS:
        raise DataError(f"{len(specs)} tokenizers given; compare at most {MAX_TOKENIZERS} at a time")
    labels = [s.label for s in specs]
    if dup := sorted({x for x in labels if labels.count(x) > 1}):
        raise DataError(f"{dup[0]} is given twice; give each tokenizer once")
    for s in specs:
        if s.path is None:
            continue
        path = Path(s.path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"--tokenizer {s.path}: no such file; give a tokenizer.json or a folder holding "
                            "one")
        if file.stat().st_size > MAX_FILE_BYTES:
            raise DataError(f"--tokenizer {s.path}: {file.stat().st_size:,} bytes, over the "
                            f"{MAX_FILE_BYTES >> 20} MiB a tokenizer.json may have here")


def read_texts(d: DataConfig, seed: int, train_chars: int, held_out_chars: int,
               held_out: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(train documents, held-out documents), each at most so many characters in all.

    Without `held_out` the split is prepare's (a seeded hash of the document's index, data.val_fraction, or
    data.val_sources as the held-out text), so trained tokenizers never see the held-out documents; with
    it, those files or folders are the held-out text and every document of data.sources may train."""
    if not 1 <= held_out_chars <= MAX_HELD_OUT_CHARS:
        raise DataError(f"held-out characters {held_out_chars:,} outside 1..{MAX_HELD_OUT_CHARS:,}")
    val_sources = list(held_out) if held_out else list(d.val_sources)
    for src in val_sources:  # a bad path fails before anything is read
        check_source(src)
    train: list[str] = []
    val: list[str] = []
    room = {"train": train_chars, "val": held_out_chars}

    def take(split: str, doc: str) -> None:
        doc = doc[: room[split]]
        if doc:
            (train if split == "train" else val).append(doc)
            room[split] -= len(doc)

    for i, doc in enumerate(iter_documents(d, SourceStats())):
        take("train" if val_sources else split_of(i, seed, d.val_fraction), doc)
        if room["train"] <= 0 and (val_sources or room["val"] <= 0):
            break
    if val_sources:
        held = d.model_copy(update={"sources": val_sources, "max_chars": None})
        for doc in iter_documents(held, SourceStats()):
            take("val", doc)
            if room["val"] <= 0:
                break
    if not val:
        raise DataError(f"no held-out text: {', '.join(val_sources) if val_sources else 'data.sources'} gave "
                        "no validation documents; give --held-out PATH or more text")
    return train, val


def _training_pieces(docs: Iterable[str]) -> Iterator[str]:
    for doc in docs:  # as prepare feeds its trainer: a huge document in pieces cut before whitespace
        yield from (_pieces(doc) if len(doc) > _LONG_DOC_CHARS else (doc,))


def load_or_train(spec: Spec, train_docs: list[str], min_frequency: int) -> Tokenizer:
    """The tokenizer of `spec`: its file loaded, or one trained on `train_docs`."""
    if spec.path is not None:
        return Tokenizer.load(spec.path)
    if not train_docs:
        raise DataError(f"--train {spec.label}: no training text (data.sources gave no train documents)")
    return Tokenizer.train(_training_pieces(train_docs), spec.vocab_size, min_frequency, spec.kind)


def measure(tok: Tokenizer, docs: list[str], repeats: int = ENCODE_REPEATS) -> dict[str, float | int | None]:
    """The metrics of `tok` on `docs` (see the module docstring); None where a count it divides by is 0."""
    encoded = tok.encode_batch(docs)
    seconds = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        tok.encode_batch(docs)
        seconds = min(seconds, time.perf_counter() - t0)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    words = sum(len(d.split()) for d in docs)
    tokens = sum(map(len, encoded))
    ids = np.concatenate([np.asarray(e, dtype=np.int64) for e in encoded] or [np.zeros(0, np.int64)])
    unk = tok.unk_id
    exact = sum(tok.decode(e) == d for e, d in zip(encoded, docs))

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return {
        "documents": len(docs), "bytes": n_bytes, "words": words, "tokens": tokens,
        "vocab_size": tok.vocab_size,
        "tokens_per_word": ratio(tokens, words),
        "bytes_per_token": ratio(n_bytes, tokens),
        "tokens_per_byte": ratio(tokens, n_bytes),
        "vocab_used": ratio(len(np.unique(ids)), tok.vocab_size),
        "unknown_rate": 0.0 if unk is None or not tokens else float((ids == unk).sum()) / tokens,
        "round_trip": ratio(exact, len(docs)),
        "encode_mb_per_s": ratio(n_bytes / 1e6, seconds) if repeats else None,
    }
