"""logging.monitor.grad_sync_time under DDP (2 gloo ranks): every train record carries the time the
gradient all-reduces took, a share of the window's step time."""

from __future__ import annotations

import subprocess
import sys

import pytest
from dist_harness import free_port
from test_train_torchrun import env

from conftest import TINY, tiny_overrides
from lmforge.metrics.loggers import read_metrics


@pytest.mark.slow  # two torchrun workers: ~25 s on 2 busy cores
def test_ddp_logs_the_time_in_gradient_synchronisation(tmp_path, shared_data_dir):
    sets = tiny_overrides(tmp_path / "run", shared_data_dir, "train.max_steps=4", "train.log_every=2",
                          "checkpoint.every=0", "train.eval_every=0", "train.eval_batches=1",
                          "parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch_size=4",
                          "logging.monitor.grad_sync_time=true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "lmforge", "train", "-c", str(TINY)]
    cmd += [a for o in sets for a in ("--set", o)]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    train = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    seen = 0
    for r in train:  # the all-reduces are part of the window's step time
        window = (r["tokens_seen"] - seen) / r["tokens_per_s"]
        seen = r["tokens_seen"]
        assert 0 < r["grad_sync_s"] < window
