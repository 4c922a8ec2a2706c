"""Checkpoints: exact round trip, atomicity under failure, retention, shape checks."""

from __future__ import annotations

import errno

import pytest
import torch
from torch import nn

from lmforge.checkpoint.manager import CheckpointManager, list_checkpoints, load_states
from lmforge.errors import CheckpointError, LmforgeError


def make(width: int = 8, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_a_bit(model, opt, steps: int = 3):
    for _ in range(steps):
        loss = model(torch.randn(4, model[0].in_features)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


class Part:
    """A Stateful run part holding plain data."""

    def __init__(self, **state) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, sd: dict) -> None:
        self.state = dict(sd)


def test_round_trip_is_exact(tmp_path):
    model, opt = make()
    train_a_bit(model, opt)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    rng_state = torch.get_rng_state()
    path = mgr.save(3, model, opt, {"loader": Part(cursor=7), "rng": Part(torch=rng_state)})
    model2, opt2 = make(seed=1)
    loader, rng, absent = Part(), Part(), Part(untouched=1)
    loaded = mgr.load(path, model2, opt2, {"loader": loader, "rng": rng, "new": absent})
    assert loaded.step == 3 and loaded.states == {"loader", "rng"}
    assert loader.state == {"cursor": 7} and torch.equal(rng.state["torch"], rng_state)
    assert absent.state == {"untouched": 1}  # a part the checkpoint lacks keeps its fresh state
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    # Continuing both gives bit-identical parameters: the Adam moments and step counts came back too.
    torch.manual_seed(5)
    train_a_bit(model, opt, 2)
    torch.manual_seed(5)
    train_a_bit(model2, opt2, 2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_retention_keeps_last_k(tmp_path):
    model, opt = make()
    train_a_bit(model, opt, 1)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, model, opt, {})
    assert [c.step for c in list_checkpoints(tmp_path / "checkpoints")] == [3, 4]
    assert mgr.latest().step == 4


def test_full_disk_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = make()
    train_a_bit(model, opt, 1)
    mgr = CheckpointManager(tmp_path, keep_last=3)
    good = mgr.save(1, model, opt, {})
    before = {p.name: p.read_bytes() for p in good.rglob("*") if p.is_file()}

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(LmforgeError, match="no space left on device.*checkpoint"):
        mgr.save(2, model, opt, {})
    monkeypatch.undo()
    assert [c.step for c in list_checkpoints(tmp_path / "checkpoints")] == [1]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert {p.name: p.read_bytes() for p in good.rglob("*") if p.is_file()} == before


def test_interrupted_save_is_invisible(tmp_path):
    model, opt = make()
    train_a_bit(model, opt, 1)
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, model, opt, {})
    # A save killed before its rename leaves only a .tmp dir, which is never picked up and is
    # removed by the next successful save.
    (tmp_path / "checkpoints" / ".tmp-step_00000002" / "state").mkdir(parents=True)
    assert mgr.latest().step == 1
    mgr.save(3, model, opt, {})
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_shape_mismatch_is_refused(tmp_path):
    model, opt = make(width=8)
    train_a_bit(model, opt, 1)
    path = CheckpointManager(tmp_path, keep_last=1).save(1, model, opt, {})
    other, _ = make(width=16)
    with pytest.raises(CheckpointError, match=r"0.weight is \(8, 8\) in the checkpoint but \(16, 16\)"):
        load_states(path, other)


def test_malformed_run_state_is_a_checkpoint_error(tmp_path):
    """A rank file whose part states do not fit the parts (edited, truncated, from another program) is
    reported as a damaged checkpoint (the trainer then falls back to an older one), never a traceback."""
    model, opt = make()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    path = mgr.save(1, model, opt, {"progress": Part(step=1)})
    torch.save({"format": 3, "states": {"progress": {"bogus": 1}}}, path / "rank_00000.pt")

    class Strict(Part):
        def load_state_dict(self, sd):
            self.state = {"step": int(sd["step"])}

    with pytest.raises(CheckpointError, match=r"its 'progress' state is malformed \(KeyError"):
        mgr.load(path, model, opt, {"progress": Strict()})
    torch.save([1, 2, 3], path / "rank_00000.pt")
    with pytest.raises(CheckpointError, match="its run state is malformed"):
        mgr.load(path, model, opt, {"progress": Strict()})
