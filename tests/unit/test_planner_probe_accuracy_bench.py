"""bench/planner_probe_accuracy.py (the planner's probe against the speed a shape then trains at): its
summary and its refusals (the measurement itself takes minutes: `python bench/planner_probe_accuracy.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import planner_probe_accuracy as ppa  # noqa: E402


def test_summary_gives_each_shapes_median_and_range_of_both_ratios():
    rows = [{"shape": "d64-L2", "probe_ratio": 1.0, "median_ratio": 1.2, "warm_min_ratio": 1.0},
            {"shape": "d96-L3", "probe_ratio": 0.9, "median_ratio": 0.7, "warm_min_ratio": 1.0},
            {"shape": "d64-L2", "probe_ratio": 1.1, "median_ratio": 1.1, "warm_min_ratio": 1.0},
            {"shape": "d64-L2", "probe_ratio": 0.95, "median_ratio": 1.3, "warm_min_ratio": 1.0}]
    out = ppa.summary(rows)
    assert list(out) == ["d64-L2", "d96-L3"]
    assert out["d64-L2"]["probe_ratio"] == {"median": 1.0, "low": 0.95, "high": 1.1}
    assert out["d64-L2"]["median_ratio"] == {"median": 1.2, "low": 1.1, "high": 1.3}
    assert out["d96-L3"]["probe_ratio"] == {"median": 0.9, "low": 0.9, "high": 0.9}


@pytest.mark.parametrize("argv", [["--shapes", "d64-L9"], ["--rounds", "0"], ["--seconds", "1"]])
def test_a_shape_off_the_ladder_or_a_round_too_few_is_refused_before_anything_runs(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ppa.main([*argv, "--results", str(tmp_path / "r.json")])
    assert e.value.code == 2 and "--shapes from d64-L2" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
