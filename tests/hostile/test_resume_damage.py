"""Damaged checkpoints: a resume falls back to the newest readable one and keeps the damaged ones
aside; when none can be read it refuses, changing nothing (never a silent restart from step 0)."""

from __future__ import annotations

import os
import shutil

import pytest
from treehash import tree_hash

from lmforge.errors import CheckpointError
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer


@pytest.fixture
def run6(tiny_cfg, tmp_path):
    Trainer(tiny_cfg("train.max_steps=6", "checkpoint.every=3", "checkpoint.keep_last=3")).fit()
    return tmp_path / "run"


def test_truncated_tensor_file_falls_back_to_the_previous_checkpoint(run6, tiny_cfg, capsys):
    shard = run6 / "checkpoints" / "step_00000006" / "state" / "__0_0.distcp"
    os.truncate(shard, 1000)
    t = Trainer(tiny_cfg("train.max_steps=8", "checkpoint.every=3", "checkpoint.keep_last=3"), resume=True)
    assert t.step == 3
    t.fit()
    err = capsys.readouterr().err
    assert "checkpoint step_00000006 is unreadable" in err and "moved it to" in err
    kept = run6 / "checkpoints" / "unreadable" / "step_00000006" / "state" / "__0_0.distcp"
    assert kept.stat().st_size == 1000
    assert [r["step"] for r in read_metrics(run6 / "metrics.jsonl") if "loss" in r] == list(range(1, 9))


def test_no_readable_checkpoint_refuses_and_changes_nothing(run6, tiny_cfg):
    for ckpt in (run6 / "checkpoints").glob("step_*"):
        (ckpt / "rank_00000.pt").write_bytes(b"not a torch file")
    before = tree_hash(run6)
    with pytest.raises(CheckpointError, match=r"--resume: no checkpoint in .* could be read \(step_00000006: "
                                              r"cannot read train state .*nothing was changed"):
        Trainer(tiny_cfg("train.max_steps=8"), resume=True)
    assert tree_hash(run6) == before


def test_resume_without_any_checkpoint_starts_over_loudly(tiny_cfg, tmp_path, capsys):
    Trainer(tiny_cfg("train.max_steps=2", "checkpoint.every=0", "checkpoint.save_final=false")).fit()
    shutil.rmtree(tmp_path / "run" / "checkpoints", ignore_errors=True)
    t = Trainer(tiny_cfg("train.max_steps=2", "checkpoint.every=0"), resume=True)
    assert t.step == 0
    assert "holds no checkpoint yet: starting the run from step 0" in capsys.readouterr().err
