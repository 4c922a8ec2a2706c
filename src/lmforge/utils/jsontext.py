"""JSON from users (data files, request bodies) as plain data, or one clear reason why not.

`json.loads` accepts two things the rest of the system cannot take: nesting deep enough to exhaust
Python's recursion (a RecursionError, not a JSONDecodeError) and escapes of lone surrogates
(`"\\ud800"`), which decode to a str that is not Unicode text: every encoder (tokenizers, UTF-8 output)
refuses it later, far from the input. `loads` turns both into a ValueError saying where.
"""

from __future__ import annotations

import json
import re
from typing import Any

BOM = "\ufeff"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BadJSON(ValueError):
    """Text that is not JSON plain data: `why` says what is wrong (a caller adds where); `path` is the
    value's (`messages.0.content`) when the JSON is well formed but holds a lone surrogate."""

    def __init__(self, why: str, path: str | None = None) -> None:
        super().__init__(why)
        self.why, self.path = why, path


def loads(text: str | bytes) -> Any:
    """json.loads, with BadJSON for malformed text, nesting too deep to read, and lone surrogates."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadJSON(f"malformed JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise BadJSON(f"not valid UTF-8 (at byte {e.start})") from None
    except RecursionError:
        raise BadJSON("JSON nested too deeply to read (arrays or objects inside one another thousands of "
                      "levels deep)") from None
    if isinstance(text, bytes):
        escaped = _SURROGATE_ESCAPE.search(text.decode("ascii", "replace"))
    else:
        escaped = _SURROGATE_ESCAPE.search(text)
    if escaped is not None:  # only then can a lone surrogate be in there (a valid pair is one character)
        where = lone_surrogate(obj)
        if where is not None:
            raise BadJSON(f"{where or 'the value'} holds a lone surrogate escape (\\ud800-\\udfff without "
                          "its pair), which is not valid Unicode text", path=where)
    return obj


def lone_surrogate(obj: Any) -> str | None:
    """The path (`messages.0.content`; "" for `obj` itself) of the first string, key or value, holding a
    lone surrogate; None when there is none. Iterative: the nesting may be as deep as json allows."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path
        elif isinstance(value, dict):
            for k, v in reversed(value.items()):
                sub = f"{path}.{_printable(k)}" if path else _printable(k)
                if not _is_text(k):
                    return sub
                stack.append((sub, v))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in reversed(list(enumerate(value))))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")  # at C speed: a 20 MB string is checked in milliseconds
    except UnicodeEncodeError:
        return False
    return True


def _printable(key: str) -> str:
    """A key as it can be printed in a message (its lone surrogates escaped)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")
