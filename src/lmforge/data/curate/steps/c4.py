"""`c4_quality`: the C4 page rules (Raffel et al., 2020) and FineWeb's terminal-punctuation line ratio.

  - a page containing "lorem ipsum" is dropped                          c4:lorem_ipsum
  - boilerplate lines (javascript, cookie notices, terms of use, privacy policy) are counted; if more
    than `max_boilerplate_lines_ratio` of the non-blank lines are boilerplate the page is dropped,
    otherwise they are removed when `drop_boilerplate_lines`                c4:boilerplate
  - if fewer than `min_terminal_punct_lines_ratio` of the remaining non-blank lines end in terminal
    punctuation (. ! ? and closing quotes) the page is dropped             c4:terminal_punct

C4 itself keeps only the lines ending in terminal punctuation; dropping whole pages whose ratio is
low (FineWeb's `line_punct_ratio`) keeps code, lists and tables inside otherwise good pages intact.
Bare "cookie" is not boilerplate (recipes): only cookie-notice phrases are, as in C4's own code.
"""

from __future__ import annotations

import re
from dataclasses import replace

from lmforge.config.curate import C4QualityStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep

_LOREM_RE = re.compile(r"lorem\s+ipsum", re.IGNORECASE)
_BOILERPLATE_RE = re.compile(
    r"javascript|terms\s+of\s+use|privacy\s+policy|cookie\s+policy|use\s+of\s+cookies|uses?\s+cookies"
    r"|accept\s+(?:all\s+)?cookies|cookie\s+settings",
    re.IGNORECASE,
)
TERMINAL_PUNCTUATION = (".", "!", "?", '"', "'", "”", "’", "»", "。", "！", "？", "．")


def _split(text: str, drop_lines: bool) -> tuple[float, float, list[str] | None]:
    """(boilerplate ratio, terminal punctuation ratio of the lines kept, the kept lines or None if
    no line is removed)."""
    lines = text.split("\n")
    kept: list[str] = []
    n_content = n_boiler = n_punct = n_kept_content = 0
    for line in lines:
        stripped = line.rstrip()
        if not stripped:
            kept.append(line)
            continue
        n_content += 1
        if _BOILERPLATE_RE.search(stripped):
            n_boiler += 1
            if drop_lines:
                continue
        kept.append(line)
        n_kept_content += 1
        n_punct += stripped.endswith(TERMINAL_PUNCTUATION)
    boiler_ratio = n_boiler / n_content if n_content else 0.0
    punct_ratio = n_punct / n_kept_content if n_kept_content else 0.0
    return boiler_ratio, punct_ratio, (kept if drop_lines and n_boiler else None)


class Step(MapStep):
    """C4 page rules: lorem ipsum, boilerplate lines, terminal punctuation ratio."""

    name = "c4_quality"
    cfg: C4QualityStep

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        cfg = self.cfg
        text = doc.text
        if cfg.drop_lorem_ipsum and _LOREM_RE.search(text):
            return None, "c4:lorem_ipsum"
        boiler_ratio, punct_ratio, kept = _split(text, cfg.drop_boilerplate_lines)
        if boiler_ratio > cfg.max_boilerplate_lines_ratio:
            return None, "c4:boilerplate"
        if punct_ratio < cfg.min_terminal_punct_lines_ratio:
            return None, "c4:terminal_punct"
        if kept is None:
            return doc, None
        new_text = "\n".join(kept).strip("\n")
        if not new_text.strip():
            return None, "c4:boilerplate"
        return replace(doc, text=new_text), None

    def score(self, doc: Doc) -> dict[str, float]:
        boiler_ratio, punct_ratio, _ = _split(doc.text, self.cfg.drop_boilerplate_lines)
        return {"terminal_punct_ratio": punct_ratio, "boilerplate_ratio": boiler_ratio}
