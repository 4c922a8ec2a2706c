"""The rating study's statistics against references: Wilson intervals against scipy's, Cohen's kappa against
scikit-learn's and the textbook example, Fleiss' kappa against Fleiss (1971)'s worked table."""

from __future__ import annotations

import pytest

from lmforge.jobserver.rating import Study
from lmforge.jobserver.rating_stats import (
    agreement,
    cohen_kappa,
    fleiss_kappa,
    markdown,
    preference_pairs,
    results,
    wilson,
)


@pytest.mark.parametrize(("k", "n"), [(8, 10), (0, 5), (5, 5), (37, 120), (1, 1)])
def test_wilson_matches_scipy(k, n):
    binomtest = pytest.importorskip("scipy.stats").binomtest
    ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson(k, n) == pytest.approx((ref.low, ref.high), abs=1e-9)
    assert wilson(0, 0) is None


def test_cohen_kappa_matches_textbook_and_sklearn():
    # Wikipedia's example: 50 proposals; yes/yes 20, yes/no 5, no/yes 10, no/no 15 -> kappa 0.4
    a = ["y"] * 25 + ["n"] * 25
    b = ["y"] * 20 + ["n"] * 5 + ["y"] * 10 + ["n"] * 15
    assert cohen_kappa(a, b) == pytest.approx(0.4)
    cohen_kappa_score = pytest.importorskip("sklearn.metrics").cohen_kappa_score
    a3 = list("xxyyttxyxtyxxyty")
    b3 = list("xyyytxxyttyxyyxt")
    assert cohen_kappa(a3, b3) == pytest.approx(cohen_kappa_score(a3, b3), abs=1e-12)
    assert cohen_kappa(["x", "x"], ["x", "x"]) is None  # chance agreement 1: undefined, not 0 / 0
    assert cohen_kappa([], []) is None


def test_fleiss_kappa_matches_the_worked_example():
    # Fleiss (1971) as worked on Wikipedia: 10 subjects, 14 raters, 5 categories; P = 0.378, Pe = 0.213
    table = [[0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0], [2, 2, 8, 1, 1],
             [7, 7, 0, 0, 0], [3, 2, 6, 3, 0], [2, 5, 3, 2, 2], [6, 5, 2, 1, 0], [0, 2, 2, 3, 7]]
    assert fleiss_kappa(table) == pytest.approx(0.20993, abs=5e-5)
    assert fleiss_kappa([[3, 0], [2, 1]]) is not None and fleiss_kappa([[3, 0], [1, 1]]) is None  # unequal m


def _study(raters):
    return Study(id="study-0123456789abcdef", owner="o", name="n", status="ready", error=None, created_at=0,
                 secret="s", raters=raters, labels={"x": "run-x", "y": "run|y"},
                 sources={"x": None, "y": None}, n_items=4)


def _rows(d):
    return [{"rater": r, "idx": i, "winner": w} for r, ws in d.items() for i, w in enumerate(ws)]


def test_results_count_ties_half_and_use_wilson():
    rows = _rows({"ann": ["x", "x", "tie", "y"], "bob": ["x", "tie", "tie", "y"]})
    res = results(_study(["ann", "bob"]), rows)
    ann = res["per_rater"]["ann"]
    assert (ann["x_wins"], ann["ties"], ann["y_wins"]) == (2, 1, 1)
    assert ann["win_rate_x"] == pytest.approx(2.5 / 4)
    assert ann["ci95"] == pytest.approx(list(wilson(2.5, 4)))
    assert res["pooled"]["ratings"] == 8 and res["pooled"]["win_rate_x"] == pytest.approx(4.5 / 8)
    ag = res["agreement"]
    assert ag["statistic"] == "cohen" and ag["items"] == 4
    assert ag["kappa"] == pytest.approx(cohen_kappa(["x", "x", "tie", "y"], ["x", "tie", "tie", "y"]))
    md = markdown(res)
    assert sum(res["position"].values()) == 8 and res["position"]["tie"] == 3
    assert "| pooled | 8 | 3 | 3 | 2 | 56.2% |" in md and "run\\|y" in md and "Cohen's kappa" in md


def test_agreement_uses_fleiss_for_three_raters_on_common_items():
    by = {"a": {0: "x", 1: "y", 2: "x"}, "b": {0: "x", 1: "y", 2: "tie"}, "c": {0: "x", 1: "x"}}
    ag = agreement(by)
    assert ag["statistic"] == "fleiss" and ag["items"] == 2  # item 2: c did not rate it
    assert ag["kappa"] == pytest.approx(fleiss_kappa([[3, 0, 0], [1, 2, 0]]))
    assert agreement({"a": {0: "x"}})["kappa"] is None


def test_pairs_follow_the_majority_and_skip_even_splits():
    items = [{"idx": i, "prompt": f"p{i}", "answer_x": f"x{i}", "answer_y": f"y{i}"} for i in range(4)]
    items.append({"idx": 4, "prompt": "p4", "answer_x": "same", "answer_y": "same"})
    rows = _rows({"a": ["x", "y", "x", "tie", "x"], "b": ["x", "y", "y", "tie", "x"],
                  "c": ["tie", "x", "tie", "tie", "x"]})
    pairs = preference_pairs(items, rows)
    assert pairs == [{"prompt": "p0", "chosen": "x0", "rejected": "y0"},
                     {"prompt": "p1", "chosen": "y1", "rejected": "x1"}]
