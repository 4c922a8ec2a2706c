"""Speculative decoding: greedy output equals plain greedy token for token, sampled output has plain
sampling's distribution (a chi-square test that a wrong acceptance rule fails), edges, refusals."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import lmforge.models.speculative as spec
from lmforge.config import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.eval.generate import filter_logits, generate
from lmforge.models import Transformer
from lmforge.models.common.attention import KVCache
from lmforge.models.speculative import speculative_generate

V = 64


def model(seed: int, **kw) -> Transformer:
    """A random float64 model. Untied output and init_std 0.3 make its next-token distributions peaked
    and context dependent (with tied 0.02 init every model's argmax is just the last token, and any
    draft would agree with any target)."""
    torch.manual_seed(seed)
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48,
                tie_embeddings=False, init_std=0.3)
    return Transformer(ModelConfig(**{**base, **kw})).double()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models gain nothing from a second thread, and lose much when other processes share the cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pair() -> dict[str, Transformer]:
    # float64 makes the greedy identity exact by construction rather than by luck: the target scores
    # a token in a (k+1)-position verification forward (explicit mask, other matmul shapes) where plain
    # decoding uses a one-position forward, and the two logits differ in the last bits (~1e-7 relative in
    # float32, ~1e-16 in float64). In float32 a near-tie of the two best logits could then break the other
    # way on some CPU; in float64 no top-2 gap of these models comes near that (checked below), so any
    # difference of the outputs is a real bug (wrong rollback, wrong position, wrong acceptance).
    target = model(0)
    smaller = model(1, n_layers=1)  # the target's first layer, embeddings and head: smaller, agrees at times
    smaller.load_state_dict({k: v for k, v in target.state_dict().items() if k in smaller.state_dict()})
    noisy = model(0)  # the target with noise on every weight: a draft that agrees about half the time
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.03)
    return {"target": target, "smaller": smaller, "noisy": noisy}


NEW = 16  # tokens per prompt in the greedy identity test


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(123)
    return [torch.randint(0, V, (1 + i % 9,), generator=gen).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def plain_greedy(pair) -> list[list[int]]:
    """Plain greedy continuations of the 50 prompts, and a check of the margin float64 buys."""
    target = pair["target"]
    outs = [generate(target, p, NEW, temperature=0.0)[0] for p in prompts(50)]
    with torch.no_grad():
        for p, out in zip(prompts(50), outs):
            top2 = target.eval()(torch.tensor([p + out])).topk(2, dim=-1).values[0, len(p) - 1:]  # (NEW+1, 2)
            assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-9
    return outs


@pytest.mark.parametrize("draft_name", ["smaller", "noisy", "target"])
def test_greedy_equals_plain_greedy_on_50_prompts(pair, plain_greedy, draft_name, monkeypatch):
    target, draft = pair["target"], pair[draft_name]
    rounds: list[tuple[int, int]] = []  # (drafted, kept) of every verification

    def recorded(logits, drafted, *rest):
        n_ok, new = verify(logits, drafted, *rest)
        rounds.append((len(drafted), n_ok))
        return n_ok, new

    verify = spec._verify
    monkeypatch.setattr(spec, "_verify", recorded)
    total = spec.SpeculativeStats()
    for i, (prompt, plain) in enumerate(zip(prompts(50), plain_greedy)):
        k = 1 + i % 6
        out, stats = speculative_generate(target, draft, prompt, NEW, k=k, adaptive_k=i % 2 == 1)
        assert out == plain, f"prompt {i} {prompt} (k={k})"
        assert stats.new_tokens == NEW and stats.rounds == stats.target_forwards - (len(prompt) > 1)
        # every round emits its kept drafts plus one token of the target's own
        assert stats.accepted + stats.rounds == NEW
        total.add(stats)
    assert total.rounds == len(rounds) and total.accepted == sum(kept for _, kept in rounds)
    if draft_name == "target":
        assert total.acceptance_rate == 1.0
    else:  # rounds that keep none, some and all of several drafts all occur
        assert any(kept == 0 < n for n, kept in rounds)
        assert any(0 < kept < n for n, kept in rounds)
        assert any(kept == n > 1 for n, kept in rounds)


def test_k_one_and_k_beyond_the_remaining_tokens(pair):
    target, draft = pair["target"], pair["noisy"]
    prompt = [5, 9, 2]
    plain = generate(target, prompt, 7, temperature=0.0)[0]
    for k in (1, 3, 7, 20):
        out, stats = speculative_generate(target, draft, prompt, 7, k=k)
        assert out == plain and stats.new_tokens == 7
    _, one = speculative_generate(target, pair["target"], prompt, 7, k=20)
    assert one.rounds == 1 and one.drafted == 6 and one.accepted == 6  # 6 drafts + the bonus token


def test_stop_tokens_end_the_output_and_are_kept(pair):
    target, draft = pair["target"], pair["noisy"]
    prompt = [3, 1, 4, 1, 5]
    free = generate(target, prompt, 20, temperature=0.0)[0]
    for stop in sorted(set(free[2:12]))[:3]:
        expected = free[: free.index(stop) + 1]
        for k in (1, 4, 8):
            out, _ = speculative_generate(target, draft, prompt, 20, k=k, stops={stop, V + 5})
            assert out == expected
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        out, _ = speculative_generate(target, draft, prompt, 20, k=4, temperature=1.0, stops={7},
                                      generator=gen)
        assert 7 not in out[:-1] and (out[-1] == 7 or len(out) == 20)


def test_max_seq_len_edges(pair):
    target, draft = pair["target"], pair["noisy"]  # max_seq_len 48
    for n_prompt in (40, 46, 47):
        prompt = list(range(n_prompt))
        plain = generate(target, prompt, 30, temperature=0.0)[0]
        out, stats = speculative_generate(target, draft, prompt, 30, k=4)
        assert out == plain and len(out) == 48 - n_prompt == stats.new_tokens
    with pytest.raises(LmforgeError, match="max_seq_len=48"):
        speculative_generate(target, draft, list(range(48)), 5)
    # a draft with a shorter context than the target's: it drafts while it has room, then the target
    # goes on alone (rounds of one token), still the target's greedy output
    short = model(0, max_seq_len=20)
    short.load_state_dict(target.state_dict())
    plain = generate(target, [1, 2, 3], 40, temperature=0.0)[0]
    out, stats = speculative_generate(target, short, [1, 2, 3], 40, k=4)
    assert out == plain and stats.drafted < 20 and stats.rounds > 20


def test_refusals_and_modes(pair):
    target = pair["target"]
    other = model(2, vocab_size=V + 8)
    with pytest.raises(LmforgeError, match=r"draft model's vocabulary \(72 tokens\) differs from the target"):
        speculative_generate(target, other, [1, 2], 5)
    with pytest.raises(LmforgeError, match="k\\) must be >= 1"):
        speculative_generate(target, pair["noisy"], [1, 2], 5, k=0)
    with pytest.raises(LmforgeError, match="non-empty prompt"):
        speculative_generate(target, pair["noisy"], [], 5)
    assert speculative_generate(target, pair["noisy"], [1], 0)[0] == []
    target.train()
    pair["noisy"].eval()
    speculative_generate(target, pair["noisy"], [1, 2], 3)
    assert target.training and not pair["noisy"].training
    target.eval()


def test_a_draft_with_another_tokenizer_is_refused(monkeypatch):
    # `lmforge generate --draft`: same vocabulary size is not enough, the token ids must mean the same
    import lmforge.eval.open_run as open_run

    def run(vocab: dict) -> SimpleNamespace:
        return SimpleNamespace(tokenizer=SimpleNamespace(hf=SimpleNamespace(get_vocab=lambda: vocab)),
                               weights_from="runs/t/checkpoints/step_1")

    monkeypatch.setattr(open_run, "load_run", lambda path, *a, **kw: run({"a": 1, "b": 0}))
    with pytest.raises(LmforgeError, match="--draft runs/d: its tokenizer differs from the one of runs/t"):
        open_run._speculative_samples(run({"a": 0, "b": 1}), "runs/d", 4, [1], {0}, print)


# ---- the output distribution --------------------------------------------------------------------------
# A table model: the logits of a position are a fixed function of that token and the one before it, the
# earlier token read back from its KVCache (so a wrong rollback of the cache changes what it predicts).
# It is as fast as a model can be, so thousands of speculative samples take a second or two, and the
# exact distribution of plain sampling over whole continuations can be enumerated.

W = 8  # vocabulary of the table models


class TableModel(nn.Module):
    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.cfg = ModelConfig(vocab_size=W, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=16)
        self.table = nn.Parameter(table, requires_grad=False)  # (W + 1, W, W): [previous, current] -> logits

    def forward(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        T, pos = ids.shape[1], cache.pos
        buf = cache.k[0][0, 0, :, 0]  # (max_len,): the tokens of the positions written so far
        buf[pos : pos + T] = ids[0].to(buf.dtype)
        seen = buf[: pos + T].long()
        prev = torch.cat([torch.tensor([W]), seen[:-1]])[pos:]  # (T,): W = no previous token
        cache.pos = pos + T
        return self.table[prev, ids[0]][None]  # (1, T, W)


def table_pair() -> tuple[TableModel, TableModel]:
    gen = torch.Generator().manual_seed(11)
    p = torch.randn(W + 1, W, W, generator=gen, dtype=torch.float64) * 1.5
    q = p + torch.randn(W + 1, W, W, generator=gen, dtype=torch.float64) * 1.5  # a draft that is often wrong
    return TableModel(p), TableModel(q)


def exact_distribution(target: TableModel, prompt, horizon, stops, temperature, top_k, top_p) -> dict:
    """P(continuation) under plain sampling (filter_logits, softmax, one token at a time), enumerated."""
    def cond(prev: int, cur: int) -> torch.Tensor:
        return filter_logits(target.table[prev, cur][None], temperature, top_k, top_p).double().softmax(-1)[0]

    out: dict[tuple[int, ...], float] = {}
    for cont in itertools.product(range(W), repeat=horizon):
        seq, prob, used = list(prompt), 1.0, ()
        for tok in cont:
            prob *= float(cond(seq[-2] if len(seq) > 1 else W, seq[-1])[tok])
            seq.append(tok)
            used += (tok,)
            if tok in stops:
                break
        if prob > 0:
            out[used] = prob if used not in out else out[used]  # a stopped prefix is reached once
    assert abs(sum(out.values()) - 1) < 1e-9
    return out


def chi_square_p_value(counts: dict, probs: dict, n: int) -> float:
    """Pearson's chi-square goodness of fit; cells expecting fewer than 5 draws are pooled into one."""
    big = [c for c, p in probs.items() if p * n >= 5]
    observed = [counts.get(c, 0) for c in big]
    expected = [probs[c] * n for c in big]
    if n - sum(expected) > 1e-9 * n:  # the pooled rare cells
        observed.append(n - sum(observed))
        expected.append(n - sum(expected))
    assert set(counts) <= set(probs), "a continuation that plain sampling can never produce"
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def speculative_counts(n: int, horizon: int, k: int, stops=frozenset(), seed=0, **sampling) -> dict:
    target, draft = table_pair()
    gen = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        out, _ = speculative_generate(target, draft, [3, 5], horizon, k=k, stops=stops, generator=gen,
                                      **sampling)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return counts


# Each setting passes with probability 1 - 1e-3 for a correct sampler (fixed seeds make the run repeatable);
# the wrong rules below fail with p-values below 1e-12.
ALPHA = 1e-3
N = 2000
SETTINGS = [
    dict(temperature=1.0, k=2),
    dict(temperature=0.7, top_k=3, k=1, adaptive_k=True),
    dict(temperature=1.3, top_p=0.8, k=3),
    dict(temperature=1.0, top_k=5, top_p=0.9, k=4, stops=frozenset({0})),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampled_continuations_have_plain_sampling_distribution(setting):
    setting = dict(setting)
    k, stops = setting.pop("k"), setting.pop("stops", frozenset())
    sampling = {"temperature": setting.pop("temperature"), "top_k": setting.pop("top_k", None),
                "top_p": setting.pop("top_p", None)}
    probs = exact_distribution(table_pair()[0], [3, 5], 3, stops, **sampling)
    counts = speculative_counts(N, 3, k, stops, **sampling, **setting)
    assert chi_square_p_value(counts, probs, N) > ALPHA


def _always_accept(logits, drafted, q_rows, greedy, probs, generator):
    p = probs(logits)
    return len(drafted), int(torch.multinomial(p[len(drafted)], 1, generator=generator))


def _resample_from_p(logits, drafted, q_rows, greedy, probs, generator):
    # the right acceptance test, but a rejected token is replaced by a draw from p, not max(0, p - q)
    p = probs(logits)
    for i, tok in enumerate(drafted):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * q_rows[i][tok] >= p[i, tok]:
            return i, int(torch.multinomial(p[i], 1, generator=generator))
    return len(drafted), int(torch.multinomial(p[len(drafted)], 1, generator=generator))


@pytest.mark.parametrize("wrong", [_always_accept, _resample_from_p])
def test_the_distribution_test_catches_a_wrong_acceptance_rule(monkeypatch, wrong):
    probs = exact_distribution(table_pair()[0], [3, 5], 3, frozenset(), 1.0, None, None)
    monkeypatch.setattr(spec, "_verify", wrong)
    counts = speculative_counts(N, 3, 2, temperature=1.0)
    assert chi_square_p_value(counts, probs, N) < 1e-12


def test_chi_square_p_value_is_calibrated():
    # plain draws from the exact distribution pass; the p-value of a fixed statistic is right
    probs = exact_distribution(table_pair()[0], [3, 5], 3, frozenset(), 1.0, None, None)
    cells = list(probs)
    gen = torch.Generator().manual_seed(1)
    draws = torch.multinomial(torch.tensor([probs[c] for c in cells]), N, replacement=True, generator=gen)
    counts: dict = {}
    for i in draws.tolist():
        counts[cells[i]] = counts.get(cells[i], 0) + 1
    assert chi_square_p_value(counts, probs, N) > ALPHA
    # chi-square with 2 degrees of freedom: P(X > x) = exp(-x / 2)
    two = {"a": 0.5, "b": 0.25, "c": 0.25}
    stat = (60 - 50) ** 2 / 50 + (20 - 25) ** 2 / 25 + (20 - 25) ** 2 / 25
    assert chi_square_p_value({"a": 60, "b": 20, "c": 20}, two, 100) == pytest.approx(math.exp(-stat / 2))
