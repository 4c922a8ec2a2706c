"""`repetition`: the Gopher repetition rules (Rae et al., 2021, table A1).

Fractions, each compared with its `max_*` threshold (reason in brackets):
  dup_para_frac        duplicated paragraphs / paragraphs                  [repetition:dup_paras]
  dup_para_char_frac   characters in duplicated paragraphs / characters    [repetition:dup_para_chars]
  dup_line_frac        duplicated lines / lines                            [repetition:dup_lines]
  dup_line_char_frac   characters in duplicated lines / characters         [repetition:dup_line_chars]
  top_{n}gram_char_frac   characters in all occurrences of the most frequent word n-gram / characters
                                                                           [repetition:top_{n}gram]
  dup_{n}gram_char_frac   characters in word n-grams that already occurred, overlapping occurrences
                          counted once / characters                        [repetition:dup_{n}gram]

A "duplicated" line or paragraph is every occurrence after the first. Lines are non-blank lines,
paragraphs are separated by blank lines, characters are those of the whole document; n-gram characters
count the words plus one space between them (words: see `text.split_words`, case kept). The most
frequent n-gram is the longest of those tied for the top count. The duplicated n-gram walk follows
the reference (datatrove's `find_all_duplicate`): scanning left to right, an n-gram seen before adds
its characters and the scan jumps past it, so no word is counted twice. Checks run cheapest first and
`apply` stops at the first failure; `score` computes every fraction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import accumulate
from operator import sub

from lmforge.config.curate import RepetitionStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep
from lmforge.data.curate.text import ngram_chars, nonblank_lines, paragraphs, split_words


def duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items equal to an earlier item, their total characters)."""
    counts = Counter(items)
    n = chars = 0
    for item, c in counts.items():
        if c > 1:
            n += c - 1
            chars += (c - 1) * len(item)
    return n, chars


def _repeats(
    words: list[str], n: int, positions: list[int] | None
) -> tuple[list[int], list[tuple[str, ...]], Counter]:
    """The start positions (ascending) and the n-grams of `words` that occur more than once, and their
    counts. With `positions`, only n-grams starting there are considered: an n-gram can repeat only
    where the shorter n-gram at the same position repeats, so the repeats of a smaller n suffice and
    only the first n pays for hashing every n-gram of the document."""
    if positions is None:
        grams = list(zip(*(words[i:] for i in range(n))))
        starts: range | list[int] = range(len(grams))
    else:
        last = len(words) - n
        starts = [i for i in positions if i <= last]
        grams = [tuple(words[i:i + n]) for i in starts]
    counts = Counter(grams)
    if len(counts) == len(grams):
        return [], [], Counter()
    repeated = Counter({g: c for g, c in counts.items() if c > 1})
    pairs = [(i, g) for i, g in zip(starts, grams) if g in repeated]
    return [i for i, _ in pairs], [g for _, g in pairs], repeated


def _dup_chars(positions: list[int], grams: list[tuple[str, ...]], n: int) -> int:
    """The reference left-to-right scan, over the repeated n-grams only: the others would just be
    remembered and never met again, so the result equals the scan over all n-grams."""
    seen: set[tuple[str, ...]] = set()
    chars = 0
    resume = 0  # positions below this lie inside the last repeat counted and are skipped
    for i, g in zip(positions, grams):
        if i < resume:
            continue
        if g in seen:
            chars += ngram_chars(g)
            resume = i + n
        else:
            seen.add(g)
    return chars


def ngram_repetition(words: list[str], ns: list[int]) -> Iterator[tuple[int, int, int]]:
    """Yield, for each n in `ns` ascending: (n, characters of all occurrences of the most frequent
    n-gram, characters of n-grams repeating an earlier one with no word counted twice). The most
    frequent n-gram is the longest of those tied for the top count (without repeats: the longest)."""
    prefix = list(accumulate(map(len, words), initial=0))
    positions: list[int] | None = None
    for n in sorted(ns):
        if len(words) < n:
            yield n, 0, 0
            continue
        positions, grams, repeated = _repeats(words, n, positions)
        if repeated:
            top = max(repeated.values())
            top_chars = top * max(ngram_chars(g) for g, c in repeated.items() if c == top)
        else:  # every n-gram occurs once: the longest window of n words
            top_chars = max(map(sub, prefix[n:], prefix[:-n])) + n - 1
        yield n, top_chars, _dup_chars(positions, grams, n)


class Step(MapStep):
    """Drop documents with too much repeated content (lines, paragraphs, word n-grams)."""

    name = "repetition"
    cfg: RepetitionStep

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        for _, reason, value, limit in self._checks(doc.text):
            if value > limit:
                return None, reason
        return doc, None

    def score(self, doc: Doc) -> dict[str, float]:
        return {metric: value for metric, _, value, _ in self._checks(doc.text)}

    def _checks(self, text: str):
        """Yield (metric, reason, fraction, threshold) lazily, cheapest first, so `apply` can stop at
        the first failure."""
        cfg = self.cfg
        n_chars = max(len(text), 1)
        paras = paragraphs(text)
        n_dup, dup_chars = duplicates(paras)
        yield "dup_para_frac", "repetition:dup_paras", n_dup / max(len(paras), 1), cfg.max_dup_para_frac
        yield ("dup_para_char_frac", "repetition:dup_para_chars", dup_chars / n_chars,
               cfg.max_dup_para_char_frac)
        lines = nonblank_lines(text)
        n_dup, dup_chars = duplicates(lines)
        yield "dup_line_frac", "repetition:dup_lines", n_dup / max(len(lines), 1), cfg.max_dup_line_frac
        yield ("dup_line_char_frac", "repetition:dup_line_chars", dup_chars / n_chars,
               cfg.max_dup_line_char_frac)
        words = split_words(text)
        top_limits, dup_limits = cfg.max_top_ngram_char_frac, cfg.max_dup_ngram_char_frac
        for n, top_chars, dup_chars in ngram_repetition(words, sorted({*top_limits, *dup_limits})):
            if n in top_limits:
                yield f"top_{n}gram_char_frac", f"repetition:top_{n}gram", top_chars / n_chars, top_limits[n]
            if n in dup_limits:
                yield f"dup_{n}gram_char_frac", f"repetition:dup_{n}gram", dup_chars / n_chars, dup_limits[n]
