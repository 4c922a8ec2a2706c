"""What a job's files say about it while it runs: the latest metrics (step, loss, tokens/s), an ETA, and
new lines of metrics.jsonl and the logs for the event stream.

Files are read incrementally (from the last offset) and the parse is cached on (size, mtime), so a
dashboard polling many times a second costs a stat per request, not a re-read of the run's history.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

MAX_LINE = 1 << 16  # a longer "line" in a log is cut: a job cannot make the server hold a huge string


class Tail:
    """Lines appended to a file since the last read; a torn last line waits for its newline."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path, self.offset, self._rest = path, offset, b""

    def read(self, limit: int = 1 << 20) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:  # rewritten (a resumed run truncates metrics.jsonl): start over
                    self.offset, self._rest = 0, b""
                f.seek(self.offset)
                chunk = f.read(limit)
        except OSError:
            return []
        self.offset += len(chunk)
        data = self._rest + chunk
        *lines, self._rest = data.split(b"\n")
        if len(self._rest) > MAX_LINE:
            lines.append(self._rest[:MAX_LINE])
            self._rest = b""
        return [ln[:MAX_LINE].decode("utf-8", "replace") for ln in lines]


def tail_lines(path: Path, n: int) -> list[str]:
    """The last `n` lines of a (log) file, reading only its end."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            back = min(size, max(4096, n * 256))
            while True:
                f.seek(size - back)
                lines = f.read(back).split(b"\n")
                if len(lines) > n + 1 or back == size:
                    break
                back = min(size, back * 4)
    except OSError:
        return []
    if lines and lines[-1] == b"":
        lines.pop()
    if back < size:
        lines = lines[1:]  # the first is probably cut
    return [ln[:MAX_LINE].decode("utf-8", "replace") for ln in lines[-n:]] if n > 0 else []


class _Latest:
    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.tail: Tail | None = None
        self.train: dict[str, Any] | None = None
        self.val: dict[str, Any] | None = None


class Progress:
    """Latest training and validation records of each job's metrics.jsonl, kept current cheaply."""

    def __init__(self) -> None:
        self._cache: dict[str, _Latest] = {}
        self._lock = threading.Lock()

    def latest(self, job_id: str, metrics: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(last record with a training loss, last record with a validation loss) of `metrics`."""
        try:
            st = os.stat(metrics)
        except OSError:
            return None, None
        with self._lock:
            c = self._cache.setdefault(job_id, _Latest())
            key = (st.st_size, st.st_mtime_ns)
            if c.key != key:
                if c.tail is None or c.tail.path != metrics or (c.key and st.st_size < c.key[0]):
                    c.tail, c.train, c.val = Tail(metrics), None, None
                for line in c.tail.read(limit=1 << 24):
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if not isinstance(rec, dict):
                        continue
                    if "loss" in rec:
                        c.train = rec
                    if "val_loss" in rec:
                        c.val = rec
                c.key = key
            return c.train, c.val

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._cache.pop(job_id, None)


def eta_seconds(train: dict[str, Any] | None, max_steps: int | None) -> float | None:
    """Seconds left at the run's current speed: steps to go x tokens per step / tokens per second."""
    if not train or not max_steps:
        return None
    step, seen, tps = train.get("step"), train.get("tokens_seen"), train.get("tokens_per_s")
    if not isinstance(step, int) or step <= 0 or not seen or not tps or tps <= 0:
        return None
    return max(0, max_steps - step) * (seen / step) / tps
