"""The SDK's training controls: train.sanity_check=overfit_one_batch, optim.param_groups through a run
and its resume, Trainer.adjust_learning_rate and Trainer.train_epochs. Runs are a user's small module
on byte documents (seconds each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lmforge
from lmforge.errors import CheckpointMismatchError
from lmforge.metrics.loggers import read_metrics
from lmforge.train.sanity import SanityCheckFailed

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"
TINY = REPO / "configs" / "debug" / "tiny.yaml"


class GRULM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(ids))[0])  # (B, T, vocab)


def byte_docs(n: int = 40) -> list[list[int]]:
    rows = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()][:n]
    return [list(t.encode()) for t in rows]


def config(run_dir: Path, lr: float = 1e-2, optim: dict | None = None, **train) -> dict:
    return {
        "run": {"dir": str(run_dir)},
        "optim": {"lr": lr, **(optim or {})},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "train": {"max_steps": 6, "seq_len": 32, "micro_batch_size": 4, "precision": "fp32", "log_every": 1,
                  "eval_every": 0, "threads": 1, **train},
        "checkpoint": {"every": 0},
        "logging": {"progress": "none", "plot": False},
    }


def trainer(run_dir: Path, resume: bool = False, callbacks=(), **kw) -> lmforge.Trainer:
    torch.manual_seed(0)
    return lmforge.Trainer(model=GRULM(), train_data=byte_docs(), config=config(run_dir, **kw), resume=resume,
                           callbacks=callbacks)


def losses(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(run_dir / "metrics.jsonl")
            if "loss" in r and "event" not in r]


# -- train.sanity_check -------------------------------------------------------------------------

def test_a_passing_sanity_check_leaves_the_run_as_it_would_be(tmp_path):
    """With the check the run takes exactly the steps of the run without it (weights, optimizer, data
    position and RNG restored), and the check's verdict is in metrics.jsonl."""
    checked = trainer(tmp_path / "a", sanity_check="overfit_one_batch", sanity_steps=30)
    checked.fit()
    plain = trainer(tmp_path / "b")
    plain.fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    for p, q in zip(checked.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(p, q)
    event = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r.get("event") == "sanity_check"]
    assert len(event) == 1 and event[0]["steps"] == 30 and event[0]["ratio"] < 0.5


def test_a_failing_sanity_check_names_the_likely_cause(tmp_path):
    t = trainer(tmp_path / "low", lr=1e-6, sanity_check="overfit_one_batch", sanity_steps=10)
    expected = (r"10 steps on one batch took the loss from .* it must fall below train.sanity_loss_ratio=0.5"
                r".*lr may be too low \(optim.lr=1e-06")
    with pytest.raises(SanityCheckFailed, match=expected):
        t.fit()
    assert t.step == 0 and not (tmp_path / "low" / "checkpoints").exists()
    high = trainer(tmp_path / "high", lr=30.0, sanity_check="overfit_one_batch", sanity_steps=10,
                   grad_clip=0.0)
    with pytest.raises(SanityCheckFailed, match=r"lr is (likely )?too high|became NaN"):
        high.fit()


def test_the_cli_exits_2_on_a_failed_sanity_check(tmp_path, shared_data_dir, capsys):
    from lmforge.cli import main

    sets = [f"run.dir={tmp_path / 'r'}", f"data.dir={shared_data_dir}", f"data.sources=[{CORPUS}]",
            "data.max_chars=null", "logging.progress=none", "optim.lr=1e-7",
            "train.sanity_check=overfit_one_batch", "train.sanity_steps=5"]
    assert main(["train", "-c", str(TINY), *sum((["--set", s] for s in sets), [])]) == 2
    err = capsys.readouterr().err
    assert "lmforge train: error: train.sanity_check=overfit_one_batch failed" in err
    assert "Traceback" not in err


# -- optim.param_groups through a run -----------------------------------------------------------

RULES = [{"match": "emb.*", "lr_scale": 0.1}, {"match": "head.bias", "weight_decay": 0.0, "lr_scale": 2.0}]


def test_param_group_rules_train_resume_and_refuse_other_groups(tmp_path):
    """A run with rules crashed and resumed equals the uninterrupted run; resuming it with other rules is
    refused with the groups named, and the run dir is left as it was."""
    straight = trainer(tmp_path / "s", optim={"param_groups": RULES})
    straight.fit()
    names = [g["name"] for g in straight.optimizer.param_groups]
    assert names == ["decay", "no_decay", "rule0_no_decay", "rule1_no_decay"]

    class Stop(Exception):
        pass

    class CrashAt3(lmforge.Callback):
        def on_step_end(self, trainer, step, result):
            if step == 3:
                trainer.save()
                raise Stop

    with pytest.raises(Stop):
        trainer(tmp_path / "c", optim={"param_groups": RULES}, callbacks=[CrashAt3()]).fit()
    before = sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir())
    with pytest.raises(CheckpointMismatchError, match=r"rule0_no_decay.*optim.param_groups"):
        trainer(tmp_path / "c", resume=True, optim={"param_groups": RULES[:1]})
    assert sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir()) == before
    trainer(tmp_path / "c", resume=True, optim={"param_groups": RULES}).fit()
    assert losses(tmp_path / "c")[-3:] == losses(tmp_path / "s")[-3:]
