"""train.max_time and schedule.unit=time: durations in the config, the schedule over seconds of training,
and the loop stopping before a step that would overrun the budget, with a checkpoint, a final evaluation,
and a resume that keeps the clock. The loop's clock is replaced by a fake one that advances exactly one
second per training step, so every number below is exact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import lmforge.train.trainer as trainer_module
from conftest import TINY
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.config.schema import ScheduleConfig, parse_duration
from lmforge.errors import CheckpointError, ConfigError
from lmforge.optim.schedule import lr_multiplier
from lmforge.train.trainer import _ROLLBACK_PARTS, Clock, Trainer

PEAK = 3e-3  # optim.lr of configs/debug/tiny.yaml


@pytest.mark.parametrize("text,seconds", [("300", 300.0), ("90s", 90.0), ("5m", 300.0), ("1h30m", 5400.0),
                                          ("2.5m", 150.0), ("1h", 3600.0), (" 1m 30s ", 90.0)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5 minutes", "m", "1d", "-5m", "5m1h"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


def test_config_reads_durations_and_refuses_bad_ones(tmp_path):
    cfg = load_config(TINY, ["train.max_time=5m"])
    assert cfg.train.max_time == 300.0
    with pytest.raises(ConfigError, match="is not a duration"):
        load_config(TINY, ["train.max_time=five minutes"])
    with pytest.raises(ConfigError, match="greater than 0"):
        load_config(TINY, ["train.max_time=0"])


def time_schedule(**kw) -> ScheduleConfig:
    return ScheduleConfig(unit="time", **kw)


def test_time_schedule_is_the_step_schedule_over_seconds():
    """Counted in seconds, a schedule is the same function as counted in steps: at whole seconds it
    equals the steps schedule of that many steps, and in between it moves continuously."""
    for name, extra in [("cosine", {}), ("linear", {}), ("wsd", {"cooldown_fraction": 0.3}),
                        ("constant_cooldown", {"decay_shape": "linear"})]:
        by_time = time_schedule(name=name, warmup_seconds=10, **extra)
        by_step = ScheduleConfig(name=name, warmup_steps=10, **extra)
        for x in range(0, 101, 5):
            assert lr_multiplier(float(x), by_time, 100.0) == lr_multiplier(x, by_step, 100), (name, x)
    cos = time_schedule(name="cosine", warmup_seconds=0, min_lr_ratio=0.0)
    assert lr_multiplier(50.0, cos, 200.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)), abs=1e-15)
    wsd = time_schedule(name="wsd", warmup_seconds=0, cooldown_seconds=30.0, decay_shape="linear",
                        min_lr_ratio=0.0)
    assert lr_multiplier(69.9, wsd, 100.0) == 1.0
    assert lr_multiplier(85.0, wsd, 100.0) == pytest.approx(0.5, abs=1e-15)
    assert lr_multiplier(100.0, wsd, 100.0) == 0.0


def test_time_schedule_refusals():
    with pytest.raises(ConfigError, match="set train.max_time"):
        load_config(TINY, ["schedule.unit=time", "schedule.warmup_steps=null", "schedule.warmup_seconds=1"])
    with pytest.raises(ConfigError, match="warmup_steps counts steps but schedule.unit=time"):
        load_config(TINY, ["train.max_time=60", "schedule.unit=time", "schedule.warmup_seconds=1"])
    with pytest.raises(ConfigError, match="needs schedule.warmup_seconds"):
        load_config(TINY, ["train.max_time=60", "schedule.unit=time", "schedule.warmup_steps=null"])
    with pytest.raises(ConfigError, match="cooldown_seconds counts seconds but schedule.unit=steps"):
        load_config(TINY, ["schedule.name=wsd", "schedule.cooldown_seconds=5"])


class FakeClock:
    """time.perf_counter for the trainer module: advances one second per training step."""

    def __init__(self, module_time) -> None:
        self.now = 1000.0
        self._time = module_time

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(self._time, name)


@pytest.fixture
def fake_clock(monkeypatch):
    clock = FakeClock(trainer_module.time)
    monkeypatch.setattr(trainer_module, "time", clock)
    real_step = Trainer._train_step

    def step(self):
        out = real_step(self)
        clock.now += 1.0
        return out

    monkeypatch.setattr(Trainer, "_train_step", step)
    return clock


def budget_cfg(tiny_cfg, budget: float, *extra: str):
    return tiny_cfg(f"train.max_time={budget}", "train.max_steps=1000", "schedule.unit=time",
                    "schedule.warmup_steps=null", "schedule.warmup_seconds=2", "schedule.name=cosine",
                    "train.eval_every=0", "checkpoint.every=0", *extra)


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_budget_stops_saves_and_evaluates(tiny_cfg, fake_clock):
    cfg = budget_cfg(tiny_cfg, 7.5)
    trainer = Trainer(cfg)
    final = trainer.fit()
    # Seven one-second steps fit; an eighth would end at 8 s > 7.5 s.
    assert final["step"] == 7 and trainer.clock.seconds == 7.0
    assert math.isfinite(final["loss"])  # the final evaluation ran
    recs = records(cfg.run.dir)
    lrs = [r["lr"] for r in recs if "lr" in r]
    # Step k (1-based) starts after k - 1 seconds of training: lr = peak x cosine over 7.5 s, warm-up 2 s.
    assert lrs == [PEAK * lr_multiplier(float(k), cfg.schedule, 7.5) for k in range(7)]
    (event,) = [r for r in recs if r.get("event") == "time_budget"]
    assert event == {"step": 7, "event": "time_budget", "train_seconds": 7.0, "max_time": 7.5,
                     "tokens_seen": 7 * 2 * 8 * 64}
    assert (Path(cfg.run.dir) / "checkpoints" / "step_00000007").is_dir()
    assert any(r.get("step") == 7 and "val_loss" in r for r in recs)


def test_resume_keeps_the_clock(tiny_cfg, fake_clock):
    Trainer(budget_cfg(tiny_cfg, 3.5)).fit()  # steps 1-3, clock 3 s
    # The same budget again: spent (one more step would end at 4 s), nothing changes.
    again = Trainer(budget_cfg(tiny_cfg, 3.5), resume=True)
    assert again.complete and again.fit()["step"] == 3
    # A larger budget trains on from the restored clock, on the schedule over the new budget.
    cfg = budget_cfg(tiny_cfg, 6.5)
    trainer = Trainer(cfg, resume=True)
    assert trainer.clock.seconds == 3.0 and trainer.step == 3
    assert trainer.fit()["step"] == 6 and trainer.clock.seconds == 6.0
    lrs = [r["lr"] for r in records(cfg.run.dir) if "lr" in r]
    assert lrs[3:] == [PEAK * lr_multiplier(float(k), cfg.schedule, 6.5) for k in (3, 4, 5)]


def test_steps_still_bound_a_budgeted_run(tiny_cfg, fake_clock):
    trainer = Trainer(budget_cfg(tiny_cfg, 100.0, "train.max_steps=4"))
    assert trainer.fit()["step"] == 4 and trainer.clock.seconds == 4.0
    assert not [r for r in records(trainer.run_dir) if r.get("event") == "time_budget"]


def test_clock_state_is_checked_and_outlives_a_rollback():
    clock = Clock()
    clock.load_state_dict({"seconds": 12.5, "last": 0.5})
    assert (clock.seconds, clock.last) == (12.5, 0.5) and clock.would_overrun(12.9)
    assert not clock.would_overrun(13.0) and not clock.would_overrun(None)
    for bad in ({"seconds": float("nan")}, {"seconds": -1.0}, {"seconds": 1.0, "last": float("inf")}):
        with pytest.raises(CheckpointError, match="training clock"):
            Clock().load_state_dict(bad)
    # A spike rollback restores the progress but not the time spent on the steps it throws away.
    assert "progress" in _ROLLBACK_PARTS and "clock" not in _ROLLBACK_PARTS


def test_plot_schedule_over_a_budget(tmp_path, capsys):
    sets = [f"run.dir={tmp_path / 'run'}", "train.max_time=5m", "schedule.unit=time",
            "schedule.warmup_steps=null", "schedule.warmup_seconds=30", "schedule.name=wsd",
            "schedule.min_lr_ratio=0"]
    args = sum((["--set", s] for s in sets), [])
    assert main(["plot-schedule", "-c", str(TINY), *args, "-o", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "over train.max_time=300s of training" in out
    assert "warm-up end  30.0s" in out and "peak lr      3.0000e-03 at 30.0s" in out
    assert (tmp_path / "s.png").stat().st_size > 0 and not (tmp_path / "run").exists()
