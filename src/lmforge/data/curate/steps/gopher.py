"""`gopher_quality`: the Gopher quality rules (Rae et al., 2021, appendix A.1.1).

A document is dropped, with the first failing rule as its reason, if it has
  too few / too many words                      gopher:too_few_words, gopher:too_many_words
  a mean word length outside the bounds         gopher:mean_word_length
  more '#' or ellipses ('...', '…') per word    gopher:symbol_ratio
  too many lines starting with a bullet         gopher:bullet_lines
  too many lines ending in an ellipsis          gopher:ellipsis_lines
  too few words with an alphabetic character    gopher:alpha_words
  too few stop words (the, be, to, of, ...)     gopher:stop_words

Words are whitespace-separated tokens with punctuation trimmed from their edges; tokens of punctuation
alone are not words (close to the NLTK tokenisation of the reference implementations, without NLTK).
Line rules count non-blank lines only, so paragraph spacing does not dilute them.
"""

from __future__ import annotations

import re
from collections import Counter

from lmforge.config.curate import GopherQualityStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep
from lmforge.data.curate.text import GOPHER_STOP_WORDS, count_alpha_words, nonblank_lines, split_words

_BULLET_RE = re.compile(r"^[ \t]*(?:[•‣◦▪●∙○■□➢➤►–]|[-*+](?=\s|$))", re.MULTILINE)
_ELLIPSIS_END_RE = re.compile(r"(?:\.\.\.|…)[ \t]*$", re.MULTILINE)


def gopher_metrics(text: str) -> dict[str, float]:
    """The raw Gopher quality metrics of `text`."""
    words = split_words(text.lower())
    n_words = len(words)
    denom = max(n_words, 1)
    n_lines = max(len(nonblank_lines(text)), 1)
    counts = Counter(words)
    ellipses = text.count("...") + text.count("…")
    return {
        "n_words": n_words,
        "mean_word_length": sum(map(len, words)) / denom,
        "symbol_ratio": max(text.count("#"), ellipses) / denom,
        "bullet_ratio": len(_BULLET_RE.findall(text)) / n_lines,
        "ellipsis_ratio": len(_ELLIPSIS_END_RE.findall(text)) / n_lines,
        "alpha_ratio": count_alpha_words(words) / denom,
        "stop_words": sum(counts[w] for w in GOPHER_STOP_WORDS),
    }


class Step(MapStep):
    """Drop documents that fail a Gopher quality rule; `score` gives the raw metrics."""

    name = "gopher_quality"

    cfg: GopherQualityStep

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        reason = self.check(gopher_metrics(doc.text))
        return (None, reason) if reason else (doc, None)

    def check(self, m: dict[str, float]) -> str | None:
        """The reason the metrics `m` fail a rule, or None if they pass."""
        cfg = self.cfg
        if m["n_words"] < cfg.min_words:
            return "gopher:too_few_words"
        if m["n_words"] > cfg.max_words:
            return "gopher:too_many_words"
        if not cfg.min_mean_word_length <= m["mean_word_length"] <= cfg.max_mean_word_length:
            return "gopher:mean_word_length"
        if m["symbol_ratio"] > cfg.max_symbol_word_ratio:
            return "gopher:symbol_ratio"
        if m["bullet_ratio"] > cfg.max_bullet_lines_ratio:
            return "gopher:bullet_lines"
        if m["ellipsis_ratio"] > cfg.max_ellipsis_lines_ratio:
            return "gopher:ellipsis_lines"
        if m["alpha_ratio"] < cfg.min_alpha_words_ratio:
            return "gopher:alpha_words"
        if m["stop_words"] < cfg.min_stop_words:
            return "gopher:stop_words"
        return None

    def score(self, doc: Doc) -> dict[str, float]:
        return gopher_metrics(doc.text)
