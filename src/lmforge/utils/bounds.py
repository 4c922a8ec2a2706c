"""The one check for a number that comes from outside (a CLI flag, a task file, a request, a grid): of the
right kind, finite, and inside a range, before any work depends on it. The message names the key and the
range, so a user sees what would be right: "repeats must be a whole number from 1 to 1,000, got 10**9".

Counts that set how much work or memory follows (repeats, grid points, batch sizes, shard sizes) get an
upper bound as well as a lower one: a number is cheap to type and a billion of anything is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmforge.errors import LmforgeError


def _show(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    return f"{x:g}"


@dataclass(frozen=True)
class Bound:
    """A range of numbers: whole numbers only (`integer`), or finite reals; `lo`/`hi` None: unbounded on
    that side (still finite); `lo_open`/`hi_open`: the end itself excluded."""

    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False

    def describe(self) -> str:
        """The range in words: "a whole number from 1 to 1,000", "a positive number <= 600"."""
        lo, hi = self.lo, self.hi
        positive = lo == 0 and self.lo_open and not self.integer
        kind = "a whole number" if self.integer else "a positive number" if positive else "a number"
        finite = "" if self.integer else " (finite)"
        top = "" if hi is None else f" {'<' if self.hi_open else '<='} {_show(hi)}"
        if positive:
            return kind + (top or finite)
        if lo is not None and hi is not None:
            if self.integer:
                return f"{kind} from {_show(lo)} to {_show(hi)}"
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"{kind} in {left}{_show(lo)}, {_show(hi)}{right}"
        if lo is not None:
            return f"{kind} {'>' if self.lo_open else '>='} {_show(lo)}{finite}"
        return kind + (top or finite)

    def problem(self, value: Any) -> str | None:
        """Why `value` is not in this range (None: it is)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"got {type(value).__name__} {_clip(value)}"
        if self.integer and not isinstance(value, int):
            return f"got {value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"got {value!r}"
        lo, hi = self.lo, self.hi
        below = lo is not None and (value <= lo if self.lo_open else value < lo)
        above = hi is not None and (value >= hi if self.hi_open else value > hi)
        if below or above:
            return f"got {_clip(value)}"
        return None

    def check(self, value: Any, key: str, error: type[LmforgeError] = LmforgeError) -> Any:
        """`value` when it is in range; else `error` naming `key` and the range."""
        why = self.problem(value)
        if why is not None:
            raise error(f"{key} must be {self.describe()}, {why}")
        return value


def _clip(value: Any) -> str:
    text = repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and len(text) > 24:
        return f"a {len(text)}-digit number"
    return text if len(text) <= 60 else text[:57] + "..."


def whole(lo: int | None = None, hi: int | None = None) -> Bound:
    return Bound(lo, hi, integer=True)


def real(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
         hi_open: bool = False) -> Bound:
    return Bound(lo, hi, lo_open=lo_open, hi_open=hi_open)


# Seeds: numpy's generators take at most 2**32 - 1; torch and random any 64-bit value. One range for all.
SEED = whole(0, 2**32 - 1)
PORT = whole(0, 65535)  # TCP's port field is 16 bits; 0: the system picks a free port
THREADS = whole(1, 1024)  # CPU threads of one process
