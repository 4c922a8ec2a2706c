"""How a training run ends early: SIGINT/SIGTERM (Ctrl-C, a preempted job) are noted by a handler and acted
on at the next step boundary, where the Trainer saves a checkpoint and raises TrainingInterrupted; the
stability machinery giving up raises TrainingDiverged (exit status 3)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from lmforge.errors import LmforgeError


class TrainingDiverged(LmforgeError):
    """The stability machinery gave up (too many non-finite steps or loss spikes); a checkpoint
    of the last good weights was saved."""

    exit_code = 3


class TrainingInterrupted(LmforgeError):
    """SIGINT/SIGTERM arrived; a checkpoint was saved at a step boundary."""

    def __init__(self, msg: str, signum: int) -> None:
        super().__init__(msg)
        self.exit_code = 128 + signum


def install_handlers(note: Callable[[int], None]) -> dict[int, Any]:
    """Route SIGINT and SIGTERM to `note(signum)`; returns the old handlers (none off the main thread,
    where signals are left alone)."""
    def handler(signum, frame):  # noqa: ARG001
        note(signum)

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    return old


def restore_handlers(old: dict[int, Any]) -> None:
    for sig, h in old.items():
        signal.signal(sig, h)
