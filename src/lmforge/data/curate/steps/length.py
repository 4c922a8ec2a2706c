"""`length`: drop documents outside character and line bounds.

Reasons: "length:too_short" (fewer than `min_chars` characters), "length:too_long" (more than
`max_chars`), "length:too_few_lines" (fewer than `min_lines` non-blank lines).
"""

from __future__ import annotations

import re

from lmforge.config.curate import LengthStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep

_CONTENT_LINE_RE = re.compile(r"^[^\S\n]*\S", re.MULTILINE)


def count_lines(text: str) -> int:
    """Non-blank lines of `text`."""
    return len(_CONTENT_LINE_RE.findall(text))


class Step(MapStep):
    """Character and line bounds."""

    name = "length"
    cfg: LengthStep

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        cfg = self.cfg
        n = len(doc.text)
        if n < cfg.min_chars:
            return None, "length:too_short"
        if cfg.max_chars is not None and n > cfg.max_chars:
            return None, "length:too_long"
        if cfg.min_lines and count_lines(doc.text) < cfg.min_lines:
            return None, "length:too_few_lines"
        return doc, None

    def score(self, doc: Doc) -> dict[str, float]:
        return {"chars": len(doc.text), "lines": count_lines(doc.text)}
