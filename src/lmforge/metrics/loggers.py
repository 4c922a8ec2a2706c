"""Where metrics go: metrics.jsonl (always), the console, and optionally TensorBoard, MLflow and W&B.

Only the main rank constructs real sinks; the others get a logger that drops everything.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError
from lmforge.utils.io import atomic_write_text


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (a torn last line from a killed run is ignored)."""
    records = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_metrics(path: str | os.PathLike, last_step: int) -> None:
    """Drop records after `last_step`: a resumed run redoes those steps and logs them again."""
    p = Path(path)
    if not p.exists():
        return
    kept = [r for r in read_metrics(p) if r.get("step", 0) <= last_step]
    atomic_write_text(p, "".join(json.dumps(r) + "\n" for r in kept))


class JsonlSink:
    def __init__(self, path: Path) -> None:
        self.f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class TensorBoardSink:
    def __init__(self, logdir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise LmforgeError(
                "logging.tensorboard is true but the tensorboard package is not installed; "
                "pip install 'lmforge[tensorboard]' or set logging.tensorboard=false"
            ) from None
        self.w = SummaryWriter(log_dir=str(logdir))

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class MetricsLogger:
    """Fan a record out to every sink, and to the experiment trackers (lmforge.metrics.trackers), which
    outlive the logger: closing it (a rollback reopens metrics.jsonl) does not end their runs."""

    def __init__(self, sinks: list[Any], trackers: Any = None) -> None:
        self.sinks = sinks
        self.trackers = trackers

    @classmethod
    def for_run(cls, run_dir: Path, tensorboard: bool, is_main: bool, trackers: Any = None) -> MetricsLogger:
        if not is_main:
            return cls([])
        sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl")]
        if tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        return cls(sinks, trackers)

    def log(self, record: dict[str, Any]) -> None:
        for s in self.sinks:
            s.write(record)
        if self.trackers is not None:
            self.trackers.log(record)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()
