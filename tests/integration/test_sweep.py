"""`lmforge sweep` end to end on tiny debug runs (a 2 x 2 grid, resumed; a failed point trained again),
`lmforge scaling fit` on its runs, the Ray backend (slow tier), and hostile sweep arguments (unknown keys,
escaping or clashing out dirs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import CORPUS, TINY
from lmforge.cli import main
from lmforge.metrics.loggers import read_metrics


def base_sets(data_dir: Path, *extra: str) -> list[str]:
    items = [f"data.dir={data_dir}", f"data.sources=[{CORPUS}]", "data.max_chars=null",
             "logging.progress=none", "logging.plot=false", "train.eval_every=2", "train.eval_batches=2",
             "checkpoint.every=0", *extra]
    return sum((["--set", o] for o in items), [])


def sweep_args(out: Path, data_dir: Path, *grid: str, base: Path = TINY) -> list[str]:
    return ["sweep", "-c", str(base), *base_sets(data_dir), *sum((["--grid", g] for g in grid), []),
            "--out", str(out)]


@pytest.mark.slow  # 20 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_grid_sweep_resumes_and_scaling_fit_reads_it(tmp_path, shared_data_dir, capsys):
    out, base = tmp_path / "sweep", tmp_path / "base.yaml"
    base.write_text(TINY.read_text())
    grid = ("model.d_model=32,64", "train.max_steps=4,8")
    args = sweep_args(out, shared_data_dir, *grid, base=base) + ["--parallel", "2"]
    assert main(args) == 0
    summary = json.loads((out / "sweep.json").read_text())
    runs = summary["runs"]
    assert [r["point"] for r in runs] == [{"model.d_model": d, "train.max_steps": s} for d in (32, 64)
                                          for s in (4, 8)]
    for r in runs:
        run_dir = Path(r["run_dir"])
        assert r["status"] == "done" and run_dir.parent == out.resolve()
        records = read_metrics(run_dir / "metrics.jsonl")
        vals = [x for x in records if "val_loss" in x]
        assert r["final_loss"] == vals[-1]["val_loss"] and vals[-1]["step"] == r["point"]["train.max_steps"]
        assert (run_dir / "config.yaml").read_text().count(f"d_model: {r['point']['model.d_model']}") == 1
    stamps = {r["name"]: (Path(r["run_dir"]) / "metrics.jsonl").stat().st_mtime_ns for r in runs}
    capsys.readouterr()

    # the same command again skips every finished point and trains nothing, also after the base file
    # changed in comments only
    base.write_text("# a note on this sweep\n" + base.read_text())
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("skip ") == 4
    assert stamps == {r["name"]: (Path(r["run_dir"]) / "metrics.jsonl").stat().st_mtime_ns for r in runs}
    # a base whose settings changed is another sweep: refused, the runs left as they were
    base.write_text(base.read_text().replace("seed: 1337", "seed: 7"))
    assert main(args) == 2
    assert "another base config" in capsys.readouterr().err
    assert json.loads((out / "sweep.json").read_text()) == summary

    # scaling fit on the sweep: every evaluation as a point (final ones alone are only 4)
    fit, plots = tmp_path / "fit.json", tmp_path / "plots"
    code = main(["scaling", "fit", *[r["run_dir"] for r in runs], "--all-evals", "--out", str(fit), "--plot",
                 str(plots), "--bootstrap", "0", "--predict", "N=2e5,D=1e5", "--check", runs[-1]["run_dir"]])
    assert code == 0
    record = json.loads(fit.read_text())
    assert len(record["points"]) == 2 + 4 + 2 + 4  # evaluations at steps 2, 4 (and 6, 8)
    law = record["law"]
    assert all(law[k] > 0 for k in ("E", "A", "B", "alpha", "beta"))
    assert record["rms_log_residual"] < 0.05
    (pred,) = record["predictions"]
    expected = law["E"] + law["A"] / 2e5 ** law["alpha"] + law["B"] / 1e5 ** law["beta"]
    assert pred["loss"] == pytest.approx(expected, rel=1e-12)
    (check,) = record["checks"]
    assert check["loss"] == runs[-1]["final_loss"]
    for png in ("scaling_isoloss.png", "scaling_isoflop.png"):
        assert (plots / png).stat().st_size > 10_000
    # the fit file is a law `scaling plan` takes
    assert main(["scaling", "plan", "--law", str(fit), "--params", "3e5", "-c", str(TINY),
                 "--out", str(tmp_path / "plan.yaml")]) == 0
    assert "d_model" in (tmp_path / "plan.yaml").read_text()


@pytest.mark.slow  # 13 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_a_failed_point_is_trained_again_over_its_dir(tmp_path, shared_data_dir):
    out = tmp_path / "sweep"
    assert main(sweep_args(out, shared_data_dir, "train.max_steps=2")) == 0
    (run,) = json.loads((out / "sweep.json").read_text())["runs"]
    assert run["status"] == "done" and run["final_loss"] > 0
    # a point that failed (here: marked so, its checkpoints gone) is trained again, over its old dir
    summary = json.loads((out / "sweep.json").read_text())
    summary["runs"][0]["status"] = "failed"
    (out / "sweep.json").write_text(json.dumps(summary))
    shutil.rmtree(Path(run["run_dir"]) / "checkpoints")
    before = (Path(run["run_dir"]) / "metrics.jsonl").stat().st_mtime_ns
    assert main(sweep_args(out, shared_data_dir, "train.max_steps=2")) == 0
    (again,) = json.loads((out / "sweep.json").read_text())["runs"]
    assert again["status"] == "done" and again["final_loss"] == pytest.approx(run["final_loss"], abs=1e-6)
    assert (Path(run["run_dir"]) / "metrics.jsonl").stat().st_mtime_ns > before
    assert any((Path(run["run_dir"]) / "checkpoints").iterdir())


# slow tier: starting Ray costs about 10 s on 2 cores; the sweep's points, their records and the retry of a
# failed one are the default tier's (the tests above), Ray itself is (test_curate's Ray engine)
@pytest.mark.slow
def test_ray_backend_runs_a_point(tmp_path, shared_data_dir):
    pytest.importorskip("ray")
    out, local = tmp_path / "sweep", tmp_path / "local"
    assert main(sweep_args(out, shared_data_dir, "train.max_steps=2") + ["--backend", "ray"]) == 0
    (run,) = json.loads((out / "sweep.json").read_text())["runs"]
    assert run["status"] == "done" and run["final_loss"] > 0
    assert Path(run["run_dir"]).parent == out.resolve()
    assert any((Path(run["run_dir"]) / "checkpoints").iterdir())
    # the same point trained by the local backend ends with the same loss
    assert main(sweep_args(local, shared_data_dir, "train.max_steps=2")) == 0
    (same,) = json.loads((local / "sweep.json").read_text())["runs"]
    assert same["final_loss"] == pytest.approx(run["final_loss"], abs=1e-6)


def test_hostile_sweep_arguments_exit_2_and_start_nothing(tmp_path, shared_data_dir, capsys):
    out = tmp_path / "sweep"
    # a grid key that does not exist: named, before any run starts
    assert main(sweep_args(out, shared_data_dir, "model.d_modl=32,64")) == 2
    err = capsys.readouterr().err
    assert "model.d_modl" in err and "did you mean 'd_model'" in err and "Traceback" not in err
    assert not out.exists()
    # a bad value for a real key
    assert main(sweep_args(tmp_path / "s2", shared_data_dir, "train.max_steps=4,-1")) == 2
    assert "train.max_steps" in capsys.readouterr().err
    # the sweep sets run.* itself: a grid over it (e.g. to aim a run elsewhere) is refused
    assert main(sweep_args(tmp_path / "s3", shared_data_dir, "run.dir=/tmp/elsewhere")) == 2
    assert "run.dir" in capsys.readouterr().err
    # --out is a file / a non-empty dir that is not a sweep: refused, left as it was
    afile = tmp_path / "afile"
    afile.write_text("keep")
    assert main(sweep_args(afile, shared_data_dir, "train.max_steps=2")) == 2
    assert "not a directory" in capsys.readouterr().err and afile.read_text() == "keep"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(sweep_args(other, shared_data_dir, "train.max_steps=2")) == 2
    assert "not a sweep" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    # a sweep dir of another base config is not resumed with this one
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "sweep.json").write_text(json.dumps({"identity": {"config": "/elsewhere.yaml"}, "runs": []}))
    assert main(sweep_args(clash, shared_data_dir, "train.max_steps=2")) == 2
    assert "another base config" in capsys.readouterr().err
    # values that would make path-like names stay inside the sweep dir (checked without training)
    from lmforge.tools.sweep import point_name

    assert (out / point_name({"x.y": "../../escape"})).resolve().parent == out.resolve()


def test_scaling_cli_refuses_bad_input(tmp_path, capsys):
    assert main(["scaling", "fit", str(tmp_path)]) == 2
    assert "not a run dir" in capsys.readouterr().err
    assert main(["scaling", "plan", "--compute", "1e18", "--law", "nope"]) == 2
    assert "not a known law" in capsys.readouterr().err
    assert main(["scaling", "plan", "--compute", "-5"]) == 2
    assert "positive" in capsys.readouterr().err
