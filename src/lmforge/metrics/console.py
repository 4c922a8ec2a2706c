"""The one place that prints during training: a live rich progress bar, plain lines, or silence.

Only the main rank speaks; other ranks get a Console whose methods do nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console as RichConsole
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


def _fmt(record: dict[str, Any]) -> str:
    parts = []
    for key, fmt in (("loss", "{:.4f}"), ("reward", "{:.3f}"), ("lr", "{:.2e}"), ("grad_norm", "{:.3f}"),
                     ("tokens_per_s", "{:,.0f}"), ("mfu", "{:.1%}"), ("peak_mem_mib", "{:,.0f}")):
        if key in record:
            label = {"tokens_per_s": "tok/s", "peak_mem_mib": "mem MiB", "grad_norm": "gnorm"}.get(key, key)
            parts.append(f"{label} {fmt.format(record[key])}")
    return "  ".join(parts)


def _compact(record: dict[str, Any]) -> str:
    """The bar's stats: short enough that bar, counts, times and stats fit an 80-column terminal."""
    parts = [f"loss {record['loss']:.3f}", f"lr {record['lr']:.0e}", f"gn {record['grad_norm']:.2f}"]
    tps = record.get("tokens_per_s", 0.0)
    parts.append(f"{tps / 1000:.0f}k tok/s" if tps >= 10_000 else f"{tps:,.0f} tok/s")
    if "mfu" in record:
        parts.append(f"mfu {record['mfu']:.0%}")
    return " ".join(parts)


class Console:
    """mode: 'bar' (live bar), 'plain' (a line per log step), 'none'; 'auto' = bar on a terminal."""

    def __init__(self, mode: str = "auto", enabled: bool = True) -> None:
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "none"
        self.enabled = enabled
        self.rich = RichConsole(highlight=False, soft_wrap=True)
        self.progress: Progress | None = None
        self._task = None

    def print(self, msg: str) -> None:
        if self.mode == "none":
            return
        if self.progress is not None:
            self.progress.console.print(msg, highlight=False)
        else:
            self.rich.print(msg, highlight=False)

    __call__ = print

    def warn(self, msg: str) -> None:
        """Something the user must see even with logging.progress=none (on the main rank, to stderr)."""
        if not self.enabled:
            return
        if self.mode == "none":
            print(f"lmforge: warning: {msg}", file=sys.stderr)
        else:
            self.print(f"[yellow]{msg}[/yellow]")

    def start(self, total: int, completed: int = 0) -> None:
        self._t0, self._first = time.perf_counter(), completed
        if self.mode != "bar":
            return
        self.progress = Progress(
            BarColumn(bar_width=10),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("eta"),
            TimeRemainingColumn(compact=True),
            TextColumn("{task.fields[stats]}"),
            console=self.rich,
            refresh_per_second=4,
        )
        self.progress.start()
        self._task = self.progress.add_task("train", total=total, completed=completed, stats="")

    def step(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self._task, completed=step)

    def log(self, record: dict[str, Any], total: int, budget_left: float | None = None) -> None:
        """One log line (plain) or the bar's stats; `budget_left`: seconds of a time budget still to go,
        which bound the estimate of the time left."""
        if self.mode == "bar" and self.progress is not None:
            self.progress.update(self._task, completed=record["step"], stats=_compact(record))
        elif self.mode == "plain":
            done = record["step"] - self._first
            eta = (time.perf_counter() - self._t0) / done * (total - record["step"]) if done > 0 else 0.0
            if budget_left is not None:
                eta = min(eta, budget_left) if done > 0 else budget_left
            m, s = divmod(int(eta), 60)
            self.print(f"step {record['step']:>6}/{total}  {_fmt(record)}  eta {m}:{s:02d}")

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
