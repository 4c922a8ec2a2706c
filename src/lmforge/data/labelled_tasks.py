"""The shipped labelled set: sentiment-like reviews from a seeded grammar (`lmforge tasks --labelled`), for
the classification demo and tests, offline and deterministic like the instruction tasks.

A review names a thing, says how it was with an opinion word whose polarity is the label, and may add a
clause that carries no polarity of its own:

    {"sentence": "the soup at the corner place was really awful, to be honest", "label": "negative"}

About a tenth of the reviews turn the opinion with "not" ("was not great": negative), so the label is
more than a lookup of one word. The same seed writes the same records; validation records are never
training records (their sentences are disjoint).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

LABELS = ("negative", "positive")
_POSITIVE = ("great", "wonderful", "excellent", "lovely", "delightful", "superb", "pleasant", "fantastic",
             "brilliant", "charming", "fine", "solid")
_NEGATIVE = ("awful", "terrible", "dreadful", "boring", "disappointing", "poor", "bland", "horrible",
             "mediocre", "annoying", "weak", "dull")
_THINGS = ("the soup", "the film", "the hotel room", "the concert", "the book", "the service", "the coffee",
           "the new phone", "the train ride", "the museum tour", "the pasta", "the game", "the lecture",
           "the show", "the bakery's bread", "the album")
_PLACES = ("", " at the corner place", " last night", " this week", " downtown", " on the weekend",
           " we tried", " everyone talked about")
_VERBS = ("was", "felt", "seemed", "turned out", "is")
_ADVERBS = ("", "really ", "quite ", "truly ", "rather ", "very ", "pretty ")
_TAILS = ("", ", to be honest", " overall", ", I think", " in my opinion", ", as expected", " again",
          ", said my friend")


def review(rng: random.Random) -> dict[str, str]:
    """One record {sentence, label} drawn from `rng`."""
    label = rng.randrange(2)
    negated = rng.random() < 0.1
    words = _POSITIVE if label != negated else _NEGATIVE  # "not <negative word>" reads as positive
    verb = rng.choice(_VERBS)
    opinion = ("not " if negated else rng.choice(_ADVERBS)) + rng.choice(words)
    text = f"{rng.choice(_THINGS)}{rng.choice(_PLACES)} {verb} {opinion}{rng.choice(_TAILS)}"
    return {"sentence": text, "label": LABELS[label]}


def labelled_split(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, validation) records: validation first from the seeded stream, training records skip any
    sentence validation has (so fewer than n_train only if the grammar ran out)."""
    stream = _stream(seed)
    val, seen = [], set()
    for r in stream:
        if len(val) >= n_val:
            break
        if r["sentence"] not in seen:
            seen.add(r["sentence"])
            val.append(r)
    train = []
    for _ in range(50 * max(n_train, 1)):
        if len(train) >= n_train:
            break
        r = next(stream)
        if r["sentence"] not in seen:
            train.append(r)
    return train, val


def _stream(seed: int) -> Iterator[dict[str, str]]:
    rng = random.Random(f"lmforge-labelled:{seed}")
    while True:
        yield review(rng)
