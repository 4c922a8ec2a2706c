"""train.optimizer_offload=cpu under DDP (2 gloo ranks, `lmforge train --nproc 2`): the same curve as plain
DDP (each rank updates its own host copies from the all-reduced gradients)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_train_torchrun import curve, env

from conftest import TINY, tiny_overrides


def launch(run_dir, data_dir, *extra: str) -> None:
    sets = tiny_overrides(run_dir, data_dir, "train.max_steps=6", "train.eval_every=3", "checkpoint.every=3",
                          "parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch_size=4",
                          *extra)
    cmd = [sys.executable, "-m", "lmforge", "train", "-c", str(TINY), "--nproc", "2",
           *[a for o in sets for a in ("--set", o)]]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_ddp_with_offloaded_optimizer_trains_the_plain_ddp_curve(tmp_path, shared_data_dir):
    launch(tmp_path / "plain", shared_data_dir)
    launch(tmp_path / "offload", shared_data_dir, "train.optimizer_offload=cpu")
    plain, offload = curve(tmp_path / "plain"), curve(tmp_path / "offload")
    assert sorted(plain) == sorted(offload) and len(plain) >= 6
    for step, row in plain.items():
        assert row.keys() == offload[step].keys()
        for k, v in row.items():  # the bound: equal to the plain optimizer within 1e-6
            assert abs(v - offload[step][k]) <= 1e-6 * max(1.0, abs(v)), (step, k, v, offload[step][k])
