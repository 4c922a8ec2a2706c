"""Text helpers shared by the curation filters: words, lines, paragraphs, n-grams, stop words.

Everything here is regex or `str` methods so that filters stay fast on large corpora: a per-word
Python loop over a 50 MB corpus costs seconds, a `re.findall` a fraction of that.
"""

from __future__ import annotations

import re
import string

# Characters that are trimmed from word edges and never form a word on their own: ASCII punctuation
# plus the common Unicode quotes, dashes, bullets and CJK punctuation.
PUNCTUATION = string.punctuation + "“”‘’«»‹›„‚–—―…·•‣◦▪●∙′″¿¡§¶†‡、。，．！？：；（）《》「」『』【】〔〕"
_P = re.escape(PUNCTUATION)

# A word is a run of non-space characters that starts and ends with a non-punctuation character;
# punctuation inside is kept ("don't", "e.g", "3.14"), at the edges it is dropped ("(word)," -> "word"),
# and a token of punctuation alone ("-", "...", "#") is not a word. The classes are disjoint, so the
# pattern cannot backtrack catastrophically.
WORD_RE = re.compile(rf"[^\s{_P}]+(?:[{_P}]+[^\s{_P}]+)*")
# A space-separated token that contains a letter (applied to words joined by spaces); anchored at
# token starts so that a long token without letters costs one attempt, not one per character.
_ALPHA_TOKEN_RE = re.compile(r"(?<!\S)\S*[^\W\d_]\S*")
_PARAGRAPH_SPLIT_RE = re.compile(r"\n[ \t]*\n\s*")

# The stop words of the Gopher quality rule (Rae et al., 2021, appendix A).
GOPHER_STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})


def split_words(text: str) -> list[str]:
    """The words of `text` (see WORD_RE), in order, case preserved."""
    return WORD_RE.findall(text)


def count_alpha_words(words: list[str]) -> int:
    """How many of `words` contain at least one alphabetic character."""
    return len(_ALPHA_TOKEN_RE.findall(" ".join(words)))


def nonblank_lines(text: str) -> list[str]:
    """The lines of `text` (split on newline) that contain something other than whitespace."""
    return [line for line in text.split("\n") if line and not line.isspace()]


def paragraphs(text: str) -> list[str]:
    """The paragraphs of `text`: blocks separated by one or more blank lines, stripped, non-empty."""
    return [p for p in _PARAGRAPH_SPLIT_RE.split(text.strip()) if p]


def ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    """All word n-grams of `words`, overlapping, in order (empty when there are fewer than n words)."""
    return list(zip(*(words[i:] for i in range(n))))


def ngram_chars(gram: tuple[str, ...]) -> int:
    """Characters of an n-gram written with single spaces between its words."""
    return sum(map(len, gram)) + len(gram) - 1
