"""`torchrun ... -m lmforge sft` of a T5 run (objective seq2seq) with DDP on 2 gloo ranks trains the
single-process curve on the same global batch: each rank pads its own rows, which the encoder's mask and
the targets' ignored padding make invisible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_t5_ddp import T5_TINY, lmforge, sets
from test_train_torchrun import assert_same_curve, curve


def _tasks(path: Path) -> None:
    rows = [{"input": f"what is {a} plus {b}", "target": str(a + b)} for a in range(12) for b in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_t5_seq2seq_ddp_on_two_ranks_trains_the_single_process_curve(tmp_path):
    data = tmp_path / "data"
    pre = lmforge("train", "-c", str(T5_TINY), *sets(tmp_path / "pre", data, "train.eval_every=0"))
    assert pre.returncode == 0, pre.stderr[-3000:]
    _tasks(tmp_path / "tasks.jsonl")

    def sft(run: str, *extra: str, nproc: int = 1):
        args = [f"run.dir={tmp_path / run}", f"model.init_from={tmp_path / 'pre'}",
                f"seq2seq.data=[{tmp_path / 'tasks.jsonl'}]", "seq2seq.val_fraction=0.25",
                "train.max_steps=6", "train.eval_every=3", "train.log_every=1", "train.eval_batches=2",
                "checkpoint.every=0", "logging.progress=none", "logging.plot=false", "train.seq_len=32",
                *extra]
        return lmforge("sft", *[a for o in args for a in ("--set", o)], nproc=nproc)

    one = sft("one", "train.micro_batch_size=8")
    assert one.returncode == 0, one.stderr[-3000:]
    two = sft("two", "train.micro_batch_size=4", "parallel.dp_replicate=2", "parallel.dp_shard=1", nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = curve(tmp_path / "one"), curve(tmp_path / "two")
    assert len(a) >= 6
    assert_same_curve(a, b)
