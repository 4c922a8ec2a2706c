"""Schedules: transformers' reference values for the classic three, the golden run's lrs bit for bit,
hand-checked shapes, tokens vs steps, and the config's refusals. (Every schedule against its
reference implementation: tests/parity/test_schedules_vs_transformers.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lmforge.config import load_config, save_config
from lmforge.config.schema import ScheduleConfig
from lmforge.optim.schedule import lr_multiplier, make_schedule

REPO = Path(__file__).resolve().parents[2]


def reference(name: str, warmup: int, total: int, min_ratio: float) -> list[float]:
    transformers = pytest.importorskip("transformers")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if name == "cosine":
        sched = transformers.get_cosine_with_min_lr_schedule_with_warmup(
            opt, warmup, total, min_lr_rate=min_ratio)
    elif name == "constant":
        sched = transformers.get_constant_schedule_with_warmup(opt, warmup)
    else:
        sched = transformers.get_linear_schedule_with_warmup(opt, warmup, total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name,min_ratio", [("cosine", 0.1), ("cosine", 0.0), ("linear", 0.0),
                                             ("constant", 0.0)])
def test_matches_transformers(name, min_ratio):
    cfg = ScheduleConfig(name=name, warmup_steps=10, min_lr_ratio=min_ratio)
    ours = [lr_multiplier(s, cfg, 100) for s in range(100)]
    ref = reference(name, 10, 100, min_ratio)
    assert ours == pytest.approx(ref, abs=1e-12)


def test_linear_floor_and_flat_after_decay():
    cfg = ScheduleConfig(name="linear", warmup_steps=0, min_lr_ratio=0.25, decay_steps=50)
    assert lr_multiplier(0, cfg, 100) == 1.0
    assert lr_multiplier(25, cfg, 100) == pytest.approx(0.625, rel=1e-15)
    assert lr_multiplier(50, cfg, 100) == pytest.approx(0.25, rel=1e-15)
    assert lr_multiplier(99, cfg, 100) == pytest.approx(0.25, rel=1e-15)


def test_golden_run_lrs_bit_identical():
    """The lrs logged by the golden curve of configs/debug/tiny.yaml, reproduced bit for bit."""
    cfg = load_config(REPO / "configs" / "debug" / "tiny.yaml")
    lr_at = make_schedule(cfg.schedule, cfg.optim.lr, cfg.train.max_steps, 40 * 1024)
    ours = [lr_at(s, s * 1024) for s in range(cfg.train.max_steps)]
    recordings = json.loads((REPO / "tests" / "golden" / "debug_tiny.json").read_text())["recordings"]
    assert recordings
    for rec in recordings:  # lrs are Python arithmetic: equal on every machine
        assert ours == rec["curve"]["lr"], rec["environment"]


def curve(cfg: ScheduleConfig, total: int, tokens_per_step: int = 1, peak: float = 1.0) -> list[float]:
    lr_at = make_schedule(cfg, peak, total, total * tokens_per_step)
    return [lr_at(s, s * tokens_per_step) for s in range(total)]


def test_constant_cooldown_shape_by_hand():
    # 100 steps, warm-up 10, the last 20% (steps 80..99) cool down as 1-sqrt to 0.1
    cfg = ScheduleConfig(name="constant_cooldown", warmup_steps=10, min_lr_ratio=0.1)
    lrs = curve(cfg, 100)
    assert lrs[0] == 0.0 and lrs[5] == 0.5
    assert lrs[10:81] == [1.0] * 71
    assert lrs[90] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)), rel=1e-15)
    assert lrs[99] == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(19 / 20)), rel=1e-15)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_multiplier(100, cfg, 100) == lr_multiplier(150, cfg, 100) == 0.1
    linear = ScheduleConfig(name="constant_cooldown", warmup_steps=10, min_lr_ratio=0.0, decay_shape="linear",
                            cooldown_steps=40)
    lrs = curve(linear, 100)
    assert lrs[59] == 1.0 and lrs[60] == 1.0 and lrs[70] == 0.75 and lrs[90] == 0.25


def test_constant_cooldown_is_wsd_after_the_warm_up():
    """The two differ only in where the warm-up starts (0 vs min_lr_ratio, as transformers' wsd)."""
    kw = dict(warmup_steps=10, min_lr_ratio=0.2, decay_shape="linear", cooldown_fraction=0.3)
    cool = curve(ScheduleConfig(name="constant_cooldown", **kw), 100)
    wsd = curve(ScheduleConfig(name="wsd", **kw), 100)
    assert cool[10:] == wsd[10:]
    assert cool[0] == 0.0 and wsd[0] == 0.2 and wsd[5] == pytest.approx(0.6, rel=1e-15)


def test_one_cycle_counted_in_tokens_is_continuous():
    cfg = ScheduleConfig(name="one_cycle", unit="tokens", pct_start=0.25, div_factor=10.0,
                         final_div_factor=100.0)
    assert lr_multiplier(0, cfg, 1000) == pytest.approx(0.1, rel=1e-15)
    assert lr_multiplier(250, cfg, 1000) == 1.0
    assert lr_multiplier(1000, cfg, 1000) == pytest.approx(0.001, rel=1e-12)
    assert lr_multiplier(5000, cfg, 1000) == pytest.approx(0.001, rel=1e-12)  # flat past the cycle


@pytest.mark.parametrize("kw", [
    dict(name="cosine", warmup_steps=10, min_lr_ratio=0.1),
    dict(name="cosine", warmup_steps=10, min_lr_ratio=0.1, decay_steps=60),
    dict(name="linear", warmup_steps=7, min_lr_ratio=0.0),
    dict(name="constant", warmup_steps=3),
    dict(name="polynomial", warmup_steps=10, power=2.0, min_lr_ratio=0.05),
    dict(name="inverse_sqrt", warmup_steps=10),
    dict(name="inverse_sqrt", warmup_steps=0, timescale_steps=25),
    dict(name="wsd", warmup_steps=10, cooldown_steps=30, decay_shape="cosine"),
    dict(name="wsd", warmup_steps=5, cooldown_fraction=0.25, decay_steps=80),
    dict(name="constant_cooldown", warmup_steps=10),
])
def test_tokens_unit_equals_steps_at_a_constant_batch(kw):
    tps = 4096
    in_tokens = {k.replace("_steps", "_tokens"): v * tps if k.endswith("_steps") else v
                 for k, v in kw.items()}
    steps = curve(ScheduleConfig(**kw), 100, tps, peak=3e-4)
    tokens = curve(ScheduleConfig(unit="tokens", **in_tokens), 100, tps, peak=3e-4)
    assert tokens == pytest.approx(steps, rel=1e-12, abs=0.0)
    assert max(steps) == pytest.approx(3e-4, rel=1e-12)


def test_tokens_unit_follows_tokens_not_steps_under_a_batch_ramp():
    cfg = ScheduleConfig(name="constant", unit="tokens", warmup_tokens=1000)
    lr_at = make_schedule(cfg, 2.0, 10, 10_000)
    assert lr_at(0, 500) == lr_at(7, 500) == 1.0
    assert lr_at(1, 1000) == lr_at(3, 5000) == 2.0


def test_make_schedule_rejects_a_cycle_too_short_to_rise():
    with pytest.raises(ValueError, match="pct_start"):
        make_schedule(ScheduleConfig(name="one_cycle", pct_start=0.1), 1.0, 10, 100)


@pytest.mark.parametrize("kw,words", [
    (dict(unit="tokens", warmup_steps=10, warmup_tokens=100), ["schedule.warmup_steps",
                                                               "schedule.warmup_tokens"]),
    (dict(warmup_tokens=100), ["schedule.warmup_tokens", "unit=steps", "schedule.warmup_steps"]),
    (dict(unit="tokens", warmup_tokens=0, decay_steps=50), ["schedule.decay_steps", "schedule.decay_tokens"]),
    (dict(unit="tokens"), ["schedule.warmup_tokens", "0 for none"]),
    (dict(name="one_cycle", warmup_steps=10), ["schedule.warmup_steps", "pct_start"]),
    (dict(name="constant", decay_steps=50), ["schedule.decay_steps"]),
    (dict(warmup_steps=50, decay_steps=50), ["schedule.decay_steps=50", "schedule.warmup_steps=50"]),
    (dict(name="cosine", cooldown_fraction=0.2), ["schedule.cooldown_fraction", "wsd"]),
    (dict(name="wsd", cooldown_fraction=0.2, cooldown_steps=10), ["schedule.cooldown_steps",
                                                                   "schedule.cooldown_fraction"]),
    (dict(name="wsd", warmup_steps=10, cooldown_steps=60, decay_steps=50), ["schedule.cooldown_steps=60"]),
    (dict(name="cosine", timescale_steps=10), ["schedule.timescale_steps", "inverse_sqrt"]),
    (dict(name="inverse_sqrt", unit="tokens", warmup_tokens=0), ["schedule.timescale_tokens"]),
    (dict(name="constant_cooldown", decay_shape="cosine"), ["decay_shape", "name=wsd"]),
])
def test_contradictory_settings_are_errors_naming_the_keys(kw, words):
    with pytest.raises(ValueError) as e:
        ScheduleConfig(**kw)
    for w in words:
        assert w in str(e.value)


def test_resolved_config_of_a_token_schedule_reloads(tmp_path):
    """The run dir's config.yaml holds every key; the unset ones of the other unit must not trip it."""
    cfg = load_config(REPO / "configs" / "debug" / "tiny.yaml",
                      ["schedule.unit=tokens", "schedule.warmup_steps=null", "schedule.warmup_tokens=5000",
                       "schedule.name=wsd", "schedule.cooldown_tokens=20000"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.schedule == cfg.schedule and again.schedule.warmup_steps is None
