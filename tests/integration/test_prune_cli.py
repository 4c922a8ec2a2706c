"""`lmforge prune` end to end on the tiny debug model: every method through the CLI with a few recovery
steps, the output reloaded by lmforge eval / load_run / model.init_from, the report's numbers equal to
what the written weights give, and bad inputs refused with exit 2 and a clear message before anything
is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.compress.sparsity import semi_structured_ok, sparsity_stats
from lmforge.config import load_config
from lmforge.eval.open_run import evaluate, load_run
from lmforge.train.trainer import Trainer

QUIET = ["--set", "logging.progress=none", "--set", "logging.plot=false"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The tiny recipe trained 30 steps (a few seconds)."""
    root = tmp_path_factory.mktemp("prune")
    cfg = load_config(TINY, tiny_overrides(root / "run", root / "data", "train.max_steps=30",
                                           "checkpoint.every=30", "train.eval_every=0", "logging.plot=false"))
    Trainer(cfg).fit()
    return root / "run"


def _report(out: Path) -> dict:
    return json.loads((out / "prune_report.json").read_text())


@pytest.mark.parametrize(
    "args, unstructured",
    [
        (["--method", "magnitude", "--sparsity", "0.5"], True),
        (["--method", "magnitude", "--sparsity", "0.6", "--scope", "global", "--score", "wanda"], True),
        (["--method", "2:4"], True),
        (["--method", "heads", "--heads", "2"], False),
        (["--method", "channels", "--ratio", "0.5", "--score", "wanda"], False),
    ],
    ids=["magnitude", "wanda-global", "2:4", "heads", "channels"],
)
def test_prune_recover_reload(source, tmp_path, args, unstructured, capsys):
    out = tmp_path / "pruned"
    assert main(["prune", str(source), str(out), *args, "--recover-steps", "3", *QUIET]) == 0
    printed = capsys.readouterr().out
    assert "loss: before" in printed and "prune_report.json" in printed
    report = _report(out)
    run = load_run(out)
    model = run.model
    # The report's counts are the written weights' counts.
    stats = sparsity_stats(model)
    assert stats["per_layer"] == pytest.approx(report["sparsity"]["per_layer"], abs=0)
    assert report["params"]["after"]["total"] == sum(p.numel() for p in model.parameters())
    assert report["params"]["after"]["nonzero"] == sum(int((p != 0).sum()) for p in model.parameters())
    assert report["step"] == run.step == 3 and report["recovery"]["steps"] == 3
    assert report["recovery"]["lr"] == pytest.approx(3e-4)  # a tenth of the recipe's peak lr by default
    if unstructured:
        # Exactly the target sparsity after the recovery's AdamW steps (weight decay 0.1 in the recipe).
        target = 0.5 if "2:4" in args else float(args[args.index("--sparsity") + 1])
        assert stats["overall"] == pytest.approx(target, abs=1e-4)
        assert report["params"]["after"]["total"] == report["params"]["before"]["total"]
        if "2:4" in args:
            assert all(semi_structured_ok(w) for n, w in model.named_parameters() if n.endswith(
                ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w_gate.weight", "w_up.weight",
                 "w_down.weight")))
    else:
        assert report["params"]["after"]["total"] < report["params"]["before"]["total"]
        assert stats["overall"] == 0.0
        if "heads" in args:
            assert (model.cfg.n_heads, model.cfg.n_kv_heads, model.cfg.head_dim) == (2, 1, 16)
            assert report["kv_groups_removed"] == 1
        else:
            assert model.cfg.d_ff == 96
    # lmforge eval on the output measures what the report says the recovered model scores.
    ev = report["eval"]
    result = evaluate(out, say=lambda *_: None)
    assert result["loss"] == pytest.approx(ev["recovered"]["loss"], rel=1e-6)
    assert ev["before"]["tokens"] == ev["pruned"]["tokens"] == ev["recovered"]["tokens"] == result["tokens"]
    assert main(["eval", str(out)]) == 0


def test_without_recovery_the_pruned_weights_are_written_at_step_0(source, tmp_path):
    out = tmp_path / "pruned"
    assert main(["prune", str(source), str(out), "--method", "magnitude", "--sparsity", "0.3"]) == 0
    report = _report(out)
    assert report["eval"]["recovered"] is None and report["recovery"] is None and report["step"] == 0
    src_loss = evaluate(source, say=lambda *_: None)["loss"]
    assert report["eval"]["before"]["loss"] == pytest.approx(src_loss, rel=1e-6)
    written = evaluate(out, say=lambda *_: None)["loss"]
    assert written == pytest.approx(report["eval"]["pruned"]["loss"], rel=1e-6)


def test_a_pruned_run_trains_further_through_model_init_from(source, tmp_path):
    out = tmp_path / "pruned"
    assert main(["prune", str(source), str(out), "--method", "heads", "--heads", "2"]) == 0
    # init_from brings the pruned run's tokenizer, so the data is prepared again with it (its own data.dir).
    cfg = load_config(TINY, tiny_overrides(tmp_path / "next", tmp_path / "data", f"model.init_from={out}",
                                           "model.preset=null", "train.max_steps=1", "train.eval_every=0",
                                           "logging.plot=false"))
    final = Trainer(cfg).fit()
    assert final["step"] == 1
    trained = load_run(tmp_path / "next")
    assert trained.model.cfg.n_heads == 2 and trained.model.cfg.head_dim == 16


def test_recovery_config_and_set_are_applied(source, tmp_path):
    rec = tmp_path / "recovery.yaml"
    rec.write_text("optim:\n  lr: 1.0e-4\ntrain:\n  micro_batch_size: 4\n")
    out = tmp_path / "pruned"
    assert main(["prune", str(source), str(out), "--method", "channels", "--channels", "64",
                 "--recover-steps", "2", "-c", str(rec), "--set", "train.grad_accum_steps=1", *QUIET]) == 0
    cfg = load_config(out / "config.yaml")
    assert cfg.optim.lr == 1e-4 and cfg.train.micro_batch_size == 4 and cfg.train.grad_accum_steps == 1
    assert cfg.train.max_steps == 2 and cfg.model.d_ff == 128 and cfg.run.dir == str(out)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "magnitude", "--sparsity", "1.0"], "--sparsity: must be a positive number < 1"),
        (["--method", "magnitude", "--sparsity", "-0.5"], "--sparsity: must be a positive number < 1"),
        (["--method", "magnitude", "--sparsity", "0"], "--sparsity: must be a positive number < 1"),
        (["--method", "heads", "--heads", "8"], "--heads 8: the model has 4 query heads"),
        (["--method", "heads", "--heads", "1"], "give a multiple of 2"),
        (["--method", "channels", "--channels", "500"], "has 192 MLP channels"),
        (["--method", "magnitude", "--sparsity", "0.5", "--set", "optim.lr=1"], "--recover-steps"),
        (["--method", "2:4", "--recover-steps", "2", "--set", "model.d_ff=8"], "model, run and objective"),
    ],
)
def test_bad_inputs_exit_2_with_a_message(source, tmp_path, capsys, args, message):
    out = tmp_path / "pruned"
    assert main(["prune", str(source), str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".pruned*"))


def test_a_non_empty_output_dir_is_refused_and_left_alone(source, tmp_path, capsys):
    out = tmp_path / "pruned"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["prune", str(source), str(out), "--method", "2:4"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["prune", str(source), str(source), "--method", "2:4", "--overwrite"]) == 2
    assert "input of this command" in capsys.readouterr().err
    assert (source / "config.yaml").is_file()


def test_missing_source_exits_2(tmp_path, capsys):
    assert main(["prune", str(tmp_path / "nope"), str(tmp_path / "out"), "--method", "2:4"]) == 2
    err = capsys.readouterr().err
    assert "no such run" in err and "Traceback" not in err
