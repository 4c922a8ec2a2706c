"""The one entry point for a regular expression that comes from a file or a config (task files' filters and
`regex_replace`, exact_match's `regexes_to_ignore`, PEFT's `target_modules`): `compile_regex(pattern, where)`.

Python's `re` backtracks without limit, so a pattern such as `(x+x+)+y` takes exponential time on a line of
x's and cannot be interrupted. The patterns here run on the `regex` package instead, whose matching takes a
`timeout`: past TIMEOUT_S a match is stopped and the user told which pattern, from where, was too slow.
Why `regex` and not a linear-time engine (google-re2): task files are written for lm-evaluation-harness,
which uses Python's `re`; RE2 refuses backreferences and lookaround that such patterns may use, while
`regex` reads every `re` pattern the same way (its default VERSION0 is `re`-compatible).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import regex

from lmforge.errors import LmforgeError

TIMEOUT_S = 1.0  # per match / search / substitution: ordinary patterns take microseconds on model output
MAX_PATTERN_CHARS = 10_000


class SafePattern:
    """A compiled pattern whose every call runs under the time budget; the `re.Pattern` methods lmforge
    uses, raising `error` (naming `where`) instead of running on."""

    def __init__(self, pattern: str, where: str, error: type[LmforgeError]) -> None:
        self.pattern, self.where, self.error = pattern, where, error
        try:
            self._re = regex.compile(pattern)
        except (regex.error, ValueError, OverflowError, RecursionError) as e:
            raise error(f"{where}: the regex {_short(pattern)} does not compile: {e}") from None

    def _run(self, fn, text: str, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, text, timeout=TIMEOUT_S, **kw) if args else fn(text, timeout=TIMEOUT_S, **kw)
        except TimeoutError:
            raise self.error(
                f"{self.where}: the regex {_short(self.pattern)} ran past its {TIMEOUT_S:g} s budget on a "
                f"{len(text):,}-character text (catastrophic backtracking, e.g. nested repeats like (a+)+); "
                "simplify the pattern"
            ) from None

    def search(self, text: str):
        return self._run(self._re.search, text)

    def fullmatch(self, text: str):
        return self._run(self._re.fullmatch, text)

    def findall(self, text: str) -> list:
        return self._run(self._re.findall, text)

    def sub(self, repl: str, text: str, count: int = 0) -> str:
        return self._run(self._re.sub, text, repl, count=count)


def _short(pattern: str) -> str:
    return repr(pattern) if len(pattern) <= 80 else repr(pattern[:77] + "...")


def compile_regex(pattern: Any, where: str, error: type[LmforgeError] = LmforgeError) -> SafePattern:
    """`pattern` compiled for use under the time budget; `where` names its origin in errors (a task file
    and key), `error` is the LmforgeError subclass raised."""
    if not isinstance(pattern, str):
        raise error(f"{where}: a regex must be a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise error(f"{where}: a {len(pattern):,}-character regex; at most {MAX_PATTERN_CHARS:,} are read")
    return _compile(pattern, where, error)


@lru_cache(maxsize=512)
def _compile(pattern: str, where: str, error: type[LmforgeError]) -> SafePattern:
    return SafePattern(pattern, where, error)
