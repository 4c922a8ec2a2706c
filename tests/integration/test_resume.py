"""A run killed with SIGKILL at an arbitrary step and resumed gives the uninterrupted loss curve,
bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.config import load_config
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import train

COMPARED = ("step", "loss", "grad_norm", "lr", "val_loss", "val_ppl", "val_bpb", "tokens_seen")


def lmforge(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmforge", *args]


def curve(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.slow  # 25 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_sigkill_and_resume_is_bit_identical(tmp_path, shared_data_dir):
    extra = ["train.max_steps=40", "checkpoint.every=7", "train.eval_every=15", "checkpoint.keep_last=2"]
    straight = tmp_path / "straight"
    # the uninterrupted reference runs in this process (one thread, as the killed one: the same floats);
    # only the killed run and its resume need processes of their own
    train(load_config(TINY, tiny_overrides(straight, shared_data_dir, *extra)))

    killed = tmp_path / "killed"
    args = sum((["--set", o] for o in tiny_overrides(killed, shared_data_dir, *extra)), [])
    proc = subprocess.Popen(lmforge("train", "-c", str(TINY), *args))
    kill_at = 25  # not a checkpoint step: the resumed run must redo steps 22..25
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            steps = [r["step"] for r in read_metrics(killed / "metrics.jsonl") if "loss" in r]
            if steps and steps[-1] >= kill_at:
                break
            assert proc.poll() is None, "training ended before it could be killed"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    logged_before_kill = max(r["step"] for r in read_metrics(killed / "metrics.jsonl"))
    assert logged_before_kill < 40

    subprocess.run(lmforge("train", "-c", str(TINY), *args, "--resume"), check=True, timeout=300)
    a, b = curve(straight), curve(killed)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    assert a == b  # exact float equality of every loss, grad norm, lr and validation metric
