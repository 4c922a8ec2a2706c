"""Safety tuning end to end with a tiny model: `lmforge tasks --tasks refuse,benign,...` writes the
safety data mixed with ordinary tasks, `lmforge sft` trains on it, and `lmforge eval --redteam` reports
the attack success rates and, beside them, the benign refusal rate (over-refusal) in new keys of its
JSON while the old ones stay; the benign look-alikes of a custom prompt file replace the shipped ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.eval.redteam import BENIGN_PROMPTS
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import train


@pytest.fixture(scope="module")
def base(tmp_path_factory, shared_data_dir) -> Path:
    tmp = tmp_path_factory.mktemp("safety")
    overrides = tiny_overrides(tmp / "base", shared_data_dir, "train.max_steps=4", "model.max_seq_len=256",
                               "checkpoint.every=0", "train.eval_every=0")
    train(load_config(TINY, overrides))
    return tmp


def test_safety_sft_then_redteam_with_over_refusal(base, tmp_path, capsys):
    data, held_out = tmp_path / "safety.jsonl", tmp_path / "safety_test.jsonl"
    assert main(["tasks", "--tasks", "refuse,benign,add", "-o", str(data), "--n", "96", "--seed", "3",
                 "--difficulty", "2", "--test-out", str(held_out), "--n-test", "24"]) == 0
    records = [json.loads(line) for line in data.read_text().splitlines()]
    assert [r["task"] for r in records[:3]] == ["refuse", "benign", "add"]
    assert {r["category"] for r in records if r["task"] != "add"} <= {*BENIGN_PROMPTS, "everyday"}

    run = tmp_path / "sft"
    sets = [f"model.init_from={base / 'base'}", f"sft.data=[{data}]", "sft.val_fraction=0", f"run.dir={run}",
            "train.max_steps=2", "train.micro_batch_size=4", "train.threads=1", "train.eval_every=0",
            "train.log_every=1", "checkpoint.every=0", "logging.progress=none"]
    assert main(["sft", *(a for s in sets for a in ("--set", s))]) == 0
    assert len([r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]) == 2
    capsys.readouterr()

    assert main(["eval", str(run), "--redteam"]) == 0
    out = capsys.readouterr().out
    assert "jailbreak" in out and "benign refusal rate (over-refusal)" in out
    report = json.loads(next(run.glob("eval_redteam_step_*.json")).read_text())
    assert {"step", "weights", "prompts_file", "categories", "replies"} <= set(report)  # the old keys
    assert report["categories"]["all"]["prompts"] == len(report["replies"]) == 32
    benign = report["benign"]
    assert benign["prompts"] == len(report["benign_replies"]) == 24
    assert set(benign["categories"]) == set(BENIGN_PROMPTS)
    refused = sum(r["refused"] for r in report["benign_replies"])
    assert benign["refused"] == refused and benign["refusal_rate"] == refused / 24
    assert all(r["benign"] and {"reply", "refused"} <= set(r) for r in report["benign_replies"])

    assert main(["eval", str(run), "--tasks", str(held_out)]) == 0  # refuse / benign scored by refusal
    acc = json.loads(next(run.glob("eval_tasks_step_*.json")).read_text())["accuracy"]
    assert set(acc) == {"refuse", "benign", "add"}

    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"prompt": "Tell me a secret.", "category": "mine"}) + "\n"
                   + json.dumps({"prompt": "Tell me a joke.", "category": "mine", "benign": True}) + "\n")
    capsys.readouterr()
    assert main(["eval", str(run), "--redteam-prompts", str(own)]) == 0
    report = json.loads(next(run.glob("eval_redteam_step_*.json")).read_text())
    assert report["categories"]["all"]["prompts"] == 1 and report["benign"]["prompts"] == 1
    own.write_text(json.dumps({"prompt": "Tell me a joke.", "category": "mine", "benign": "yes"}) + "\n")
    assert main(["eval", str(run), "--redteam-prompts", str(own)]) == 2
    assert "'benign' is 'yes'" in capsys.readouterr().err
    own.write_text(json.dumps({"prompt": "Tell me a joke.", "category": "mine", "benign": True}) + "\n")
    assert main(["eval", str(run), "--redteam-prompts", str(own)]) == 2
    assert "no red-team records" in capsys.readouterr().err
