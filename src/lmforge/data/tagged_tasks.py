"""The shipped tagged set: Python-like code lines whose words are tagged with BIO / IOB2 tags
(`lmforge tasks --tagged`), for the token-classification demo and tests, offline and deterministic like
the other shipped tasks.

A line is drawn from a few statement shapes over a small vocabulary; its words (split on spaces, so
punctuation is a word of its own) are tagged by what they are in the statement:

    {"tokens": ["total", "=", "count_words", "(", "\\"red", "fox\\"", ",", "3", ")"],
     "tags":   ["B-VAR", "O", "B-FUNC", "O", "B-STR", "I-STR", "O", "B-NUM", "O"]}

Entity types: KW (a keyword), FUNC (a function defined or called), VAR (a variable), NUM (a number), STR
(a string literal: one entity over all its words, so B-STR then I-STR). A name is a FUNC or a VAR by
where it stands (before "(" or after "def"), not by a lookup: the same names are drawn for both. The
same seed writes the same records; validation lines are never training lines.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

TAGS = ("B-FUNC", "B-KW", "B-NUM", "B-STR", "B-VAR", "I-STR", "O")
_NAMES = ("total", "count", "items", "value", "result", "name", "data", "size", "path", "text", "key",
          "index", "line", "words", "score", "parse", "load", "render", "split_words", "count_words",
          "read_file", "check", "merge", "update")
_WORDS = ("red", "fox", "hello", "world", "done", "error", "ok", "spam", "eggs", "alpha", "beta", "yes",
          "no", "start", "stop", "file", "name")


def _name(rng: random.Random, tag: str) -> list[tuple[str, str]]:
    return [(rng.choice(_NAMES), f"B-{tag}")]


def _arg(rng: random.Random) -> list[tuple[str, str]]:
    kind = rng.randrange(3)
    if kind == 0:
        return _name(rng, "VAR")
    if kind == 1:
        return [(str(rng.randrange(100 if rng.random() < 0.8 else 10_000)), "B-NUM")]
    words = [rng.choice(_WORDS) for _ in range(rng.randint(1, 3))]
    words[0], words[-1] = '"' + words[0], words[-1] + '"'
    return [(w, "B-STR" if i == 0 else "I-STR") for i, w in enumerate(words)]


def _call(rng: random.Random) -> list[tuple[str, str]]:
    out = [*_name(rng, "FUNC"), ("(", "O")]
    for i in range(rng.randint(0, 2)):
        out += ([(",", "O")] if i else []) + _arg(rng)
    return out + [(")", "O")]


def line(rng: random.Random) -> dict[str, list[str]]:
    """One record {tokens, tags} drawn from `rng`."""
    shape = rng.randrange(6)
    kw = lambda w: [(w, "B-KW")]  # noqa: E731
    if shape == 0:
        pairs = [*_name(rng, "VAR"), ("=", "O"), *(_call(rng) if rng.random() < 0.6 else _arg(rng))]
    elif shape == 1:
        pairs = [*kw("if"), *_name(rng, "VAR"), (rng.choice((">", "<", "==")), "O"), *_arg(rng), (":", "O")]
    elif shape == 2:
        pairs = [*kw("for"), *_name(rng, "VAR"), *kw("in"), *_call(rng), (":", "O")]
    elif shape == 3:
        pairs = [*kw("return"), *_arg(rng), *([("+", "O"), *_arg(rng)] if rng.random() < 0.5 else [])]
    elif shape == 4:
        pairs = [*kw("def"), *_name(rng, "FUNC"), ("(", "O"), *_name(rng, "VAR"), (")", "O"), (":", "O")]
    else:
        pairs = _call(rng)
    return {"tokens": [w for w, _ in pairs], "tags": [t for _, t in pairs]}


def tagged_split(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, validation) records: validation first from the seeded stream, training records skip any
    line validation has."""
    stream = _stream(seed)
    val, seen = [], set()
    for r in stream:
        if len(val) >= n_val:
            break
        key = " ".join(r["tokens"])
        if key not in seen:
            seen.add(key)
            val.append(r)
    train = []
    for _ in range(50 * max(n_train, 1)):
        if len(train) >= n_train:
            break
        r = next(stream)
        if " ".join(r["tokens"]) not in seen:
            train.append(r)
    return train, val


def _stream(seed: int) -> Iterator[dict[str, list[str]]]:
    rng = random.Random(f"lmforge-tagged:{seed}")
    while True:
        yield line(rng)
