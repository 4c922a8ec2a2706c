"""bench/planner_stall.py (a stall of the machine during the planner's probe, two trees A/B): its summary
and its refusals (the measurement itself takes minutes: `python bench/planner_stall.py --before OLD/src`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import planner_stall as ps  # noqa: E402


def test_summary_counts_each_sides_choices_per_condition():
    rows = [{"side": "before", "condition": "stalled", "shape": "d96-L3"},
            {"side": "before", "condition": "stalled", "shape": "d96-L3"},
            {"side": "before", "condition": "quiet", "shape": "d64-L2"},
            {"side": "after", "condition": "stalled", "shape": "d64-L2"}]
    assert ps.summary(rows) == {"before": {"stalled": {"d96-L3": 2}, "quiet": {"d64-L2": 1}},
                                "after": {"stalled": {"d64-L2": 1}}}


@pytest.mark.parametrize("argv", [["--before", "/nonexistent/src"], ["--before", "src", "--runs", "0"],
                                  ["--before", "src", "--duty", "2"]])
def test_a_tree_without_lmforge_or_a_bad_count_is_refused_before_anything_runs(argv, tmp_path, capsys):
    argv = [str(REPO / a) if a == "src" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        ps.main([*argv, "--results", str(tmp_path / "r.json")])
    assert e.value.code == 2 and "--before/--after name a tree's src/" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_a_burner_spins_for_its_time_and_ends():
    import time

    t0 = time.perf_counter()
    for p in ps.burn(0.3, 1, 0.5):
        assert p.wait(timeout=30) == 0
    assert 0.3 <= time.perf_counter() - t0 < 20
