"""Shared run dirs: one process trains in a run dir at a time (the lock dies with its holder, kill -9
included), a finished run resumed again changes nothing, and run.overwrite never deletes an input."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from treehash import tree_hash

from lmforge.cli import main
from lmforge.config.paths import INPUT, PATH_KEYS
from lmforge.errors import LmforgeError
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "debug" / "tiny.yaml"
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"


def test_a_second_trainer_in_the_same_run_dir_is_refused(tiny_cfg, tmp_path):
    first = Trainer(tiny_cfg("train.max_steps=3"))
    before = tree_hash(tmp_path / "run")
    with pytest.raises(LmforgeError, match=rf"run.dir {tmp_path / 'run'} is in use: pid {os.getpid()} on "):
        Trainer(tiny_cfg("train.max_steps=3"), resume=True)
    assert tree_hash(tmp_path / "run") == before
    first.fit()  # ends by freeing the run dir
    Trainer(tiny_cfg("train.max_steps=4"), resume=True).fit()
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4]


def test_the_lock_of_a_killed_process_is_free(tmp_path, shared_data_dir):
    """kill -9 of a trainer leaves no stale lock: --resume works right after."""
    base = [sys.executable, "-m", "lmforge", "train", "-c", str(TINY), "--set", f"run.dir={tmp_path / 'run'}",
            "--set", f"data.dir={shared_data_dir}", "--set", f"data.sources=[{CORPUS}]", "--set",
            "data.max_chars=null", "--set", "logging.progress=none", "--set", "checkpoint.every=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(base + ["--set", "train.max_steps=400"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    ckpts = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (ckpts.is_dir() and any(ckpts.glob("step_*"))):
        time.sleep(0.2)
    second = subprocess.run(base + ["--set", "train.max_steps=400", "--resume"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 2 and f"pid {proc.pid} on" in second.stderr and "is in use" in second.stderr
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # the resume after the kill needs no process of its own: through the CLI's main, in this one
    assert main([*base[3:], "--set", "train.max_steps=3", "--resume"]) == 0


def test_resuming_a_finished_run_changes_nothing(tiny_cfg, tmp_path, capsys):
    final = Trainer(tiny_cfg("train.max_steps=4", "train.eval_every=2")).fit()
    before = tree_hash(tmp_path / "run")
    for _ in range(3):
        again = Trainer(tiny_cfg("train.max_steps=4", "train.eval_every=2"), resume=True).fit()
        assert again == {k: v for k, v in final.items() if k != "tokens"}  # tokens: not in metrics.jsonl
    assert tree_hash(tmp_path / "run") == before
    assert "is complete (step 4 of train.max_steps=4); nothing to do" in capsys.readouterr().err


def test_overwrite_never_deletes_an_input(tiny_cfg, tmp_path):
    Trainer(tiny_cfg("train.max_steps=2")).fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    before = tree_hash(tmp_path / "run")
    with pytest.raises(LmforgeError, match=r"model.init_from=.*step_00000002, an input of this run, lies "
                                           r"inside .*checkpoints, which this run writes"):
        Trainer(tiny_cfg("train.max_steps=2", "run.overwrite=true", f"model.init_from={ckpt}",
                         f"data.dir={tmp_path / 'data2'}"))  # the checkpoint's tokenizer: other data
    assert tree_hash(tmp_path / "run") == before
    # An input that holds the run dir's artifacts (a source dir above it) is refused by run.overwrite only.
    with pytest.raises(LmforgeError, match=r"run.overwrite would delete .*config.yaml, which is part of "
                                           rf"{tmp_path} \(data.sources\), an input of this run"):
        Trainer(tiny_cfg("train.max_steps=2", "run.overwrite=true", f"data.sources=[{tmp_path}]",
                         f"data.dir={tmp_path / 'data3'}"))
    assert tree_hash(tmp_path / "run") == before


def _naming(key: str, value: Path) -> list[str]:
    """--set overrides that make `key` name `value` (in a list for a list key, in a step for a step's)."""
    from lmforge.config import load_config

    if key.startswith("curate.steps."):
        step = {"blocklist_files": "harmful", "eval_files": "decontaminate"}[key.rsplit(".", 1)[1]]
        return [f"curate.steps=[{{step: {step}, {key.rsplit('.', 1)[1]}: [{value}]}}]"]
    if key == "data.sources.path":  # a weighted mixture entry (config/data.py)
        return [f"data.sources=[{{path: {value}, weight: 1.0}}]"]
    node = load_config(TINY, []).model_dump()
    for k in key.split("."):
        node = node[k]
    extra = ["rl.rewards={reward_model: 1.0}"] if key == "rl.reward_model" else []
    return [f"{key}=[{value}]" if isinstance(node, list) else f"{key}={value}", *extra]


INPUT_KEYS = sorted(k for k, spec in PATH_KEYS.items() if spec.role == INPUT)


@pytest.mark.parametrize("key", INPUT_KEYS)
def test_no_input_may_be_the_run_dir_or_lie_in_what_it_writes(tmp_path, key):
    """Every input key of the classification (config/paths.py), not a list of them: the run dir itself, or a
    checkpoint in it, named as something the run reads is refused with --resume and with run.overwrite."""
    from lmforge.checkpoint.run_dir import open_run_dir
    from lmforge.config import load_config
    from lmforge.config.paths import input_paths

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    before = tree_hash(tmp_path)
    for value in (run, run / "checkpoints" / "step_00000002"):
        cfg = load_config(TINY, [f"run.dir={run}", *_naming(key, value)])
        assert (key, value) in input_paths(cfg)
        for resume, overwrite in ((True, False), (False, True)):
            with pytest.raises(LmforgeError, match=rf"{key}={value}, an input of this run, (is run.dir|lies "
                                                   "inside)"):
                open_run_dir(run, resume=resume, overwrite=overwrite, inputs=input_paths(cfg))
    assert tree_hash(tmp_path) == before and not (run / ".lock").exists()


@pytest.mark.parametrize("existing", [True, False])
def test_a_refused_run_leaves_nothing_behind(tmp_path, tmp_path_factory, existing, capsys):
    """sft into a user's folder (or a new one) that fails after the run dir was locked: no .lock, no new
    dir, nothing else of the run remains."""
    from lmforge.cli import main

    folder = tmp_path / "mine" / ("notes" if existing else "new/deep")
    if existing:
        folder.mkdir(parents=True)
        (folder / "todo.txt").write_text("mine\n")
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    before = tree_hash(tmp_path)
    rc = main(["sft", "-c", str(TINY), "--set", f"run.dir={folder}", "--set",
               f"sft.data=[{tmp_path / 'chat.jsonl'}]", "--set",
               f"data.tokenizer.path={tmp_path / 'missing' / 'tokenizer.json'}", "--set",
               f"data.dir={tmp_path_factory.mktemp('data') / 'sft'}",  # not the cwd's data/cache
               "--set", "logging.progress=none"])
    assert rc == 2 and "lmforge sft: error: tokenizer file" in capsys.readouterr().err
    assert tree_hash(tmp_path) == before  # every path, hidden ones included: no .lock, no new dir


def test_overwrite_refused_for_mismatched_data_keeps_the_old_run(tiny_cfg, tmp_path):
    """A data dir prepared with other settings is refused before run.overwrite deletes the old run."""
    Trainer(tiny_cfg("train.max_steps=2")).fit()
    before = tree_hash(tmp_path / "run")
    with pytest.raises(LmforgeError, match=r"was prepared with different settings \(tokenizer differ\)"):
        Trainer(tiny_cfg("train.max_steps=2", "run.overwrite=true", "data.tokenizer.vocab_size=320"))
    assert tree_hash(tmp_path / "run") == before


def test_a_file_system_refusal_is_a_clear_error(tmp_path, shared_data_dir, monkeypatch, capsys):
    """A read-only run dir (root writes past permissions, so the refusal is simulated where lmforge
    writes its files): one line naming the path, exit 2, no traceback."""
    from lmforge.cli import main
    from lmforge.utils import io

    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(io, "atomic_write_bytes", refuse)
    rc = main(["train", "-c", str(TINY), "--set", f"run.dir={tmp_path / 'run'}", "--set",
               f"data.dir={tmp_path / 'data'}", "--set", f"data.sources=[{CORPUS}]", "--set",
               "data.max_chars=null", "--set", "logging.progress=none", "--set", "train.max_steps=2"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"lmforge train: error: cannot use /\S+: Permission denied", last), last
