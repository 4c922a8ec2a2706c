"""Every schedule against its reference implementation, step by step: transformers' `get_scheduler`
(cosine_with_min_lr, linear, constant_with_warmup, polynomial, inverse_sqrt, warmup_stable_decay) and
torch's OneCycleLR. The reference is stepped like a training loop and its lr read before each step.

Tolerance: rel 1e-12 (ours multiplies the peak by a multiplier, the references divide and multiply by
the optimizer's lr, so the last bits may differ; any real disagreement is orders of magnitude larger).
"""

from __future__ import annotations

import pytest
import torch

from lmforge.config.schema import ScheduleConfig
from lmforge.optim.schedule import make_schedule

transformers = pytest.importorskip("transformers")

PEAK = 3e-3


def stepped(make_scheduler, steps: int) -> list[float]:
    """The lr an optimizer holds at each of `steps` training steps under a torch LR scheduler."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    sched = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def hf(name: str, warmup: int, total: int | None, steps: int, **kwargs) -> list[float]:
    return stepped(lambda opt: transformers.get_scheduler(name, opt, num_warmup_steps=warmup,
                                                          num_training_steps=total,
                                                          scheduler_specific_kwargs=kwargs), steps)


def ours(cfg: ScheduleConfig, steps: int, max_steps: int | None = None) -> list[float]:
    lr_at = make_schedule(cfg, PEAK, max_steps or steps, (max_steps or steps) * 2048)
    return [lr_at(s, s * 2048) for s in range(steps)]


def assert_same(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    assert a == pytest.approx(b, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("warmup,ratio", [(10, 0.1), (0, 0.0), (25, 0.33)])
def test_cosine_with_min_lr(warmup, ratio):
    cfg = ScheduleConfig(name="cosine", warmup_steps=warmup, min_lr_ratio=ratio)
    assert_same(ours(cfg, 120), hf("cosine_with_min_lr", warmup, 120, 120, min_lr_rate=ratio))


def test_linear_and_constant_with_warmup():
    assert_same(ours(ScheduleConfig(name="linear", warmup_steps=10, min_lr_ratio=0.0), 90),
                hf("linear", 10, 90, 90))
    assert_same(ours(ScheduleConfig(name="constant", warmup_steps=10), 90),
                hf("constant_with_warmup", 10, 90, 90))


@pytest.mark.parametrize("power,ratio,warmup", [(1.0, 0.1, 10), (2.0, 1e-4, 10), (0.5, 0.05, 0),
                                                (3.0, 0.0, 7)])
def test_polynomial(power, ratio, warmup):
    cfg = ScheduleConfig(name="polynomial", warmup_steps=warmup, min_lr_ratio=ratio, power=power)
    # 130 steps of a 100-step decay: the tail past the end sits at lr_end in both
    assert_same(ours(cfg, 130, max_steps=100),
                hf("polynomial", warmup, 100, 130, lr_end=ratio * PEAK, power=power))


@pytest.mark.parametrize("warmup,timescale", [(10, None), (0, None), (10, 37), (0, 50)])
def test_inverse_sqrt(warmup, timescale):
    cfg = ScheduleConfig(name="inverse_sqrt", warmup_steps=warmup, timescale_steps=timescale)
    kwargs = {} if timescale is None else {"timescale": timescale}
    assert_same(ours(cfg, 200), hf("inverse_sqrt", warmup, None, 200, **kwargs))


def test_wsd_decay_shapes_are_transformers_own():
    """Every decay_shape we offer, transformers' wsd accepts (and values are compared below); it
    refuses shapes it does not have, so a shape it added later would not pass unnoticed here."""
    shapes = ScheduleConfig.model_fields["decay_shape"].annotation.__args__
    assert set(shapes) == {"linear", "cosine", "1-sqrt"}
    for shape in shapes:
        hf("warmup_stable_decay", 2, 10, 1, num_decay_steps=3, decay_type=shape)
    with pytest.raises(ValueError, match="decay type"):
        hf("warmup_stable_decay", 2, 10, 1, num_decay_steps=3, decay_type="exponential")


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("ratio", [0.0, 0.1])
def test_wsd_over_the_whole_run(shape, ratio):
    # transformers: warm-up 10, decay 25, stable = the rest of 100 steps
    hf_lrs = hf("warmup_stable_decay", 10, 100, 100, num_decay_steps=25, decay_type=shape,
                min_lr_ratio=ratio)
    cfg = ScheduleConfig(name="wsd", warmup_steps=10, cooldown_steps=25, decay_shape=shape,
                         min_lr_ratio=ratio)
    assert_same(ours(cfg, 100), hf_lrs)
    by_fraction = ScheduleConfig(name="wsd", warmup_steps=10, cooldown_fraction=0.25, decay_shape=shape,
                                 min_lr_ratio=ratio)
    assert_same(ours(by_fraction, 100), hf_lrs)


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_with_explicit_stable_steps_ending_before_the_run(shape):
    # transformers: warm-up 8, stable 40, decay 20, then min_lr_ratio to step 120 = our decay end at 68
    hf_lrs = hf("warmup_stable_decay", 8, None, 120, num_stable_steps=40, num_decay_steps=20,
                decay_type=shape, min_lr_ratio=0.05)
    cfg = ScheduleConfig(name="wsd", warmup_steps=8, decay_steps=68, cooldown_steps=20, decay_shape=shape,
                         min_lr_ratio=0.05)
    assert_same(ours(cfg, 120), hf_lrs)


@pytest.mark.parametrize("total,pct,div,final", [(100, 0.3, 25.0, 1e4), (37, 0.25, 10.0, 100.0),
                                                 (64, 0.5, 5.0, 1.0), (200, 0.05, 25.0, 1e4)])
def test_one_cycle_vs_torch(total, pct, div, final):
    ref = stepped(lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=PEAK, total_steps=total, pct_start=pct, anneal_strategy="cos", div_factor=div,
        final_div_factor=final, three_phase=False, cycle_momentum=False), total)
    cfg = ScheduleConfig(name="one_cycle", pct_start=pct, div_factor=div, final_div_factor=final)
    assert_same(ours(cfg, total), ref)
    # a cycle shorter than the run (decay_steps), then flat at its floor
    longer = ours(ScheduleConfig(name="one_cycle", pct_start=pct, div_factor=div, final_div_factor=final,
                                 decay_steps=total), total + 20, max_steps=total + 20)
    assert_same(longer[:total], ref)
    assert longer[total:] == [longer[total - 1]] * 20
