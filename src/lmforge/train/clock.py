"""`Clock`: the one owner of a run's training time and of its budget, train.max_time.

It counts seconds spent training (the loop's steps, data and logging; not validation or checkpointing),
summed over every process that worked on the run, and the last iteration's length (what the next one is
expected to take). The loop times each iteration with `start()` / `stop()`; the stop rule, the schedule
(schedule.unit=time), the console's time left and a resumed run's "already done" all ask it (`expired`,
`elapsed`, `remaining`) instead of reading train.max_time themselves.

    clock = Clock(budget=cfg.train.max_time)
    while not clock.expired:
        clock.start(); step(); clock.stop()

Stateful: the seconds spent and the last lap are saved, so a resumed run keeps its clock; the budget is
not (it is the config's, which a resumed run may raise). Its own part, outside a spike rollback: time
spent on steps that were redone is spent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lmforge.errors import CheckpointError


@dataclass
class Clock:
    """Seconds of training against a budget (None: no budget); see the module docstring.

    `now` is the time source (seconds, monotonic). `agree` turns one lap's seconds on this rank into the
    seconds every rank counts (the slowest rank's, so every rank stops at the same step); None on one
    process, or where no budget makes agreement matter."""

    budget: float | None = None
    seconds: float = 0.0
    last: float = 0.0
    now: Callable[[], float] = field(default=time.perf_counter, repr=False)
    agree: Callable[[float], float] | None = field(default=None, repr=False)
    _lap_start: float | None = field(default=None, repr=False)

    # -- what the loop and its readers ask ---------------------------------------------------
    @property
    def elapsed(self) -> float:
        """Seconds of training so far (what schedule.unit=time counts)."""
        return self.seconds

    @property
    def remaining(self) -> float | None:
        """Seconds of the budget left (never below 0); None without a budget."""
        return None if self.budget is None else max(0.0, self.budget - self.seconds)

    @property
    def expired(self) -> bool:
        """Whether the budget is spent: one more iteration as long as the last one would end past it
        (a budget never overruns by a step)."""
        return self.would_overrun(self.budget)

    def would_overrun(self, budget: float | None) -> bool:
        """Whether one more iteration as long as the last one would end past `budget` seconds."""
        return budget is not None and self.seconds + self.last > budget

    # -- timing --------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """Whether a lap is being timed (between start() and stop())."""
        return self._lap_start is not None

    def start(self) -> None:
        """Start timing one iteration of the loop."""
        self._lap_start = self.now()

    def stop(self) -> float:
        """End the iteration start() began and count it (as the ranks agree); returns its seconds."""
        assert self._lap_start is not None, "Clock.stop() without start()"
        seconds, self._lap_start = self.now() - self._lap_start, None
        if self.agree is not None:
            seconds = self.agree(seconds)
        self.add(seconds)
        return seconds

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.last = seconds

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"seconds": self.seconds, "last": self.last}

    def load_state_dict(self, sd: dict) -> None:
        values = float(sd["seconds"]), float(sd.get("last", 0.0))
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise CheckpointError(f"the training clock in this checkpoint reads {values!r} seconds; finite "
                                  "numbers >= 0 were expected")
        self.seconds, self.last = values
