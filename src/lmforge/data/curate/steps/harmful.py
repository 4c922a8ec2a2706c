"""`harmful`: drop documents that contain block-listed words or phrases.

Entries come from `blocklist` and from `blocklist_files` (UTF-8, one entry per line; blank lines and
lines starting with '#' are ignored). Matching is case-insensitive and on word boundaries: "bad" does
not match "badge" or "bad_word", and any run of whitespace in the text matches the single space of a
phrase ("bad word" matches "Bad\\n  word"). A document is dropped (reason "harmful:blocklist") when it
has more than `max_hits` matches, or, if `max_hit_ratio` is set, more matches per word than that.

Speed: entries that are plain words (letters, digits, underscore) are looked up in a set against the
document's word counts, so a list of thousands of words costs one tokenisation; only phrases and
entries with other characters ("f*ck", "x-rated") go into one compiled regex.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from lmforge.config.curate import HarmfulStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep

_WORD_RE = re.compile(r"\w+")


def load_blocklist(cfg: HarmfulStep) -> list[str]:
    """The configured entries, lower-cased with whitespace collapsed, de-duplicated, in order."""
    raw = list(cfg.blocklist)
    for name in cfg.blocklist_files:
        path = Path(name)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(
                f"curate.steps[harmful].blocklist_files: cannot read {str(path)!r} ({e}); "
                "expected a UTF-8 text file with one word or phrase per line"
            ) from e
        raw.extend(line for line in lines if not line.lstrip().startswith("#"))
    entries = (" ".join(e.lower().split()) for e in raw)
    return list(dict.fromkeys(e for e in entries if e))


class Step(MapStep):
    """Count block-list matches and drop documents above the configured limits."""

    name = "harmful"
    cfg: HarmfulStep

    def __init__(self, cfg: HarmfulStep) -> None:
        super().__init__(cfg)
        entries = load_blocklist(cfg)
        self._words = frozenset(e for e in entries if _WORD_RE.fullmatch(e))
        phrases = sorted((e for e in entries if e not in self._words), key=len, reverse=True)
        self._phrase_re = None
        if phrases:
            alternatives = "|".join(r"\s+".join(map(re.escape, p.split(" "))) for p in phrases)
            # (?<!\w) / (?!\w) rather than \b: entries may begin or end with a non-word character.
            self._phrase_re = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)
        self._matches = 0
        self._docs_matched = 0

    def hits(self, text: str, need_words: bool = True) -> tuple[int, int]:
        """(block-list matches in `text`, words in `text`; 0 words if not `need_words` and the
        single-word list is empty, which spares the tokenisation)."""
        words = _WORD_RE.findall(text.lower()) if self._words or need_words else []
        n = 0
        if self._words:
            counts = Counter(words)
            n += sum(counts[w] for w in counts.keys() & self._words)
        if self._phrase_re is not None:
            n += sum(1 for _ in self._phrase_re.finditer(text))
        return n, len(words)

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        if not self._words and self._phrase_re is None:
            return doc, None
        n, n_words = self.hits(doc.text, need_words=self.cfg.max_hit_ratio is not None)
        if n:
            self._matches += n
            self._docs_matched += 1
        cfg = self.cfg
        if n > cfg.max_hits or (cfg.max_hit_ratio is not None and n / max(n_words, 1) > cfg.max_hit_ratio):
            return None, "harmful:blocklist"
        return doc, None

    def score(self, doc: Doc) -> dict[str, float]:
        n, n_words = self.hits(doc.text)
        return {"blocklist_hits": n, "blocklist_hit_ratio": n / max(n_words, 1)}

    def take_counts(self) -> dict[str, int]:
        counts = {"matches": self._matches, "docs_with_matches": self._docs_matched}
        self._matches = self._docs_matched = 0
        return {k: v for k, v in counts.items() if v}
