"""The learning-rate range test: its smoothing and suggestions on hand-made curves, and a real sweep
of the tiny debug model that goes down, diverges, and leaves no run dir behind."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lmforge.tools.lr_finder import exponential_lrs, lr_find, smooth, suggest


def test_smoothing_equals_a_hand_computation():
    # avg_1 = 0.02*4 = 0.08, avg_2 = 0.98*0.08 + 0.02*2 = 0.1184, avg_3 = 0.98*0.1184 + 0.02*3 = 0.176032;
    # each divided by 1 - 0.98^i: 0.02, 0.0396, 0.058808
    assert smooth([4.0, 2.0, 3.0]) == pytest.approx([0.08 / 0.02, 0.1184 / 0.0396, 0.176032 / 0.058808],
                                                    rel=1e-12, abs=0.0)
    assert smooth([2.5] * 50) == pytest.approx([2.5] * 50, rel=1e-12)  # bias correction: no pull to 0


def test_exponential_lrs_span_the_range_geometrically():
    lrs = exponential_lrs(1e-6, 1.0, 61)
    assert lrs[0] == 1e-6 and lrs[-1] == pytest.approx(1.0, rel=1e-14)
    ratios = np.array(lrs[1:]) / np.array(lrs[:-1])
    assert ratios == pytest.approx(np.full(60, 10 ** 0.1), rel=1e-12)


def synthetic(lrs: list[float]) -> list[float]:
    """Falls fastest at lr 1e-3 (the tanh's centre), bottoms out at lr 0.1, then climbs."""
    u = np.log10(lrs)
    return list(5 - np.tanh(2 * (u + 3)) + 10 * np.maximum(0.0, u + 1) ** 2)


def test_suggestions_on_a_synthetic_curve():
    lrs = exponential_lrs(1e-6, 1.0, 61)
    steep, lowest = suggest(lrs, synthetic(lrs))
    assert (steep, lowest) == (30, 50)
    assert lrs[steep] == pytest.approx(1e-3, rel=1e-12) and lrs[lowest] == pytest.approx(0.1, rel=1e-12)


def test_steepest_descent_ignores_the_diverging_tail():
    lrs = exponential_lrs(1e-6, 1.0, 61)
    loss = synthetic(lrs)
    loss[55], loss[56] = 40.0, 7.0  # a wild swing past the minimum: steeper than any real descent
    slope = np.gradient(loss, np.log(lrs))
    assert int(np.argmin(slope)) == 56
    assert suggest(lrs, loss) == (30, 50)


def test_a_curve_that_only_rises_suggests_its_start():
    lrs = exponential_lrs(1e-3, 1.0, 20)
    assert suggest(lrs, [1.0 + i for i in range(20)]) == (0, 0)


def test_sweep_of_the_tiny_model(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.grad_accum_steps=1")  # half the work per step; the sweep is what is tested
    out = tmp_path / "plots" / "lr.png"
    result = lr_find(cfg, 1e-3, 1e3, 80, out, say=lambda m: None)
    sm = result.smoothed
    assert result.lrs == exponential_lrs(1e-3, 1e3, 80)[: len(result.lrs)]
    assert result.diverged and len(result.lrs) < 80
    assert sm[-1] > 4 * min(sm)  # why it stopped
    assert min(sm) < sm[0] - 0.3  # it went down first: 0.3 nats is far above step-to-step noise
    best = sm.index(min(sm))
    assert 10 < best < len(sm) - 1
    assert 1e-3 < result.steepest_lr < result.min_loss_lr < 1e3
    assert 1e-3 < result.min_lr_div10 < 1e3
    assert result.min_lr_div10 == pytest.approx(result.min_loss_lr / 10, rel=1e-15)
    assert not Path(cfg.run.dir).exists()
    assert cfg.model.vocab_size is None  # the caller's config is left as it was
    with Image.open(result.png) as img:
        img.verify()
    assert result.png == out


def test_sweep_is_reproducible(tiny_cfg):
    a = lr_find(tiny_cfg(), 1e-4, 1e-2, 6, None, say=lambda m: None)
    b = lr_find(tiny_cfg(), 1e-4, 1e-2, 6, None, say=lambda m: None)
    assert a.losses == b.losses and a.png is None
    assert all(math.isfinite(x) for x in a.losses)


@pytest.mark.parametrize("args,words", [((1e-3, 1e-4, 50), "--min-lr"), ((0.0, 1.0, 50), "--min-lr"),
                                        ((1e-5, 1.0, 2), "--steps")])
def test_bad_ranges_are_user_errors(tiny_cfg, args, words):
    with pytest.raises(ValueError, match=words):
        lr_find(tiny_cfg(), *args, None, say=lambda m: None)
