"""T5's span corruption (engine/objectives/span_corruption.py) against the definition of T5's
preprocessors.random_spans_noise_mask (written out below in numpy, as t5.data.preprocessors has it in
TensorFlow), on fixed examples: counts and rounding, the alternating layout, the sentinel layout of inputs
and targets, and masks that are a function of the window's contents only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.data.batch import TokenBatch
from lmforge.engine.objectives.span_corruption import (
    SpanCorruption,
    corrupt,
    random_spans_noise_mask,
    span_counts,
)
from lmforge.errors import ConfigError


def t5_reference(length: int, noise_density: float, mean_noise_span_length: float, shuffle) -> np.ndarray:
    """t5.data.preprocessors.random_spans_noise_mask, line for line; `shuffle(a)` is its seeded shuffle."""
    num_noise_tokens = int(np.round(length * noise_density))
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = int(np.round(num_noise_tokens / mean_noise_span_length))
    num_noise_spans = max(num_noise_spans, 1)
    num_nonnoise_tokens = length - num_noise_tokens

    def _random_segmentation(num_items, num_segments):
        first_in_segment = np.pad(shuffle(np.arange(num_items - 1) < num_segments - 1), [[1, 0]])
        segment_id = np.cumsum(first_in_segment)
        return np.bincount(segment_id, minlength=num_segments)

    noise_span_lengths = _random_segmentation(num_noise_tokens, num_noise_spans)
    nonnoise_span_lengths = _random_segmentation(num_nonnoise_tokens, num_noise_spans)
    interleaved = np.reshape(np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1), [-1])
    span_starts = np.cumsum(interleaved)[:-1]
    span_start_indicator = np.zeros(length, dtype=bool)
    span_start_indicator[span_starts] = True
    span_num = np.cumsum(span_start_indicator)
    return np.equal(span_num % 2, 1)


@pytest.mark.parametrize(("length", "counts"), [(64, (10, 3)), (128, (19, 6)), (512, (77, 26)),
                                                 (10, (2, 1)), (2, (1, 1))])
def test_counts_round_as_t5(length, counts):
    # 64 * 0.15 = 9.6 -> 10 noise in round(3.33) = 3 spans; 10 * 0.15 = 1.5 -> 2 (half to even); 2: at
    # least one token of each kind
    assert span_counts(length, 0.15, 3.0) == counts


@pytest.mark.parametrize("length", [16, 64, 128, 200])
def test_mask_equals_t5_definition(length):
    seed = 1234 + length
    g = torch.Generator().manual_seed(seed)
    ours = random_spans_noise_mask(length, 0.15, 3.0, g)
    ref_g = torch.Generator().manual_seed(seed)  # the same permutations, drawn in the same order

    def shuffle(a):
        return a[torch.randperm(len(a), generator=ref_g).numpy()]

    ref = t5_reference(length, 0.15, 3.0, shuffle)
    np.testing.assert_array_equal(ours, ref)
    noise, spans = span_counts(length, 0.15, 3.0)
    starts = ours & ~np.concatenate([[False], ours[:-1]])
    assert ours.sum() == noise and starts.sum() == spans
    assert not ours[0] and ours[-1]  # non-noise first, a noise span last: T5's alternation


def test_sentinel_layout_on_a_fixed_example():
    row = np.arange(10, 22)  # 12 tokens
    noise = np.zeros(12, dtype=bool)
    noise[[2, 3, 7, 10, 11]] = True  # spans (12 13) (17) (20 21)
    s0, s1, s2, eos = 99, 98, 97, 1
    inputs, targets = corrupt(row, noise, [s0, s1, s2], eos)
    assert inputs == [10, 11, s0, 14, 15, 16, s1, 18, 19, s2, eos]
    assert targets == [s0, 12, 13, s1, 17, s2, 20, 21, eos]


class _Tok:
    eos_id = 1

    def token_id(self, name):
        k = int(name.removeprefix("<extra_id_").removesuffix(">"))
        return 200 - k if k < 100 else None


def test_batches_are_a_function_of_each_windows_tokens():
    obj = SpanCorruption(seed=7).bind(_Tok())
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(2, 100, (3, 64), generator=g)
    a = obj.batch_of(TokenBatch(rows, rows))
    b = obj.batch_of(TokenBatch(rows[[2, 0]], rows[[2, 0]]))  # other batch, other positions
    assert a.input_ids.shape == (3, 58) and a.targets.shape == (3, 14) and obj.lengths(64) == (58, 14)
    assert a.num_tokens == 3 * 64 and a.target_count() == 3 * 14  # throughput counts the stream's tokens
    assert torch.equal(a.input_ids[[2, 0]], b.input_ids) and torch.equal(a.targets[[2, 0]], b.targets)
    other = SpanCorruption(seed=8).bind(_Tok()).batch_of(TokenBatch(rows, rows))
    assert not torch.equal(other.input_ids, a.input_ids)  # the seed matters
    for r in range(3):  # inputs and targets put back together give the window
        x, y = a.input_ids[r].tolist()[:-1], a.targets[r].tolist()[:-1]
        spans, cur = {}, None
        for t in y:
            if t > 100:
                cur = t
                spans[cur] = []
            else:
                spans[cur].append(t)
        rebuilt = [t for s in x for t in (spans[s] if s > 100 else [s])]
        assert rebuilt == rows[r].tolist()


def test_too_few_sentinels_and_unbound_tokenizer_are_refused():
    class Few(_Tok):
        def token_id(self, name):
            return 200 if name == "<extra_id_0>" else None

    class NoSentinels(_Tok):
        def token_id(self, name):
            return None

    rows = torch.randint(2, 100, (1, 64))
    with pytest.raises(ConfigError, match="3 spans but the tokenizer has 1 sentinels"):
        SpanCorruption().bind(Few()).batch_of(TokenBatch(rows, rows))
    with pytest.raises(ConfigError, match="needs T5's sentinels"):
        SpanCorruption().bind(NoSentinels())
