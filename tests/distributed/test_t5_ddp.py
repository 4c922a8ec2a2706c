"""`torchrun ... -m lmforge train` of the T5 encoder-decoder (configs/t5/tiny.yaml, span corruption) with
DDP and FSDP (each encoder and decoder block its own unit) on 2 gloo ranks train the single-process curve
on the same global batch; tensor parallelism is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import free_port
from test_train_torchrun import assert_same_curve, curve, env

from conftest import CORPUS

T5_TINY = Path(__file__).resolve().parents[2] / "configs" / "t5" / "tiny.yaml"
COMMON = ("train.max_steps=8", "train.eval_every=4", "checkpoint.every=0", "train.log_every=1",
          "data.max_chars=300000", "data.tokenizer.train_chars=200000", "logging.progress=none",
          "logging.plot=false", f"data.sources=[{CORPUS}]")


def sets(run_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    return [a for o in (f"run.dir={run_dir}", f"data.dir={data_dir}", *COMMON, *extra) for a in ("--set", o)]


def lmforge(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
              str(free_port())] if nproc > 1 else []
    return subprocess.run([sys.executable, *launch, "-m", "lmforge", *args], env=env(), capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_t5_ddp_and_fsdp_on_two_ranks_train_the_single_process_curve(tmp_path):
    data = tmp_path / "data"
    one = lmforge("train", "-c", str(T5_TINY), *sets(tmp_path / "one", data, "train.micro_batch_size=8"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = lmforge("train", "-c", str(T5_TINY), *sets(tmp_path / "two", data, "train.micro_batch_size=4",
                                                      "parallel.dp_replicate=2", "parallel.dp_shard=1"),
                  nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = curve(tmp_path / "one"), curve(tmp_path / "two")
    assert len(a) >= 8
    assert_same_curve(a, b)
    fsdp = lmforge("train", "-c", str(T5_TINY), *sets(tmp_path / "three", data, "train.micro_batch_size=4"),
                   nproc=2)  # dp_shard -1: both ranks shard (FSDP, ZeRO-3)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert_same_curve(a, curve(tmp_path / "three"))
    tp = lmforge("train", "-c", str(T5_TINY), *sets(tmp_path / "four", data, "train.micro_batch_size=8",
                                                     "parallel.tp=2", "parallel.dp_shard=1"), nproc=2)
    # each rank says one line (torchrun then reports the failed workers its own way)
    assert tp.returncode != 0
    assert "lmforge train: error: an encoder-decoder (model.arch=t5) trains" in tp.stderr
    assert "parallel.tp=2 is not available" in tp.stderr
