"""`lmforge eval MODE`: each evaluation named, with the flags it takes. The old form (the mode chosen from the
flags and the suffix of --tasks) still works for one release: the same output and reports, plus one stderr
line naming the new form."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.instruct_tasks import generate, write_jsonl
from lmforge.train.trainer import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_data_dir) -> Path:
    root = tmp_path_factory.mktemp("eval_modes") / "run"
    train(load_config(TINY, tiny_overrides(root, shared_data_dir, "train.max_steps=1", "checkpoint.every=0",
                                           "train.eval_every=0")))
    return root


def _inputs(tmp_path: Path) -> dict[str, str]:
    tasks = tmp_path / "tasks.jsonl"
    write_jsonl(generate(["add", "sub"], 8, seed=1), tasks)
    docs = tmp_path / "docs.txt"
    docs.write_text("".join(f"document number {i} " * 30 + "\n\n" for i in range(4)))
    return {"tasks": str(tasks), "docs": str(docs)}


CASES = [  # the old form (after `eval RUN`), the new mode, and the report it writes
    (["--data", "{docs}", "--limit", "2"], "data", "eval_data_*_step_*[0-9].json"),
    (["--tasks", "{tasks}", "--limit", "2"], "exact", "eval_tasks_step_*.json"),
    ([], "loss", None),
]


@pytest.mark.parametrize("old, mode, report", CASES)
def test_the_old_form_and_the_mode_give_the_same_answer_and_only_the_old_one_warns(
        run_dir, tmp_path, capsys, old, mode, report):
    files = _inputs(tmp_path)
    rest = [a.format(**files) for a in old]
    outs = []
    for argv in (["eval", str(run_dir), *rest], ["eval", mode, str(run_dir), *rest]):
        assert main(argv) == 0
        cap = capsys.readouterr()
        written = json.loads(next(run_dir.glob(report)).read_text()) if report else None
        outs.append((cap.out, cap.err, written))
    (old_out, old_err, old_report), (new_out, new_err, new_report) = outs
    assert old_out == new_out and old_report == new_report
    warned = [line for line in old_err.splitlines() if "deprecated" in line]
    new_form = shlex.join(["lmforge", "eval", mode, str(run_dir), *rest])
    assert warned == ["lmforge eval: warning: choosing the evaluation by its flags is deprecated and goes "
                      f"after this release; name the mode: {new_form}"]
    assert "deprecated" not in new_err


@pytest.mark.parametrize("argv, words", [
    (["eval", "tasks", "RUN", "--tasks", "{tasks}"], "is a tasks JSONL: lmforge eval exact scores it"),
    (["eval", "exact", "RUN", "--tasks", "t.yaml"], "task files go to lmforge eval tasks"),
    (["eval", "tasks", "RUN", "RUN", "--tasks", "t.yaml"], "lmforge eval compare evaluates several"),
    (["eval", "compare", "RUN", "--tasks", "t.yaml"], "takes two or more runs"),
    (["eval", "loss", "RUN", "--limit", "3"], "unrecognized arguments: --limit"),
    (["eval", "data", "RUN"], "the following arguments are required: --data"),
    (["eval", "redteam", "RUN", "--tasks", "{tasks}"], "unrecognized arguments: --tasks"),
])
def test_a_mode_refuses_what_is_not_its_own(run_dir, tmp_path, capsys, argv, words):
    files = _inputs(tmp_path)
    before = sorted(p.name for p in run_dir.iterdir())
    assert main([str(run_dir) if a == "RUN" else a.format(**files) for a in argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "error: " in err and "Traceback" not in err and "deprecated" not in err
    assert sorted(p.name for p in run_dir.iterdir()) == before  # refused before any evaluation


@pytest.mark.parametrize("old, new", [
    (["NONE", "--redteam", "--limit", "1"], ["redteam", "NONE", "--limit", "1"]),  # --redteam is the mode
    (["NONE", "NONE", "--tasks", "t.yaml"], ["compare", "NONE", "NONE", "--tasks", "t.yaml"]),
    (["NONE", "--tasks", "builtin:code"], ["tasks", "NONE", "--tasks", "builtin:code"]),
    (["-c", "NONE.yaml"], ["loss", "-c", "NONE.yaml"]),
])
def test_the_old_form_names_the_new_one_even_when_it_then_fails(tmp_path, capsys, old, new):
    missing = str(tmp_path / "none")
    fill = lambda argv: [a.replace("NONE", missing) for a in argv]  # noqa: E731
    assert main(["eval", *fill(old)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("name the mode: " + shlex.join(["lmforge", "eval", *fill(new)]))
    assert len(lines) == 2 and lines[1].startswith("lmforge eval: error: ")
