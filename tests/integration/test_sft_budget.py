"""`lmforge sft --budget`: the whole process (start-up, the data's facts, the probe, preparing, fine-tuning,
the validation loss and the exact match on held-out tasks) inside the budget + 5%, the plan printed and
saved, the user's keys kept; its refusals leave nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import yaml

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.instruct_tasks import split_disjoint, write_jsonl
from lmforge.train.trainer import train


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("sft-budget")
    base = tmp / "base"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=8", "checkpoint.every=0",
                                           "train.eval_every=0")))
    split = split_disjoint(["add", "count", "last"], 400, 30, seed=0)
    write_jsonl(split.train, tmp / "chat.jsonl")
    write_jsonl(split.test, tmp / "held_out.jsonl")
    return SimpleNamespace(tmp=tmp, base=base, chat=tmp / "chat.jsonl", held_out=tmp / "held_out.jsonl")


def sets(w: SimpleNamespace, run_dir, *extra: str) -> list[str]:
    keys = [f"model.init_from={w.base}", f"sft.data=[{w.chat}]", f"sft.val_data=[{w.held_out}]",
            f"run.dir={run_dir}", "logging.progress=none", "train.threads=1", *extra]
    return [a for k in keys for a in ("--set", k)]


@pytest.mark.slow  # 24 s; the default tier holds train --budget's own whole-process run (test_budget.py)
def test_sft_budget_run_stays_within_budget(world, tmp_path):
    # 30 s: issue 36 asks the default suite to hold a 20-40 s budget to +5% on any machine
    budget = 30.0
    run = tmp_path / "run"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lmforge", "sft", "--budget", f"{budget:g}s",
                           *sets(world, run, "finetune.r=4")], capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    if proc.returncode == 2 and "too small to fine-tune" in proc.stderr:
        assert wall <= 1.05 * budget and "smallest budget that would work is" in proc.stderr
        pytest.skip(f"this machine is too busy for a {budget:g}s budget: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert wall <= 1.05 * budget, f"{wall:.1f}s for a budget of {budget:g}s\n{proc.stdout}"
    plan = json.loads((run / "plan.json").read_text())
    choices = {c["key"]: c for c in plan["choices"]}
    assert choices["finetune.r"] == {"key": "finetune.r", "value": 4, "why": "user"}
    assert choices["train.seq_len"]["why"].startswith("rule: holds 99%")
    assert plan["actual"]["total"] <= 1.05 * budget
    final = plan["final"]
    assert final["exact_match_records"] > 0 and 0 <= final["exact_match"] <= 1
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["schedule"]["name"] == "wsd" and cfg["train"]["max_time"] <= budget
    assert cfg["train"]["seq_len"] == choices["train.seq_len"]["value"]
    assert cfg["finetune"]["method"] == choices["finetune.method"]["value"]
    assert "| method | tokens/s | steps | why not |" in (run / "plan.md").read_text()
    out = proc.stdout
    assert out.index("finetune.method") < out.index(f"budget {budget:g}s: ")  # the table, then the run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in records)


@pytest.mark.parametrize("extra, args, message", [
    ([], ["--budget", "1s"], "smallest budget that would work is"),
    ([], ["--budget", "soon"], "is not a duration"),
    ([], ["--budget", "1m", "--resume"], "drop one of them"),
    (["train.max_time=30"], ["--budget", "1m"], "remove train.max_time"),
    (["model.init_from=null"], ["--budget", "1m"], "set model.init_from"),
])
def test_sft_budget_refusals(world, tmp_path, capsys, extra, args, message):
    code = main(["sft", *args, *sets(world, tmp_path / "run", *extra)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
