"""The one sampler every loader shares: seeded per-epoch order, rank slice, exact resume check."""

import numpy as np
import pytest
import torch

from lmforge.data.chat_loader import ChatLoader
from lmforge.data.loader import TokenLoader
from lmforge.data.sampler import EpochSampler
from lmforge.errors import DataError


def sampler(n=50, batch_size=4, **kw):
    kw = {"seed": 3, "rank": 0, "world_size": 1, "shuffle": True, "drop_last": True, **kw}
    return EpochSampler(n, batch_size, kind="TestLoader", count_key="units", settings={"seq_len": 8}, **kw)


class Split:
    """n one-token-longer-each conversations; conversation i's first token is i."""

    def __init__(self, n):
        self.lengths = np.full(n, 3)

    def __len__(self):
        return len(self.lengths)

    def example(self, i):
        return np.array([i, 1, 2]), np.array([False, True, True])


def test_every_loader_visits_units_in_the_samplers_order():
    n, kw = 40, {"seed": 5, "rank": 1, "world_size": 3}
    tokens = TokenLoader([np.arange(n * 8 + 1)], 8, 2, **kw)  # window w starts with token 8w
    chat = ChatLoader(Split(n), 8, 2, packing=False, **kw)
    s = sampler(n, 2, **kw)
    for _ in range(tokens.batches_per_epoch + 3):  # into the second epoch
        want = s.next_units().tolist()
        assert (tokens.next_batch().input_ids[:, 0] // 8).tolist() == want
        assert chat.next_batch().input_ids[:, 0].tolist() == want
    assert tokens.state_dict()["epoch"] == chat.state_dict()["epoch"] == s.epoch == 1


def test_order_is_the_seeded_permutation_sliced_by_rank():
    s = sampler(50, 4, rank=1, world_size=3)
    order = torch.randperm(50, generator=torch.Generator().manual_seed(3 * 1000003 + 1)).numpy()
    assert np.array_equal(s.rank_order(1), order[:48][1::3])
    assert s.batches_per_epoch == 4 and s.units_per_epoch == 16  # 16 per rank; drop_last keeps 4 x 4
    assert np.array_equal(np.concatenate(list(s.eval_units())), np.arange(48)[1::3][:16])


def test_resume_on_another_layout_continues_the_global_order():
    two = [sampler(48, 2, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        for s in two:
            s.next_units()
    one = sampler(48, 4)
    one.load_state_dict(two[0].state_dict())  # 5 batches x 2 x 2 ranks = 5 global batches of 4
    ref = sampler(48, 4)
    for _ in range(5):
        ref.next_units()
    assert (one.epoch, one.cursor) == (ref.epoch, ref.cursor) == (0, 5)
    assert np.array_equal(one.next_units(), ref.next_units())


def test_refusals_name_the_position_and_the_setting():
    s = sampler(48, 4)
    for _ in range(3):
        s.next_units()
    with pytest.raises(DataError, match=r"world_size=1 x batch_size=4 at epoch 0, batch 3 on world_size=1 "
                                        r"x batch_size=8"):
        sampler(48, 8).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match=r"seq_len 8 -> 9.*same data, seq_len and seed"):
        EpochSampler(48, 4, seed=3, rank=0, world_size=1, shuffle=True, drop_last=True, kind="TestLoader",
                     count_key="units", settings={"seq_len": 9}).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="lacks cursor.*not a TestLoader state"):
        s.load_state_dict({"epoch": 0})
    assert (s.epoch, s.cursor) == (0, 3)  # a refused load leaves the position alone


def test_chat_loader_refusal_names_the_saved_position():
    a = ChatLoader(Split(40), 8, 4, packing=False)
    a.next_batch()
    with pytest.raises(DataError, match="at epoch 0, batch 1 on world_size=1 x batch_size=8"):
        ChatLoader(Split(40), 8, 8, packing=False).load_state_dict(a.state_dict())
