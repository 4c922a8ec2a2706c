"""The one clock that owns a run's time budget (train.max_time): laps, agreement over ranks, what is left,
when it is spent, and its saved state."""

import pytest

from lmforge.errors import CheckpointError
from lmforge.train.clock import Clock


class Ticks:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_laps_count_against_the_budget():
    now = Ticks()
    clock = Clock(3.5, now=now)
    assert clock.remaining == 3.5 and not clock.expired and not clock.started
    for _ in range(3):
        clock.start()
        assert clock.started
        now.t += 1.0
        assert clock.stop() == 1.0
    # 3 s spent, 0.5 s left: a fourth 1 s lap would end past the budget, so the budget is spent now
    assert (clock.elapsed, clock.last, clock.remaining) == (3.0, 1.0, 0.5) and clock.expired
    clock.add(2.0)
    assert clock.remaining == 0.0  # never below zero


def test_no_budget_never_expires():
    clock = Clock()
    clock.add(1e9)
    assert clock.remaining is None and not clock.expired


def test_ranks_agree_on_each_lap():
    now = Ticks()
    clock = Clock(10.0, now=now, agree=lambda s: s * 3)  # e.g. the slowest rank took three times as long
    clock.start()
    now.t += 1.0
    assert clock.stop() == 3.0 and clock.elapsed == 3.0


def test_the_budget_is_not_saved_the_time_is():
    clock = Clock(5.0)
    clock.add(4.5)
    assert clock.state_dict() == {"seconds": 4.5, "last": 4.5}
    raised = Clock(60.0)  # a resumed run may raise train.max_time
    raised.load_state_dict(clock.state_dict())
    assert raised.remaining == 55.5 and not raised.expired
    with pytest.raises(CheckpointError, match="training clock"):
        Clock(5.0).load_state_dict({"seconds": -1.0})
