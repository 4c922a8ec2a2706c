"""`harmful`: drop documents that contain block-listed words or phrases.

Entries come from the shipped `lists` (default: ldnoobw-en, the List of Dirty, Naughty, Obscene and
Otherwise Bad Words in English, CC BY 4.0, as C4's bad-words filter used it; files and licence in
lmforge/data/curate/blocklists/), from `blocklist` and from `blocklist_files` (UTF-8, one entry per line;
blank lines and lines starting with '#' are ignored). A step left with no entry is refused: it would run,
remove nothing and look like a clean corpus. `describe()` says which lists ran and how many entries each
gave; the run prints it and report.json / report.md keep it.

Matching is case-insensitive and on word boundaries: "bad" does not match "badge" or "bad_word", and any
run of whitespace in the text matches the single space of a phrase ("bad word" matches "Bad\\n  word").
A document is dropped (reason "harmful:blocklist") when it has more than `max_hits` matches, or, if
`max_hit_ratio` is set, more matches per word than that.

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
from lmforge.errors import ConfigError

_WORD_RE = re.compile(r"\w+")


SHIPPED = {"ldnoobw-en": Path(__file__).resolve().parents[1] / "blocklists" / "ldnoobw-en.txt"}


def _normalized(raw: list[str]) -> list[str]:
    entries = (" ".join(e.lower().split()) for e in raw)
    return list(dict.fromkeys(e for e in entries if e))


def _read_list(path: Path, what: str) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"curate.steps[harmful].{what}: cannot read {str(path)!r} ({e}); "
            "expected a UTF-8 text file with one word or phrase per line"
        ) from e
    return [line for line in lines if not line.lstrip().startswith("#")]


def blocklist_sources(cfg: HarmfulStep) -> dict[str, list[str]]:
    """Each source of entries (a shipped list by name, "blocklist", each file) and its entries."""
    out = {name: _normalized(_read_list(SHIPPED[name], "lists")) for name in cfg.lists}
    if cfg.blocklist:
        out["blocklist"] = _normalized(list(cfg.blocklist))
    for name in cfg.blocklist_files:
        out[name] = _normalized(_read_list(Path(name), "blocklist_files"))
    return out


def load_blocklist(cfg: HarmfulStep) -> list[str]:
    """The configured entries, lower-cased with whitespace collapsed, de-duplicated, in order."""
    return _normalized([e for entries in blocklist_sources(cfg).values() for e in entries])


class Step(MapStep):
    """Count block-list matches and drop documents above the configured limits."""

    name = "harmful"
    cfg: HarmfulStep

    def __init__(self, cfg: HarmfulStep) -> None:
        super().__init__(cfg)
        self._sources = blocklist_sources(cfg)
        entries = _normalized([e for es in self._sources.values() for e in es])
        if not entries:
            raise ConfigError(
                "curate.steps[harmful]: the block list is empty (lists: [], and blocklist / blocklist_files "
                "give no entry), so the step would remove nothing; keep the shipped list (lists: "
                "[ldnoobw-en], the default) or give your own entries"
            )
        self._n_entries = len(entries)
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

    def describe(self) -> dict:
        lists = {name: len(entries) for name, entries in self._sources.items()}
        parts = ", ".join(f"{name} ({n:,})" for name, n in lists.items())
        return {"summary": f"{self._n_entries:,} block-list entries from {parts}", "block_lists": lists,
                "entries": self._n_entries}

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
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
