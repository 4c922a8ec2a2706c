"""MixtureLoader: seen proportions match the weights (binomial bound), small sources cycle reshuffled,
and a restored state continues the very stream, mid-epoch and mid-mixture."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmforge.config.data import DataConfig
from lmforge.data.mixture import MixtureLoader
from lmforge.errors import DataError

T, B = 8, 4


def sources() -> dict[str, list[np.ndarray]]:
    # distinct id ranges tell the source of every row; "small" holds 5 windows, so it cycles
    return {"big": [np.arange(0, 8 * 400 + 1) % 1000], "mid": [1000 + np.arange(8 * 100 + 1) % 1000],
            "small": [2000 + np.arange(8 * 5 + 1)]}


WEIGHTS = {"big": 5.0, "mid": 3.0, "small": 2.0}


def loader(**kw) -> MixtureLoader:
    return MixtureLoader(sources(), WEIGHTS, T, B, seed=3, **kw)


def test_seen_proportions_match_the_weights_within_a_binomial_bound():
    ld = loader()
    rows = torch.cat([ld.next_batch().input_ids[:, 0] // 1000 for _ in range(500)])  # 2000 draws
    n = len(rows)
    for s, (name, w) in enumerate(WEIGHTS.items()):
        p = w / sum(WEIGHTS.values())
        k = int((rows == s).sum())
        assert abs(k - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (name, k, n * p)  # 4 sigma
        assert ld.metrics()[f"tokens_seen/{name}"] == k * T
    assert sum(v for k, v in ld.metrics().items() if k.startswith("tokens_seen/")) == ld.tokens_seen


def test_an_exhausted_source_starts_a_new_reshuffled_pass_of_all_its_windows():
    ld = loader()
    firsts = [ld._window(2, p) for p in range(15)]  # three passes over the 5 windows of "small"
    passes = [firsts[i:i + 5] for i in range(0, 15, 5)]
    assert all(sorted(p) == list(range(5)) for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # reshuffled per pass
    for _ in range(60):
        ld.next_batch()
    assert ld.metrics()["epochs/small"] > 1


@pytest.mark.parametrize("at", [3, 37])  # inside the first mixture epoch and after "small" cycled
def test_restored_state_continues_the_same_stream(at):
    a = loader()
    for _ in range(at):
        a.next_batch()
    sd = a.state_dict()
    b = loader()
    b.load_state_dict(sd)
    for _ in range(20):
        x, y = a.next_batch(), b.next_batch()
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.targets, y.targets)
    assert a.metrics() == b.metrics() and a.epoch == b.epoch


def test_two_ranks_take_disjoint_halves_of_the_one_rank_global_batch():
    one = MixtureLoader(sources(), WEIGHTS, T, 2 * B, seed=3)
    r0, r1 = loader(rank=0, world_size=2), loader(rank=1, world_size=2)
    for _ in range(10):
        both = torch.cat([r0.next_batch().input_ids, r1.next_batch().input_ids])
        assert torch.equal(one.next_batch().input_ids, both)


def test_resume_with_other_weights_is_refused_naming_them():
    sd = loader().state_dict()
    other = MixtureLoader(sources(), {**WEIGHTS, "small": 1.0}, T, B, seed=3)
    with pytest.raises(DataError, match="weights"):
        other.load_state_dict(sd)


def test_config_mixture_entries_and_their_errors():
    d = DataConfig(sources=["a.txt", {"path": "web/b.jsonl", "weight": 0.3}, {"path": "c", "name": "code"}])
    assert d.source_paths == ["a.txt", "web/b.jsonl", "c"]
    assert d.mixture == [("a", 1.0), ("b", 0.3), ("code", 1.0)]
    assert DataConfig(sources=["a", "b"]).mixture is None  # plain strings: one stream, as before
    with pytest.raises(ValueError, match="both named 'a'"):
        DataConfig(sources=["x/a.txt", {"path": "y/a.jsonl", "weight": 2}])
    with pytest.raises(ValueError, match="entry 1: weight: Input should be greater than 0"):
        DataConfig(sources=["b", {"path": "a", "weight": 0}])
    with pytest.raises(ValueError, match="entry 0 is neither a path nor a mapping"):
        DataConfig(sources=[5])
    with pytest.raises(ValueError, match="upsample"):
        DataConfig(sources=[{"path": "a", "upsample": 2}])


def test_a_source_too_small_for_one_window_is_named():
    with pytest.raises(DataError, match="data.sources entry 'tiny'"):
        MixtureLoader({"big": sources()["big"], "tiny": [np.arange(4)]}, {"big": 1.0, "tiny": 1.0}, T, B)


@pytest.mark.parametrize("make", ["tokens", "mixture"])
def test_pass_ended_marks_the_step_after_each_pass(make):
    from types import SimpleNamespace

    from lmforge.data.length import pass_ended
    from lmforge.data.loader import TokenLoader

    ld = TokenLoader(sources()["mid"], T, B, seed=1) if make == "tokens" else loader()
    cfg = SimpleNamespace(train=SimpleNamespace(epochs=2, grad_accum_steps=2))
    per_pass, ends = ld.batches_per_epoch, []
    for step in range(1, per_pass + 3):
        ld.next_batch(), ld.next_batch()  # one optimizer step of two micro-batches
        if pass_ended(cfg, ld):
            ends.append(step)
    # the steps in which a pass's last batch was taken
    expected = [math.ceil(k * per_pass / 2) for k in (1, 2)]
    assert ends == [s for s in expected if s <= per_pass + 2]
    cfg.train.epochs = None
    assert not pass_ended(cfg, ld)


def test_a_weighted_entry_path_is_an_input_path_of_the_run(tmp_path):
    from lmforge.config import load_config
    from lmforge.config.paths import input_paths

    cfg = load_config(None, [f"data.sources=[{{path: {tmp_path / 'web'}, weight: 2}}, {tmp_path / 'b.txt'}]"])
    found = {str(p) for _, p in input_paths(cfg)}
    assert {str(tmp_path / "web"), str(tmp_path / "b.txt")} <= found
