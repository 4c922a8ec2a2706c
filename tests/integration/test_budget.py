"""`lmforge train --budget`: the whole process (start-up, probe, preparing, training, the final evaluation)
inside the budget + 5%, the plan printed and saved, the user's keys kept; `--plan-only`; its refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lmforge.cli import main

# a shape the user fixed (kept by the planner; the rest is planned around it), small enough that a 30 s
# budget trains it even on a busy 2-core machine
TINY = ["--set", "model.d_model=32", "--set", "model.max_seq_len=64", "--set", "train.micro_batch_size=4",
        "--set", "data.tokenizer.vocab_size=512", "--set", "logging.progress=none",
        "--set", 'data.sources=["builtin:python"]']


def lmforge(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.perf_counter() - t0


def test_budget_run_stays_within_budget(tmp_path):
    # 30 s: issue 36 asks the default suite to hold a 20-40 s budget to +5% on any machine (so not marked
    # slow); on a 2-core machine shared with other jobs, start-up and the probe alone took 5-13 s
    budget = 30.0
    proc, wall = lmforge("train", "--budget", f"{budget:g}s", "--set", f"run.dir={tmp_path / 'run'}", *TINY)
    if proc.returncode == 2 and "too small for any model on this machine" in proc.stderr:
        # a machine too busy to start, probe and train in this budget: the planner must say so, in time
        assert wall <= 1.05 * budget and "smallest budget that would work is" in proc.stderr
        pytest.skip(f"this machine is too busy for a {budget:g}s budget: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert wall <= 1.05 * budget, f"{wall:.1f}s for a budget of {budget:g}s\n{proc.stdout}"
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    choices = {c["key"]: c for c in plan["choices"]}
    assert choices["model.d_model"] == {"key": "model.d_model", "value": 32, "why": "user"}
    assert choices["model.n_layers"]["why"].startswith("with d_model")
    assert plan["final"]["bpb"] > 0 and plan["actual"]["total"] <= 1.05 * budget
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["d_model"] == 32 and cfg["model"]["n_layers"] == choices["model.n_layers"]["value"]
    assert cfg["schedule"]["name"] == "wsd" and cfg["train"]["max_time"] <= budget
    assert "| choice | value | why |" in (run / "plan.md").read_text()
    # the table is printed before training
    out = proc.stdout
    assert out.index("model.n_layers") < out.index("training a byte-level BPE")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("val_bpb" in r for r in records)


def test_a_corpus_the_budget_would_memorize_ends_the_run_early(tmp_path):
    """A corpus of ~40k characters and a 30 s budget: the planner trains at most planner.EPOCH_CAP epochs,
    keeps that train.max_time after preparing (the time preparing saved is not spent on more epochs) and
    the process ends well before its budget."""
    from lmforge.tools import planner as P

    src = tmp_path / "corpus"
    src.mkdir()
    for i, path in enumerate(sorted(Path(P.__file__).parent.glob("*.py"))[:8]):
        (src / f"{i}.txt").write_text(path.read_text()[:5000])
    budget = 30.0
    sets = [a if not a.startswith("data.sources=") else f'data.sources=["{src}"]' for a in TINY]
    proc, wall = lmforge("train", "--budget", f"{budget:g}s", "--set", f"run.dir={tmp_path / 'run'}", *sets)
    if proc.returncode == 2 and "too small for any model on this machine" in proc.stderr:
        pytest.skip(f"this machine is too busy for a {budget:g}s budget: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    settings = {c["key"]: c["value"] for c in plan["choices"]}
    assert plan["phases"]["not needed"] > 5
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg["train"]["max_time"] == settings["train.max_time"] == plan["train.max_time"]
    assert wall < budget - plan["phases"]["not needed"] / 2, proc.stdout


def test_plan_only_writes_a_config_that_plain_train_reads(tmp_path, capsys):
    where = tmp_path / "planned"
    code = main(["train", "--budget", "2m", "--plan-only", "--plan-dir", str(where),
                 "--set", f"run.dir={tmp_path / 'run'}", "--set", "optim.lr=1e-3", *TINY])
    assert code == 0
    assert not (tmp_path / "run").exists()  # nothing trained
    from lmforge.config.load import load_config

    cfg = load_config(where / "config.yaml")
    plan = json.loads((where / "plan.json").read_text())
    settings = {c["key"]: c["value"] for c in plan["choices"]}
    assert cfg.optim.lr == 1e-3 and cfg.model.d_model == 32  # the user's keys
    assert cfg.model.n_layers == settings["model.n_layers"]
    assert cfg.train.max_time == settings["train.max_time"]
    assert "model.n_layers" in capsys.readouterr().out
    # a second --plan-only does not replace the first's files without --overwrite
    before = (where / "config.yaml").read_text()
    code = main(["train", "--budget", "2m", "--plan-only", "--plan-dir", str(where), *TINY])
    assert code == 2 and "already exists" in capsys.readouterr().err
    assert (where / "config.yaml").read_text() == before


@pytest.mark.parametrize("args, message", [
    (["--budget", "1s"], "smallest budget that would work is"),
    (["--budget", "25h"], "at most 24h"),
    (["--budget", "soon"], "is not a duration"),
    (["--plan-only"], "give --budget DURATION"),
    (["--budget", "1m", "--resume"], "drop one of them"),
    (["--budget", "1m", "--set", "train.max_time=30"], "remove train.max_time"),
])
def test_budget_refusals(tmp_path, capsys, args, message):
    code = main(["train", *args, "--set", f"run.dir={tmp_path / 'run'}", *TINY])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
