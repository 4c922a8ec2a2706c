"""Name mapping between lmforge's parameter names and Hugging Face's, and the error for config.json
settings lmforge cannot reproduce. The family modules (llama.py, gpt2.py) build on these; convert.py
dispatches to the families."""

from __future__ import annotations

import re
from typing import Any

from lmforge.errors import LmforgeError


class KeyMap:
    """A two-way rename table between our parameter names and HF's.

    Entries are (ours, HF) templates where `{i}` stands for a layer index and `{p}` for weight|bias.
    """

    _FIELDS = {"i": r"(?P<i>\d+)", "p": r"(?P<p>weight|bias)"}

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = list(pairs)
        self._pairs = [(self._compile(a), b, self._compile(b), a) for a, b in pairs]

    def extended(self, pairs: list[tuple[str, str]]) -> KeyMap:
        """This table plus `pairs` (a family that adds tensors to another's layout)."""
        return KeyMap([*self.pairs, *pairs])

    @classmethod
    def _compile(cls, template: str) -> re.Pattern:
        pattern = re.escape(template).replace(r"\{", "{").replace(r"\}", "}")
        return re.compile(pattern.format(**cls._FIELDS))

    def to_hf(self, ours: str) -> str | None:
        for ours_re, hf_tpl, _, _ in self._pairs:
            if m := ours_re.fullmatch(ours):
                return hf_tpl.format(**m.groupdict())
        return None

    def to_ours(self, hf: str) -> str | None:
        for _, _, hf_re, ours_tpl in self._pairs:
            if m := hf_re.fullmatch(hf):
                return ours_tpl.format(**m.groupdict())
        return None


def unsupported(key: str, value: Any, valid: str) -> None:
    """Raise the error for a config.json value lmforge cannot reproduce exactly."""
    raise LmforgeError(
        f"unsupported Hugging Face config: {key}={value!r}; lmforge supports {valid}. "
        "Loading it anyway would build a different model."
    )
