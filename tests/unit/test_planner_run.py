"""The budget run's parts that need no training: which keys the user set, the process clock, the stops."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmforge.config.load import load_config
from lmforge.tools.planner_probe import Deadline, process_elapsed
from lmforge.tools.planner_run import DeadlineStop, _EvalUntil, user_keys


def test_user_keys_are_what_the_file_and_set_gave(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model:\n  d_model: 96\noptim:\n  lr: 0.001\n")
    keys = user_keys(load_config(cfg_file, ["train.micro_batch_size=8", 'data.sources=["builtin:python"]']))
    # the optimizer union's tag comes with any optim key (the planner plans no optim.name)
    assert keys == {"model.d_model": 96, "optim.lr": 0.001, "optim.name": "adamw",
                    "train.micro_batch_size": 8, "data.sources": ["builtin:python"]}
    assert user_keys(load_config(None, [])) == {}
    # a preset sets the shape it names: the planner keeps it
    preset = user_keys(load_config(None, ["model.preset=debug"]))
    assert (preset["model.d_model"], preset["model.n_layers"]) == (64, 2)


def test_the_deadline_counts_from_the_process_start():
    assert process_elapsed() > 0  # this interpreter started before the test did
    now = [100.0]
    d = Deadline(30.0, now=lambda: now[0], _zero=95.0)
    assert d.elapsed == 5.0 and d.left == 25.0
    now[0] = 130.0
    assert d.left == -5.0
    real = Deadline.from_process(60.0)
    assert 0 < real.elapsed < 60 * 60


def test_training_and_evaluation_stop_at_the_deadline():
    now = [0.0]
    d = Deadline(20.0, now=lambda: now[0])
    stops = []
    trainer = SimpleNamespace(clock=SimpleNamespace(last=1.0),
                              request_stop=lambda event, **f: stops.append((event, f)))
    cb = DeadlineStop(d, reserve_s=3.0)
    now[0] = 15.0  # 5 s left, a step of 1 s still leaves the 3 s reserve
    cb.on_step_end(trainer, 1, None)
    assert stops == []
    now[0] = 16.5
    cb.on_step_end(trainer, 2, None)
    assert stops and stops[0][0] == "budget_deadline"

    class Loader:
        marker = "kept"

        def iter_eval_batches(self, n=None):
            for i in range(n):
                now[0] += 1.0
                yield i

    now[0] = 0.0
    ev = _EvalUntil(Loader(), d, margin_s=2.0)
    assert ev.marker == "kept"
    assert list(ev.iter_eval_batches(10)) == list(range(10))  # ends at 10 s of 20
    now[0] = 15.0
    assert list(ev.iter_eval_batches(10)) == [0, 1, 2]  # the first batch always; then while 2 s are left


def test_max_chars_leaves_the_validation_sources_their_own_room(tmp_path):
    """data.max_chars reached by the train text no longer leaves data.val_sources empty (a budget run
    bounds the train text it reads and scores on the user's held-out file)."""
    from lmforge.data.prepare import prepare

    (tmp_path / "train").mkdir()
    for i in range(20):
        (tmp_path / "train" / f"{i}.txt").write_text(f"document {i} " * 200)
    (tmp_path / "held.txt").write_text("held out text " * 100)
    cfg = load_config(None, [f"data.sources=[{tmp_path / 'train'}]",
                             f"data.val_sources=[{tmp_path / 'held.txt'}]",
                             "data.max_chars=5000", "data.tokenizer.vocab_size=300",
                             f"data.dir={tmp_path / 'd'}", f"run.dir={tmp_path / 'run'}"])
    meta = prepare(cfg, console=lambda _: None).meta
    assert meta["splits"]["val"]["documents"] == 1 and meta["splits"]["val"]["tokens"] > 0
    assert meta["stats"]["chars"] == 5000 + len("held out text " * 100)


def test_a_budget_given_to_main_in_python_counts_from_the_call(monkeypatch):
    """`lmforge.cli.main([...])` in a process that started long ago (a test session, a notebook) counts the
    budget from the call; a command line (argv None) counts from the process's start."""
    import lmforge.tools.planner_probe as probe
    import lmforge.tools.planner_run as planner_run
    from lmforge.cli import main

    monkeypatch.setattr(probe, "process_elapsed", lambda: 10_000.0)  # a process started hours ago
    seen = {}
    monkeypatch.setattr(planner_run, "run_budget", lambda *a, deadline, **k: seen.setdefault("d", deadline))
    assert main(["train", "--budget", "2m", "--plan-only"]) == 0
    assert 0.0 <= seen["d"].elapsed < 5.0 and seen["d"].left > 115.0
    assert probe.Deadline.from_process(120.0).elapsed >= 10_000.0  # what a command line counts


def test_overwriting_a_budget_run_replaces_the_data_prepared_for_its_plan(tmp_path):
    """`--budget` twice into one run dir with run.overwrite: the second plan's data settings differ (they
    follow the measured speed), and the old run's prepared data goes with it; a dir that is not prepared
    data is refused and left as it was."""
    from lmforge.data.prepare import prepare
    from lmforge.errors import DataError
    from lmforge.tools.planner_run import replace_stale_data

    (tmp_path / "train").mkdir()
    for i in range(10):
        (tmp_path / "train" / f"{i}.txt").write_text(f"document {i}: some words to train on " * 40)
    run = tmp_path / "run"

    def cfg(chars: int):
        return load_config(None, [f"data.sources=[{tmp_path / 'train'}]", f"data.max_chars={chars}",
                                  "data.tokenizer.vocab_size=300", f"run.dir={run}", "run.overwrite=true"])

    prepare(cfg(4000), console=lambda _: None)
    said: list[str] = []
    replace_stale_data(cfg(4000), said.append)  # the same plan's data: reused, not replaced
    assert said == [] and (run / "data" / "meta.json").is_file()
    replace_stale_data(cfg(5000), said.append)
    assert not (run / "data").exists() and said == [f"run.overwrite: replacing {run / 'data'}, prepared for "
                                                    "another plan"]
    assert prepare(cfg(5000), console=lambda _: None).meta["stats"]["chars"] == 5000
    # not prepared data: refused, untouched
    other = tmp_path / "other"
    (other / "data").mkdir(parents=True)
    (other / "data" / "mine.txt").write_text("the user's")
    mine = load_config(None, [f"data.sources=[{tmp_path / 'train'}]", f"run.dir={other}",
                              "run.overwrite=true"])
    with pytest.raises(DataError, match="holds no meta.json"):
        replace_stale_data(mine, said.append)
    assert (other / "data" / "mine.txt").read_text() == "the user's"


@pytest.mark.parametrize("keep", [True, False])
def test_the_probe_steps_as_the_run_trains(monkeypatch, keep):
    """The probe's steps run with the run's optimizer kind (fused AdamW on CPU) and its host-memory
    setting held, as Trainer.fit holds it: without both, small CPU shapes measured up to 2x slower than
    they trained and the planner sized data and model for half the tokens the run then saw."""
    import contextlib

    import torch

    import lmforge.utils.host_memory as hm
    from lmforge.models import build_model
    from lmforge.tools.planner import Shape, model_config
    from lmforge.tools.planner_probe import _step_seconds, probe_optimizer

    held = []
    real = hm.keep_freed_memory

    @contextlib.contextmanager
    def spy(enabled=True):
        with real(enabled) as took:
            held.append(enabled)
            yield took

    monkeypatch.setattr(hm, "keep_freed_memory", spy)
    cpu = torch.device("cpu")
    seconds, forward, _ = _step_seconds(Shape(32, 1, 2, 1), 256, 2, 16, cpu, "fp32", 0.0, keep)
    assert seconds > 0 and held == [keep]
    assert 0 < forward < seconds  # the evaluation's forward, timed after the steps
    opt = probe_optimizer(build_model(model_config(Shape(32, 1, 2, 1), 256, 16)).parameters(), cpu)
    assert opt.defaults["fused"] is True
