"""Schedules equal transformers' reference schedulers step by step."""

from __future__ import annotations

import pytest
import torch

from lmforge.config.schema import ScheduleConfig
from lmforge.optim.schedule import lr_multiplier

transformers = pytest.importorskip("transformers")


def reference(name: str, warmup: int, total: int, min_ratio: float) -> list[float]:
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
    assert lr_multiplier(25, cfg, 100) == pytest.approx(0.625)
    assert lr_multiplier(50, cfg, 100) == pytest.approx(0.25)
    assert lr_multiplier(99, cfg, 100) == pytest.approx(0.25)
