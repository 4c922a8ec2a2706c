import numpy as np
import pytest
import torch

from lmforge.data import ShardWriter, TokenLoader
from lmforge.errors import DataError

T, B = 16, 4


@pytest.fixture
def stream(tmp_path):
    """Shards whose concatenated stream is 0, 1, 2, ...: a window's first token names it."""
    tokens = np.arange(2003, dtype=np.int64)  # 125 windows of 16 (2003 - 1 = 2002 = 125 * 16 + 2)
    w = ShardWriter(tmp_path, "train", np.uint32, shard_tokens=1024)
    for a in range(0, len(tokens), 300):  # 300-token "documents" -> shards of 900 tokens
        w.add(tokens[a:a + 300])
    return [tmp_path / f for f in w.close()]


def loader(paths, **kw):
    return TokenLoader(paths, kw.pop("seq_len", T), kw.pop("batch_size", B), **kw)


def windows_of(x: torch.Tensor) -> list[int]:
    return (x[:, 0] // T).tolist()


def test_windows_and_shift(stream):
    ld = loader(stream, shuffle=False)
    assert len(stream) == 3 and ld.num_tokens == 2003 and ld.num_windows == 125
    assert ld.batches_per_epoch == 125 // B
    x, y = ld.next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, T)
    assert torch.equal(x, torch.arange(B * T).view(B, T))
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one token
    for _ in range(14):  # window 56 spans shards 0 and 1 (tokens 896..912)
        x, y = ld.next_batch()
    assert torch.equal(x[0], torch.arange(56 * T, 57 * T)) and torch.equal(y[0], x[0] + 1)


def test_shuffle_is_seeded_and_leaves_global_rng_alone(stream):
    torch.manual_seed(0)
    rng_before = torch.get_rng_state()
    a = [windows_of(loader(stream, seed=5).next_batch().input_ids) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), rng_before)
    torch.manual_seed(123)  # the global seed must not matter
    assert windows_of(loader(stream, seed=5).next_batch().input_ids) == a[0] == a[1]
    assert windows_of(loader(stream, seed=6).next_batch().input_ids) != a[0]
    want = torch.randperm(125, generator=torch.Generator().manual_seed(5 * 1000003)).tolist()[:B]
    assert a[0] == want


def test_epoch_visits_each_window_once_then_reshuffles(stream):
    ld = loader(stream, seed=1, batch_size=5)  # 125 windows = 25 batches exactly
    epoch0 = [w for _ in range(25) for w in windows_of(ld.next_batch().input_ids)]
    assert sorted(epoch0) == list(range(125)) and ld.epoch == 1
    assert ld.tokens_seen == 125 * T
    epoch1 = [w for _ in range(25) for w in windows_of(ld.next_batch().input_ids)]
    assert sorted(epoch1) == list(range(125)) and epoch1 != epoch0


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_are_disjoint_and_cover(stream, world):
    per_rank = []
    for r in range(world):
        ld = loader(stream, seed=2, rank=r, world_size=world, batch_size=1)
        per_rank.append([windows_of(ld.next_batch().input_ids)[0] for _ in range(ld.batches_per_epoch)])
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == 125 // world
    seen = [w for p in per_rank for w in p]
    assert len(set(seen)) == len(seen) == 125 // world * world  # disjoint; only the tail is dropped
    order = torch.randperm(125, generator=torch.Generator().manual_seed(2 * 1000003)).tolist()
    assert set(seen) == set(order[: 125 // world * world])


@pytest.mark.parametrize("k", [3, 30, 31])  # 31 batches per epoch: 30 ends epoch 0, 31 is in epoch 1
def test_exact_resume(stream, k):
    ref = loader(stream, seed=7)
    ref_batches = [ref.next_batch() for _ in range(k + 40)]  # crosses at least one epoch boundary
    ld = loader(stream, seed=7)
    for _ in range(k):
        ld.next_batch()
    state = ld.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = loader(stream, seed=7)
    resumed.load_state_dict(state)
    assert resumed.epoch == ld.epoch and resumed.tokens_seen == ld.tokens_seen == k * B * T
    for x_ref, y_ref in ref_batches[k:]:
        x, y = resumed.next_batch()
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_resume_on_other_world_size(stream):
    two = [loader(stream, seed=4, rank=r, world_size=2) for r in range(2)]
    for ld in two:
        ld.next_batch()
        ld.next_batch()
    state = two[0].state_dict()
    nxt = sorted(w for ld in two for w in windows_of(ld.next_batch().input_ids))
    one = loader(stream, seed=4)
    one.load_state_dict(state)  # 2 global batches of 8 windows -> 4 batches of 4 here
    assert sorted(windows_of(one.next_batch().input_ids) + windows_of(one.next_batch().input_ids)) == nxt

    four = loader(stream, seed=4, rank=0, world_size=4)
    ld = loader(stream, seed=4, rank=0, world_size=2)
    ld.next_batch()  # 8 windows in: not a whole global batch of 16
    with pytest.raises(DataError, match="world_size=2 x batch_size=4.*world_size=4 x batch_size=4"):
        four.load_state_dict(ld.state_dict())


def test_resume_with_the_same_global_batch_split_differently(stream):
    """2 ranks x 2 windows -> 1 rank x 4: the global position carries over exactly."""
    two = [loader(stream, seed=5, rank=r, world_size=2, batch_size=2) for r in range(2)]
    for ld in two:
        ld.next_batch()
    state = two[0].state_dict()  # one global batch of 4 windows in
    nxt = sorted(w for ld in two for w in windows_of(ld.next_batch().input_ids))
    one = loader(stream, seed=5, batch_size=4)
    one.load_state_dict(state)
    assert sorted(windows_of(one.next_batch().input_ids)) == nxt


def test_resume_with_other_settings_is_an_error(stream):
    state = loader(stream).state_dict()
    with pytest.raises(DataError, match="seq_len 16 -> 8"):
        loader(stream, seq_len=8).load_state_dict(state)
    with pytest.raises(DataError, match="seed 0 -> 1"):
        loader(stream, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="num_windows 125 -> 56"):
        loader(stream[:1]).load_state_dict(state)


def test_eval_batches_are_sequential_and_stateless(stream):
    ld = loader(stream, seed=3, rank=1, world_size=2)
    ld.next_batch()
    before = ld.state_dict()
    batches = list(ld.iter_eval_batches())
    assert ld.state_dict() == before
    assert len(batches) == 62 // B
    assert windows_of(batches[0].input_ids) == [1, 3, 5, 7]  # rank 1 of 2, in order
    assert torch.equal(batches[0].targets, batches[0].input_ids + 1)
    assert len(list(ld.iter_eval_batches(max_batches=2))) == 2
    assert [windows_of(x) for x, _ in ld.iter_eval_batches()] == [windows_of(x) for x, _ in batches]


def test_drop_last_false_keeps_the_tail(stream):
    ld = loader(stream, shuffle=False, drop_last=False)
    sizes = [ld.next_batch().input_ids.shape[0] for _ in range(ld.batches_per_epoch)]
    assert sizes == [B] * 31 + [1] and ld.epoch == 1 and ld.tokens_seen == 125 * T
    assert sum(x.shape[0] for x, _ in ld.iter_eval_batches()) == 125


def test_too_little_data_says_how_much(stream):
    with pytest.raises(DataError, match=r"2,003 tokens.*seq_len=1024"):
        loader(stream, seq_len=1024)
    with pytest.raises(DataError, match=r"125 windows.*batch_size=64 on world_size=2"):
        loader(stream, batch_size=64, world_size=2)
