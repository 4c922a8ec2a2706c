"""`normalize`: repair and canonicalise text without changing what it says.

In order: mojibake repair (ftfy), Unicode NFC, removal of control characters, whitespace clean-up.
The step never drops a document except one that is (or becomes) empty: reason "empty".
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import replace

from lmforge.config.curate import NormalizeStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep

# C0 controls except tab, newline and carriage return (line endings are the whitespace pass's job),
# DEL, C1 controls, and the byte-order mark / zero-width no-break space.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufeff]")
# No-break and fixed-width spaces become plain spaces; the ideographic space (U+3000) is left alone
# because it is ordinary in CJK text.
_SPACES_RE = re.compile(r"[\xa0\u2000-\u200a\u202f\u205f]")
# The look-behind makes each run of blanks start one match attempt, not one per blank (no O(n^2)).
_TRAILING_WS_RE = re.compile(r"(?<![ \t])[ \t]+$", re.MULTILINE)
_BLANK_RUN_RE = re.compile(r"\n{4,}")  # more than two blank lines
_LEADING_BLANK_RE = re.compile(r"\A(?:[ \t]*\n)+")
# Lines with a non-ASCII character or an escape (ESC, 0x1b): the only lines ftfy could change.
_FTFY_LINE_RE = re.compile(r"^[^\n]*[^\x00-\x1a\x1c-\x7f][^\n]*", re.MULTILINE)
# What the enabled ftfy fixes act on besides mojibake (which its `is_bad` detects): terminal escapes,
# C1 controls, ligatures, lone surrogates.
_FTFY_CHARS_RE = re.compile(r"[\x1b\x80-\x9f\ufb00-\ufb06\ud800-\udfff]")


class MojibakeFixer:
    """text -> text with ftfy's encoding repairs, using options that leave well-formed text as it is."""

    def __init__(self) -> None:
        try:
            import ftfy
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the normalize step's fix_mojibake needs ftfy: `pip install ftfy` "
                "(or set fix_mojibake: false in the normalize step)"
            ) from e
        self.config = ftfy.TextFixerConfig(
            fix_encoding=True,  # the point: "cafÃ©" -> "café"
            restore_byte_a0=True,
            replace_lossy_sequences=True,
            decode_inconsistent_utf8=True,
            fix_c1_controls=True,  # C1 controls in text are always mis-decoded Windows-1252
            fix_surrogates=True,
            remove_terminal_escapes=True,  # ANSI colour codes are never content
            # Ligatures (U+FB00..) are PDF-extraction artefacts, not content; splitting them back into
            # letters makes "ﬁle" the same word as "file" for every later step and the tokenizer.
            fix_latin_ligatures=True,
            # The rest would change legitimate text, or is done by our own passes (with counts).
            unescape_html=False,  # "&amp;" in code, HTML or docs about HTML is content
            uncurl_quotes=False,  # keep typographic quotes and apostrophes
            fix_character_width=False,  # full-width forms are normal in CJK text
            fix_line_breaks=False,  # whitespace pass
            remove_control_chars=False,  # strip_control pass
            normalization=None,  # nfc pass
            explain=False,
        )

    def _needed(self, text: str) -> bool:
        from ftfy.badness import is_bad

        return is_bad(text) or _FTFY_CHARS_RE.search(text) is not None

    def _fix_line(self, m: re.Match) -> str:
        import ftfy

        line = m.group()
        return ftfy.fix_text(line, self.config) if self._needed(line) else line

    def __call__(self, text: str) -> str:
        # ftfy fixes text line by line and, with these options, leaves a line alone unless it looks
        # like mojibake (`is_bad`) or holds one of _FTFY_CHARS; checking that first, and only on lines
        # with a non-ASCII character or ESC, gives the same result at a fraction of the cost.
        if text.isascii() and "\x1b" not in text:
            return text
        return _FTFY_LINE_RE.sub(self._fix_line, text)


class Step(MapStep):
    """Mojibake repair, NFC, control-character removal and whitespace clean-up.

    Whitespace: CRLF and lone CR become LF, no-break spaces become spaces, trailing whitespace is
    stripped from every line, runs of more than two blank lines shrink to two, and leading blank lines
    and trailing whitespace of the document go. Indentation and runs of spaces inside a line are kept
    (code and aligned tables depend on them).

    Counts (documents changed by each pass): mojibake_fixed, nfc, control_removed, whitespace.
    """

    name = "normalize"

    def __init__(self, cfg: NormalizeStep) -> None:
        super().__init__(cfg)
        self._counts: Counter = Counter()
        self._fix_mojibake = MojibakeFixer() if cfg.fix_mojibake else None

    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        text = doc.text
        cfg = self.cfg
        if self._fix_mojibake is not None:
            fixed = self._fix_mojibake(text)
            if fixed != text:
                self._counts["mojibake_fixed"] += 1
                text = fixed
        if cfg.nfc and not text.isascii() and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
            self._counts["nfc"] += 1
        if cfg.strip_control:
            text, n = _CONTROL_RE.subn("", text)
            if n:
                self._counts["control_removed"] += 1
        if cfg.whitespace:
            cleaned = _clean_whitespace(text)
            if cleaned != text:
                self._counts["whitespace"] += 1
                text = cleaned
        if not text.strip():
            return None, "empty"
        return (doc if text == doc.text else replace(doc, text=text)), None

    def take_counts(self) -> dict[str, int]:
        counts, self._counts = dict(self._counts), Counter()
        return counts


def _clean_whitespace(text: str) -> str:
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _SPACES_RE.sub(" ", text)
    text = _TRAILING_WS_RE.sub("", text)
    text = _BLANK_RUN_RE.sub("\n\n\n", text)
    return _LEADING_BLANK_RE.sub("", text).rstrip()
