"""T5's span corruption (data/span_corruption.py) against the definition in t5.data.preprocessors:
the noise count and span count it computes, the kept-first alternation, uniform segmentation, the
sentinel layout of inputs and targets on a hand-worked window, and T5's input/target length helper."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from lmforge.data.span_corruption import (
    corrupt,
    input_and_target_lengths,
    random_spans_noise_mask,
    span_corrupt,
)
from lmforge.errors import ConfigError


def _spans(mask: np.ndarray) -> list[tuple[bool, int]]:
    out: list[tuple[bool, int]] = []
    for v in mask:
        if out and out[-1][0] == bool(v):
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((bool(v), 1))
    return out


@pytest.mark.parametrize("length,density,mean", [(100, 0.15, 3.0), (512, 0.15, 3.0), (37, 0.5, 2.0),
                                                 (10, 0.15, 3.0), (2, 0.15, 3.0)])
def test_counts_and_alternation_are_t5s(length, density, mean):
    rng = np.random.default_rng(0)
    for _ in range(20):
        mask = random_spans_noise_mask(length, density, mean, rng)
        noise = min(max(round(length * density), 1), length - 1)
        spans = max(round(noise / mean), 1)
        assert mask.shape == (length,) and mask.sum() == noise
        runs = _spans(mask)
        assert runs[0][0] is False  # a kept span first
        assert [v for v, _ in runs] == [i % 2 == 1 for i in range(len(runs))]
        assert sum(v for v, _ in runs) == spans and len(runs) == 2 * spans


def test_segmentation_is_uniform_over_compositions():
    """6 noise tokens in 2 spans: the 5 splits (1+5 ... 5+1) are equally likely."""
    rng = np.random.default_rng(1)
    seen = Counter()
    n = 5000
    for _ in range(n):
        runs = _spans(random_spans_noise_mask(20, 0.3, 3.0, rng))
        seen[tuple(k for v, k in runs if v)] += 1
    assert sorted(seen) == [(1, 5), (2, 4), (3, 3), (4, 2), (5, 1)]
    chi2 = sum((c - n / 5) ** 2 / (n / 5) for c in seen.values())
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom: p = 0.001


def test_hand_worked_window():
    tokens = np.arange(10, 20)
    noise = np.array([0, 0, 1, 1, 0, 0, 0, 1, 0, 0], dtype=bool)
    sentinels = np.array([99, 98, 97, 96])  # <extra_id_0>, <extra_id_1>, ... (T5: down from the end)
    inputs, targets = corrupt(tokens, noise, sentinels, eos=1)
    assert inputs.tolist() == [10, 11, 99, 14, 15, 16, 98, 18, 19, 1]
    assert targets.tolist() == [99, 12, 13, 98, 17, 97, 1]


def test_inputs_and_targets_rebuild_the_window():
    rng = np.random.default_rng(2)
    sentinels = np.arange(1000, 1100)
    for _ in range(50):
        tokens = rng.integers(2, 500, size=int(rng.integers(5, 300)))
        inputs, targets = span_corrupt(tokens, sentinels, eos=1, seed=7)
        pieces_in = np.split(inputs[:-1], np.flatnonzero(inputs[:-1] >= 1000))
        pieces_out = np.split(targets[:-1], np.flatnonzero(targets[:-1] >= 1000))
        rebuilt = [pieces_in[0]]  # kept span 0, then noise span k (after sentinel k), kept span k+1, ...
        noise_spans = {int(p[0]): p[1:] for p in pieces_out[1:]}
        for p in pieces_in[1:]:
            rebuilt += [noise_spans[int(p[0])], p[1:]]
        assert np.concatenate(rebuilt).tolist() == tokens.tolist()


def test_the_mask_is_a_function_of_seed_and_content():
    tokens = np.arange(2, 200)
    sent = np.arange(1000, 1100)
    a, b = span_corrupt(tokens, sent, 1, seed=3), span_corrupt(tokens.copy(), sent, 1, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], span_corrupt(tokens, sent, 1, seed=4)[0])
    other = tokens.copy()
    other[0] += 1
    assert not np.array_equal(a[0][1:], span_corrupt(other, sent, 1, seed=3)[0][1:])


def test_too_few_sentinels_is_a_clear_error():
    with pytest.raises(ConfigError, match="sentinel tokens"):
        span_corrupt(np.arange(2, 300), np.arange(1000, 1003), 1, seed=0)


@pytest.mark.parametrize("inputs_length,want", [(512, (568, 114)), (128, (141, 29))])
def test_lengths_helper_is_t5s(inputs_length, want):
    """T5's random_spans_helper at density 0.15, mean span 3 (568 -> 512 is the number its docs and
    HF's run_t5_mlm_flax quote for inputs of 512)."""
    raw, targets = input_and_target_lengths(inputs_length)
    assert (raw, targets) == want

    def inputs_of(n: int) -> int:
        noise = round(n * 0.15)
        return n - noise + round(noise / 3) + 1

    assert inputs_of(raw) <= inputs_length < inputs_of(raw + 1)  # the longest window that fits
