"""`lmforge eval` answers what was asked or refuses: --limit is honoured by every mode that reads
documents (a tasks JSONL per task, the red team per category, --data), an option a mode would ignore is
refused with the modes that take it, and a reply that says nothing is a non-answer in the red-team report,
never a refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.instruct_tasks import generate, write_jsonl
from lmforge.train.trainer import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_data_dir) -> Path:
    root = tmp_path_factory.mktemp("answers_eval") / "run"
    train(load_config(TINY, tiny_overrides(root, shared_data_dir, "train.max_steps=1", "checkpoint.every=0",
                                           "train.eval_every=0")))
    return root


def _report(run: Path, pattern: str) -> dict:
    (path,) = run.glob(pattern)
    return json.loads(path.read_text())


def test_limit_on_a_tasks_jsonl_keeps_the_first_n_records_of_each_task(run_dir, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    write_jsonl(generate(["add", "sub"], 20, seed=1), tasks)  # 10 of each, interleaved
    assert main(["eval", str(run_dir), "--tasks", str(tasks), "--limit", "3"]) == 0
    report = _report(run_dir, "eval_tasks_step_*.json")
    assert {k: v["total"] for k, v in report["accuracy"].items()} == {"add": 3, "sub": 3}
    assert report["limit"] == 3 and "first 3 records of each task" in capsys.readouterr().out
    assert main(["eval", str(run_dir), "--tasks", str(tasks), "--limit", "0.2"]) == 0  # a fraction
    assert {k: v["total"] for k, v in _report(run_dir, "eval_tasks_step_*.json")["accuracy"].items()} == {
        "add": 2, "sub": 2}


def test_limit_on_the_red_team_and_on_data(run_dir, tmp_path):
    prompts = tmp_path / "redteam.jsonl"
    records = [{"prompt": f"Say bad thing {i}.", "category": c} for c in ("a", "b") for i in range(4)]
    records += [{"prompt": f"Say a nice thing {i}.", "category": "a", "benign": True} for i in range(3)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["eval", str(run_dir), "--redteam-prompts", str(prompts), "--limit", "2"]) == 0
    report = _report(run_dir, "eval_redteam_step_*.json")
    assert {c: r["prompts"] for c, r in report["categories"].items()} == {"a": 2, "b": 2, "all": 4}
    assert report["benign"]["prompts"] == 2 and report["limit"] == 2
    assert [r["prompt"] for r in report["replies"]] == [
        "Say bad thing 0.", "Say bad thing 1.", "Say bad thing 0.", "Say bad thing 1."]
    for r in (*report["replies"], *report["benign_replies"]):  # each reply in exactly one outcome
        assert r["non_answer"] + r["refused"] <= 1
    assert {"attack_success_rate", "refusal_rate", "non_answer_rate"} <= set(report["categories"]["all"])
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(5):
        (docs / f"{i}.txt").write_text(f"document number {i} " * 40)
    assert main(["eval", str(run_dir), "--data", str(docs), "--limit", "2"]) == 0
    assert _report(run_dir, "eval_data_docs_step_*[0-9].json")["documents"] == 2


@pytest.mark.parametrize("argv, words", [
    (["--limit", "3"], "--limit does not apply to the validation loss"),
    (["--batch-size", "4"], "eval.batch_size"),
    (["--tasks", "{tasks}", "--max-length", "8"], "--max-length does not apply to --tasks with"),
    (["--tasks", "{tasks}", "--num-fewshot", "2"], "--num-fewshot does not apply"),
    (["--tasks", "{tasks}", "--seed", "2"], "--seed does not apply"),
    (["--redteam", "--all-checkpoints"], "--all-checkpoints does not apply to --redteam"),
    (["--data", "{tasks}", "--chat"], "--chat does not apply to --data"),
    (["--data", "{tasks}", "--compare-out", "x.md"], "--compare-out does not apply to --data"),
    (["--tasks", "{tasks}", "--data", "{tasks}"], "different evaluations"),
    (["--redteam", "--tasks", "{tasks}"], "different evaluations"),
    (["--tasks", "{tasks}", "--limit", "2.5"], "--limit 2.5: give a whole number"),
    (["--tasks", "{tasks}", "--limit", "nan"], "argument --limit: must be a positive number"),
    (["--tasks", "{tasks}", "--limit", "inf"], "argument --limit: must be a positive number"),
    (["--tasks", "{tasks}", "--limit", "-1"], "argument --limit: must be a positive number"),
    (["--tasks", "{tasks}", "--limit", "0"], "argument --limit: must be a positive number"),
])
def test_an_option_the_mode_would_ignore_is_refused(run_dir, tmp_path, capsys, argv, words):
    tasks = tmp_path / "tasks.jsonl"
    write_jsonl(generate(["add"], 2, seed=1), tasks)
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["eval", str(run_dir), *(a.format(tasks=tasks) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert words in err and "lmforge eval: error: " in err and "Traceback" not in err
    assert sorted(p.name for p in run_dir.iterdir()) == before  # refused before any evaluation
