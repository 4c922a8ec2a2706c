"""Generation: greedy equals an uncached argmax loop, seeded sampling, top-k/top-p filtering, limits."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.eval.generate import filter_logits, generate, sample_next
from lmforge.models import Transformer

V = 61


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24)
    c = ModelConfig(**{**base, **kw})
    return Transformer(c)


@pytest.mark.parametrize("kw", [dict(), dict(pos_embedding="learned", norm="layernorm", sliding_window=5)])
def test_greedy_equals_argmax_loop_without_cache(kw):
    m = tiny(**kw)
    prompt = [3, 14, 15, 9, 26]
    out = generate(m, prompt, 12, temperature=0.0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(m.eval()(torch.tensor([seq]))[0, -1].argmax()))
    assert out == [seq[len(prompt) :]]


def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone():
    m = tiny()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = generate(m, [1, 2, 3], 15, temperature=1.0, num_samples=3, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert a == generate(m, [1, 2, 3], 15, temperature=1.0, num_samples=3, seed=7)
    assert a != generate(m, [1, 2, 3], 15, temperature=1.0, num_samples=3, seed=8)
    assert len(a) == 3 and all(len(s) == 15 for s in a) and len({tuple(s) for s in a}) > 1
    assert all(0 <= t < V for s in a for t in s)


def test_training_mode_is_restored():
    m = tiny().train()
    generate(m, [1, 2], 3)
    assert m.training
    m.eval()
    generate(m, [1, 2], 3)
    assert not m.training


def test_length_cap_and_too_long_prompt():
    m = tiny()
    assert [len(s) for s in generate(m, list(range(20)), 50, temperature=0.0)] == [4]
    with pytest.raises(ValueError, match="max_seq_len=24"):
        generate(m, list(range(24)), 5)
    with pytest.raises(ValueError, match="non-empty"):
        generate(m, [], 5)


def test_eos_stops_a_sample_and_is_kept():
    m = tiny()
    free = generate(m, [4, 5], 10, temperature=0.0)[0]
    eos = free[3]
    stopped = generate(m, [4, 5], 10, temperature=0.0, eos_id=eos)[0]
    assert stopped == free[: free.index(eos) + 1]
    samples = generate(m, [4, 5], 20, temperature=1.5, num_samples=4, seed=1, eos_id=7)
    for s in samples:
        assert 7 not in s[:-1] and (s[-1] == 7 or len(s) == 20)


def probs_logits(*p: float) -> torch.Tensor:
    return torch.tensor([[math.log(x) for x in p]])


def kept(scores: torch.Tensor) -> list[int]:
    return torch.isfinite(scores[0]).nonzero().flatten().tolist()


def test_top_k_filtering():
    logits = probs_logits(0.1, 0.4, 0.2, 0.3)
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_k=1)) == [1]
    assert kept(filter_logits(logits, top_k=10)) == [0, 1, 2, 3]
    ties = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert kept(filter_logits(ties, top_k=1)) == [1, 2]  # HF keeps ties at the k-th value


def test_top_p_filtering_smallest_set_reaching_p():
    logits = probs_logits(0.05, 0.5, 0.15, 0.3)
    assert kept(filter_logits(logits, top_p=0.5)) == [1]
    assert kept(filter_logits(logits, top_p=0.6)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.79)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.81)) == [1, 2, 3]
    assert kept(filter_logits(logits, top_p=0.01)) == [1]  # always at least one
    assert kept(filter_logits(logits, top_p=1.0)) == [0, 1, 2, 3]
    # top-k first, then top-p on the renormalised survivors {0.5, 0.3} -> 0.625 / 0.375.
    assert kept(filter_logits(logits, top_k=2, top_p=0.6)) == [1]
    assert kept(filter_logits(logits, top_k=2, top_p=0.7)) == [1, 3]
    # Temperature scales before filtering: t=2 flattens to ~{0.11, 0.35, 0.19, 0.27}.
    assert kept(filter_logits(logits, temperature=2.0, top_p=0.7)) == [1, 2, 3]


def test_filtering_matches_transformers_warpers():
    gen_mod = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 2
    for temp, k, p in [(1.0, 5, None), (0.7, None, 0.9), (1.3, 10, 0.5), (1.0, None, 0.999)]:
        ref = logits / temp
        if k is not None:
            ref = gen_mod.TopKLogitsWarper(k)(None, ref)
        if p is not None:
            ref = gen_mod.TopPLogitsWarper(p)(None, ref)
        assert torch.equal(torch.isfinite(ref), torch.isfinite(filter_logits(logits, temp, k, p)))


def test_sample_next_draws_only_kept_tokens_with_the_right_frequencies():
    logits = probs_logits(0.05, 0.5, 0.15, 0.3).expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    draws = sample_next(logits, temperature=1.0, top_p=0.6, generator=g)
    assert set(draws.tolist()) == {1, 3}
    assert (draws == 1).float().mean().item() == pytest.approx(0.625, abs=0.015)  # 0.5 / 0.8
    assert torch.equal(sample_next(logits[:3], temperature=0.0), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, temperature=-1.0)
