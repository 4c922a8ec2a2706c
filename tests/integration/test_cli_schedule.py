"""`lmforge plot-schedule` and `lmforge lr-find` end to end: the PNG they write, the numbers they
print, and the run dir they must never create."""

from __future__ import annotations

import math
import re

import pytest
from PIL import Image

from conftest import CORPUS, TINY, tiny_overrides
from lmforge.cli import main

PEAK = 3e-3  # optim.lr of configs/debug/tiny.yaml: 40 steps, warm-up 5, cosine to 0.1, 2 x 8 x 64 tokens/step


def sets(*overrides: str) -> list[str]:
    return sum((["--set", o] for o in overrides), [])


def png_size(path) -> tuple[int, int]:
    with Image.open(path) as img:
        assert img.format == "PNG"
        size = img.size
        img.verify()
    return size


def printed(out: str, label: str) -> str:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return line[len(label):].strip()


def test_plot_schedule_in_steps(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plot-schedule", "-c", str(TINY), *sets(f"run.dir={tmp_path / 'run'}")]) == 0
    out = capsys.readouterr().out
    final = PEAK * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 34 / 35)))  # step 39: 34 of 35 decay steps
    assert printed(out, "peak lr") == f"{PEAK:.4e} at step 5"
    assert printed(out, "warm-up end") == "step 5 (5,120 tokens seen)"
    assert printed(out, "final lr") == f"{final:.4e} at step 39"
    assert "40 steps, 40,960 tokens" in out
    assert png_size(tmp_path / "schedule.png") == (880, 352)  # the default: the current dir, one panel
    assert not (tmp_path / "run").exists()


def test_plot_schedule_in_tokens_draws_both_axes(tmp_path, capsys):
    out_png = tmp_path / "figs" / "tok.png"
    args = sets(f"run.dir={tmp_path / 'run'}", "schedule.unit=tokens", "schedule.warmup_steps=null",
                "schedule.warmup_tokens=2560", "schedule.name=constant_cooldown",
                "schedule.decay_shape=linear", "schedule.cooldown_fraction=0.5", "schedule.min_lr_ratio=0.0")
    assert main(["plot-schedule", "-c", str(TINY), *args, "-o", str(out_png)]) == 0
    out = capsys.readouterr().out
    # 1024 tokens/step: step 2 has seen 2048 < 2560, step 3 3072. The cooldown spans tokens 20480..40960;
    # the last step has seen 39936, (40960 - 39936) / 20480 = 0.05 of it left.
    assert printed(out, "warm-up end") == "step 3 (3,072 tokens seen)"
    assert printed(out, "peak lr") == f"{PEAK:.4e} at step 3"
    assert printed(out, "final lr") == f"{PEAK * 0.05:.4e} at step 39"
    assert png_size(out_png) == (880, 704)  # lr against steps and against tokens
    assert not (tmp_path / "run").exists()


def test_plot_schedule_reports_a_warm_up_longer_than_the_run(tmp_path, capsys):
    args = sets(f"run.dir={tmp_path / 'run'}", "schedule.warmup_steps=100")
    assert main(["plot-schedule", "-c", str(TINY), *args, "-o", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert printed(out, "warm-up end") == "not reached within the run"
    assert printed(out, "peak lr") == f"{PEAK * 39 / 100:.4e} at step 39"


def test_plot_schedule_refuses_mixed_units(tmp_path, capsys):
    args = sets(f"run.dir={tmp_path / 'run'}", "schedule.unit=tokens", "schedule.warmup_tokens=1000")
    assert main(["plot-schedule", "-c", str(TINY), *args, "-o", str(tmp_path / "s.png")]) == 2
    err = capsys.readouterr().err
    assert "schedule.warmup_steps counts steps but schedule.unit=tokens" in err and "Traceback" not in err
    assert not (tmp_path / "s.png").exists() and not (tmp_path / "run").exists()


def test_lr_find_without_a_data_dir_leaves_no_run_dir(tmp_path, capsys, monkeypatch):
    """data.dir unset: the data would live in <run.dir>/data, so a throwaway copy is prepared instead."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    args = sets(f"run.dir={run}", "data.dir=null", f"data.sources=[{CORPUS}]", "data.max_chars=null",
                "train.grad_accum_steps=1")
    sweep = ["--min-lr", "1e-3", "--max-lr", "1e3", "--steps", "30"]
    assert main(["lr-find", "-c", str(TINY), *args, *sweep]) == 0
    out = capsys.readouterr().out
    lrs = {k: float(v) for k, v in re.findall(r"(steepest descent|minimum / 10)\s*│\s*([0-9.e+-]+)", out)}
    assert set(lrs) == {"steepest descent", "minimum / 10"}
    assert all(1e-3 < v < 1e3 for v in lrs.values())
    taken, how = re.search(r"(\d+) of 30 steps \((diverged|ran to the end)\)", out).groups()
    assert (how == "ran to the end") == (taken == "30")
    png_size(tmp_path / "lr_find.png")
    assert not run.exists()


def test_lr_find_shares_the_data_cache(tmp_path, shared_data_dir, capsys):
    args = sets(*tiny_overrides(tmp_path / "run", shared_data_dir, "train.grad_accum_steps=1"))
    out_png = tmp_path / "lr.png"
    assert main(["lr-find", "-c", str(TINY), *args, "--steps", "8", "-o", str(out_png)]) == 0
    assert (shared_data_dir / "meta.json").exists() and png_size(out_png)
    assert not (tmp_path / "run").exists()
    assert main(["lr-find", "-c", str(TINY), *args, "--min-lr", "1", "--max-lr", "0.1"]) == 2
    assert "--min-lr" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["plot-schedule", "lr-find"])
def test_verbs_are_listed(verb, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert verb in capsys.readouterr().out
