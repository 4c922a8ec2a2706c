"""`lmforge constitution` end to end with a tiny model: every prompt gets an answer, a critique and a
revision under a drawn principle, the rows are in the shapes TRL's trainers (and lmforge's) read, the
AI-feedback judge is position-fair, the same seed writes the same files, a DPO run trains on the
pairs, and bad input exits 2 without touching an earlier output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.chat import to_conversation
from lmforge.data.instruct_tasks import generate, write_jsonl
from lmforge.data.preference import to_pair
from lmforge.metrics.loggers import read_metrics
from lmforge.tools.constitution import DEFAULT_CONSTITUTION
from lmforge.train.trainer import train


@pytest.fixture(scope="module")
def base(tmp_path_factory, shared_data_dir) -> Path:
    tmp = tmp_path_factory.mktemp("cai")
    overrides = tiny_overrides(tmp / "base", shared_data_dir, "train.max_steps=8", "model.max_seq_len=256",
                               "checkpoint.every=0", "train.eval_every=0")
    train(load_config(TINY, overrides))
    write_jsonl(generate(["compare", "add"], 24, seed=1), tmp / "prompts.jsonl")
    return tmp


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_critique_revise_and_ai_feedback_then_dpo(base, tmp_path, capsys):
    out = tmp_path / "cai"
    args = ["constitution", str(base / "base"), "--prompts", str(base / "prompts.jsonl"), "-o", str(out),
            "--max-new-tokens", "8", "--seed", "3"]
    assert main(args) == 0
    assert "24 prompts" in capsys.readouterr().out
    sft, revisions, feedback = (rows(out / f) for f in ("sft.jsonl", "revisions.jsonl", "feedback.jsonl"))
    names = {p["name"] for p in DEFAULT_CONSTITUTION}
    assert 0 < len(sft) <= 24 and all(r["principle"] in names for r in sft)
    for i, r in enumerate(sft):
        conv = to_conversation(r, f"sft:{i}", "messages")  # what lmforge sft / TRL SFTTrainer read
        assert conv.messages[-1]["role"] == "assistant" and "critique" in r and "initial" in r
    for i, r in enumerate(revisions + feedback):
        pair = to_pair(r, f"pair:{i}")
        assert pair.chosen != pair.rejected
    assert all(r["judge_margin"] > 0 for r in feedback)
    again = tmp_path / "again"
    assert main([*args[:-4], "-o", str(again), "--max-new-tokens", "8", "--seed", "3"]) == 0
    assert all((out / f).read_text() == (again / f).read_text() for f in ("sft.jsonl", "feedback.jsonl"))

    pairs = out / ("feedback.jsonl" if len(feedback) >= 8 else "revisions.jsonl")
    run = tmp_path / "dpo"
    sets = [f"model.init_from={base / 'base'}", f"preference.data=[{pairs}]", "preference.val_fraction=0",
            f"run.dir={run}", "train.max_steps=2", "train.micro_batch_size=4", "train.threads=1",
            "train.eval_every=0", "checkpoint.every=0", "logging.progress=none", "finetune.method=lora",
            "train.log_every=1"]
    assert main(["dpo", *(a for s in sets for a in ("--set", s))]) == 0
    assert len([r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]) == 2


def test_bad_constitution_input_exits_2_and_keeps_the_old_output(base, tmp_path, capsys):
    out = tmp_path / "cai"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- name: x\n  critique: ''\n")
    args = ["constitution", str(base / "base"), "--prompts", str(base / "prompts.jsonl"), "-o", str(out)]
    assert main([*args, "--constitution", str(bad), "--overwrite"]) == 2
    assert "principle 0 needs" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(args) == 2  # a non-empty output dir without --overwrite
    assert "--overwrite" in capsys.readouterr().err or "not empty" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"nothing": 1}) + "\n")
    assert main(["constitution", str(base / "base"), "--prompts", str(empty), "-o", str(tmp_path / "x")]) == 2
    assert "no usable prompt" in capsys.readouterr().err
    written = tmp_path / "principles.yaml"
    assert main(["constitution", "--write-default", str(written)]) == 0
    assert written.read_text().count("critique:") == len(DEFAULT_CONSTITUTION)


def test_redteam_eval_writes_the_report_and_refuses_bad_prompts(base, tmp_path, capsys):
    run = base / "base"
    assert main(["eval", str(run), "--redteam"]) == 0
    out = capsys.readouterr().out
    assert "attack success" in out and "jailbreak" in out
    report = json.loads(next(run.glob("eval_redteam_step_*.json")).read_text())
    assert len(report["replies"]) == 32 and report["categories"]["all"]["prompts"] == 32
    assert all({"reply", "refused", "pii", "blocklist_hits"} <= set(r) for r in report["replies"])
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"prompt": "Tell me a secret.", "category": "mine"}) + "\n")
    assert main(["eval", str(run), "--redteam-prompts", str(own)]) == 0
    assert "mine" in capsys.readouterr().out
    own.write_text(json.dumps({"prompt": "no category"}) + "\n")
    assert main(["eval", str(run), "--redteam-prompts", str(own)]) == 2
    assert "'category'" in capsys.readouterr().err
