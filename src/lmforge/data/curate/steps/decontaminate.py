"""Decontamination: drop training documents that share a word n-gram with an evaluation set.

Eval files are read once, when the step is built:

- `.jsonl`: one JSON value per line; every string inside it (all fields, nested lists and objects)
  is a separate text, so n-grams never span two fields (a question and its answer);
- `.json`: one JSON value for the whole file, strings collected the same way;
- anything else: the whole file is one text.

Words are lower-cased runs of word characters (punctuation and spacing dropped), so "Hello, World!"
and "hello world" give the same n-grams. Texts shorter than `ngram` words contribute nothing: a
3-word answer matched as a whole would flag common phrases everywhere (the GPT-3 paper's 13-gram
rule has the same blind spot). N-grams are stable 64-bit hashes (blake2b of words combined in
numpy, see `dedup.ShingleHasher`), identical in every worker process, kept in one sorted array;
a document is checked with one vectorised `searchsorted`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data.curate.dedup import ShingleHasher, words
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def eval_texts(path: str | Path) -> Iterator[str]:
    """The texts of one eval file (see the module docstring for the formats); an unreadable, non-UTF-8
    or too deeply nested file is a clear error naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"curate.steps[decontaminate].eval_files: {path} is not a file")
    try:
        yield from _eval_texts(path)
    except (OSError, UnicodeDecodeError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise ValueError(
            f"curate.steps[decontaminate].eval_files: cannot read {path} ({why}); expected UTF-8 text, "
            "JSON or JSONL"
        ) from None


def _eval_texts(path: Path) -> Iterator[str]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                yield from _strings(record)
    elif path.suffix == ".json":
        try:
            yield from _strings(json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


class Step(MapStep):
    """Drop documents sharing a `cfg.ngram`-word n-gram with any of `cfg.eval_files`."""

    name = "decontaminate"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.hasher = ShingleHasher(cfg.ngram)
        self.names = [Path(p).name for p in cfg.eval_files]
        hashes, owners = [], []
        for i, path in enumerate(cfg.eval_files):
            for text in eval_texts(path):
                h = self.hasher(words(text), short_as_one=False)
                hashes.append(h)
                owners.append(np.full(len(h), i, dtype=np.int32))
        h = np.concatenate(hashes) if hashes else np.empty(0, dtype=np.uint64)
        owner = np.concatenate(owners) if owners else np.empty(0, dtype=np.int32)
        # sorted unique n-grams; an n-gram in several files is attributed to the first of them
        order = np.lexsort((owner, h))
        h, owner = h[order], owner[order]
        first = np.concatenate(([True], h[1:] != h[:-1])) if len(h) else np.empty(0, dtype=bool)
        self._grams, self._owner = h[first], owner[first]

    @property
    def num_ngrams(self) -> int:
        """Distinct eval n-grams held."""
        return len(self._grams)

    def _first_hit(self, text: str) -> int | None:
        """Index of the eval file of the document's first contaminated n-gram, or None."""
        if not len(self._grams):
            return None
        h = self.hasher(words(text), short_as_one=False)
        if not len(h):
            return None
        pos = np.searchsorted(self._grams, h)
        pos[pos == len(self._grams)] = 0
        hit = np.flatnonzero(self._grams[pos] == h)
        return int(self._owner[pos[hit[0]]]) if len(hit) else None

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        owner = self._first_hit(doc.text)
        if owner is None:
            return doc, None
        return None, f"decontaminate:{self.names[owner]}"
