"""bench/planner_quality.py (planner vs a hand grid vs nanoGPT) and bench/corpora.py: the parts, and one
`--tiny` run of the whole comparison (slow: three 20 s runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import corpora  # noqa: E402
import planner_quality as pq  # noqa: E402


def test_the_grid_has_twelve_distinct_hand_configurations():
    assert len(pq.HAND_GRID) >= 12 and len(set(pq.HAND_GRID.values())) == len(pq.HAND_GRID)
    assert set(pq.TINY_GRID) <= set(pq.HAND_GRID)


def test_ratios_compare_the_planner_with_the_best_of_the_grid_and_nanogpt():
    rows = [{"name": "planner", "bpb": 1.1}, {"name": "d64-L2-lr0.002", "bpb": 1.0},
            {"name": "d128-L4-lr0.004", "bpb": 1.2}, {"name": "d96-L3-lr0.002", "error": "x"},
            {"name": "nanogpt", "bpb": 2.2}]
    out = pq.compare(rows)
    assert out["grid_best"] == "d64-L2-lr0.002" and out["planner_vs_grid"] == pytest.approx(1.1)
    assert out["planner_vs_nanogpt"] == pytest.approx(0.5)
    assert "planner_vs_nanogpt" not in pq.compare(rows[:3]) and "planner_mean_bpb" not in out
    # repeats of the planner: the mean of its runs as well, the first run's ratios unchanged
    two = pq.compare(rows, [{"name": "planner", "bpb": 1.3}, {"name": "d64-L2-lr0.002", "bpb": 0.5}])
    assert two["planner_mean_bpb"] == pytest.approx(1.2) and two["planner_mean_vs_grid"] == pytest.approx(1.2)
    assert two["planner_mean_vs_nanogpt"] == pytest.approx(1.2 / 2.2) and two["planner_vs_grid"] == out[
        "planner_vs_grid"]
    assert pq.table_row({"corpus": "c", "budget_s": 60, "rows": rows, **two})[2:] == [
        "1.1000 (1.2000)", "1.0000 (d64-L2-lr0.002)", "1.100 (1.200)", "0.500 (0.545)"]


def test_the_prose_corpus_is_reproducible_and_holds_out_every_20th_story(tmp_path):
    a = list(corpora.prose_documents(20_000, seed=0))
    assert a == list(corpora.prose_documents(20_000, seed=0))
    assert a != list(corpora.prose_documents(20_000, seed=1))
    train, held = corpora.materialize("prose", tmp_path, 100_000)
    n_train = len(list(train.glob("*.txt")))
    stories = held.read_text().count("Story ")
    assert stories == (n_train + stories) // corpora.HELD_OUT_EVERY and stories > 0


@pytest.mark.slow
def test_tiny_comparison_end_to_end(tmp_path):
    results = pq.main(["--tiny", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "r.json")])
    cell = results["cells"][0]
    rows = {r["name"]: r for r in cell["rows"]}
    assert set(rows) == {"planner", *pq.TINY_GRID}
    for name in pq.TINY_GRID:
        assert rows[name]["bpb"] > 0
    if "bpb" not in rows["planner"]:  # a machine too busy for 20 s says so (the integration test holds it)
        assert "too small" in rows["planner"]["error"]
    else:
        assert rows["planner"]["wall_s"] <= 21 and cell["planner_vs_grid"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["tiny"] is True


def test_resume_runs_only_the_rows_not_yet_measured(tmp_path, monkeypatch):
    calls: list[str] = []
    failing = {"d96-L3-lr0.002"}

    def fake(name, seed=pq.SEED):
        calls.append(name)
        if name in failing:
            return {"name": name, "error": "busy"}
        return {"name": name, "seed": seed, "bpb": 1.0 + len(calls)}

    monkeypatch.setattr(pq, "materialize", lambda corpus, root, chars: (tmp_path, tmp_path / "held.txt"))
    monkeypatch.setattr(pq, "run_planner", lambda *a: fake("planner", *a[5:]))
    monkeypatch.setattr(pq, "run_hand", lambda name, *a: fake(name, *a[5:]))
    args = ["--tiny", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "r.json")]
    first = pq.main(args)
    assert calls == ["planner", *pq.TINY_GRID]
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["cells"] == first["cells"]
    failing.clear()
    calls.clear()
    second = pq.main([*args, "--resume"])
    assert calls == ["d96-L3-lr0.002"]  # only the row that had failed
    rows = {r["name"]: r for r in second["cells"][0]["rows"]}
    assert set(rows) == {"planner", *pq.TINY_GRID} and all("bpb" in r for r in rows.values())
    assert second["stamp"] == first["stamp"]
    assert second["cells"][0]["grid_best"] == "d96-L3-lr0.002"  # its new bpb 2.0 beats 3.0
    calls.clear()
    pq.main(args)  # without --resume everything runs again
    assert calls == ["planner", *pq.TINY_GRID]
    calls.clear()
    rep = pq.main([*args, "--resume", "--repeat", "planner,d64-L2-lr0.004"])
    assert calls == ["planner", "d64-L2-lr0.004"]  # nothing missing: only the repeats run
    assert [r["name"] for r in rep["cells"][0]["repeats"]] == ["planner", "d64-L2-lr0.004"]
    assert {r["seed"] for r in rep["cells"][0]["rows"]} == {1337}
    rep = pq.main([*args, "--resume", "--repeat", "planner"])  # each repeat of a row: the next seed
    assert [(r["name"], r["seed"]) for r in rep["cells"][0]["repeats"]] == [
        ("planner", 1338), ("d64-L2-lr0.004", 1338), ("planner", 1339)]
    with pytest.raises(SystemExit):
        pq.main([*args, "--repeat", "d1-L1-lr9"])
    calls.clear()
    redo = pq.main([*args, "--resume", "--redo", "d64-L2-lr0.004"])
    assert calls == ["d64-L2-lr0.004"]  # only the row asked for, measured again
    assert {r["name"] for r in redo["cells"][0]["rows"]} == {"planner", *pq.TINY_GRID}
    assert [r["name"] for r in redo["cells"][0]["repeats"]] == ["planner"] * 2  # the redone row's dropped
    with pytest.raises(SystemExit):
        pq.main([*args, "--redo", "d1-L1-lr9"])
    calls.clear()
    pq.main([*args, "--resume", "--redo", "planner", "--rows", "d64-L2-lr0.004,planner"])
    assert calls == ["planner"]  # with --resume: those of them still missing
    calls.clear()
    pq.main([*args, "--rows", "d96-L3-lr0.002,planner"])  # only these, in this order
    assert calls == ["d96-L3-lr0.002", "planner"]
    with pytest.raises(SystemExit):
        pq.main([*args, "--rows", "d1-L1-lr9"])


def test_train_chars_cuts_the_training_text_into_its_own_cell(tmp_path, monkeypatch):
    src = tmp_path / "full"
    src.mkdir()
    for i, n in enumerate((400, 700, 300, 200)):
        (src / f"{i:06d}.txt").write_text("x" * n)
    cut = corpora.cut_train(src, tmp_path / "cut" / "train", 1000)
    assert sorted(p.name for p in cut.glob("*.txt")) == ["000000.txt", "000002.txt", "000003.txt"]  # 900
    assert corpora.cut_train(src, cut, 10) == cut and len(list(cut.glob("*.txt"))) == 3  # written once
    seen = []
    monkeypatch.setattr(pq, "materialize", lambda corpus, root, chars: (src, tmp_path / "held.txt"))
    monkeypatch.setattr(pq, "run_hand", lambda name, budget, train, *a: seen.append(train) or
                        {"name": name, "seed": pq.SEED, "bpb": 1.0})
    got = pq.main(["--budgets", "30s", "--corpora", "python", "--train-chars", "1000", "--rows",
                   "d64-L2-lr0.004", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "r.json")])
    assert [c["corpus"] for c in got["cells"]] == ["python-1k"]
    assert seen == [tmp_path / "runs" / "corpora" / "python-1k" / "train"]
    assert sum(len(p.read_text()) for p in seen[0].glob("*.txt")) == 900


def test_a_repeat_at_another_seed_prepares_and_trains_at_that_seed(tmp_path, monkeypatch):
    seen: list[list[str]] = []

    def fake_lmforge(*args, timeout=None):
        seen.append(list(args))
        return type("Done", (), {"returncode": 1, "stderr": "stop here"})()

    monkeypatch.setattr(pq, "lmforge", fake_lmforge)
    for seed, data in ((pq.SEED, "data-v4096"), (1338, "data-v4096-s1338")):
        seen.clear()
        assert pq.run_hand("d64-L2-lr0.004", 20.0, tmp_path, tmp_path / "h.txt", tmp_path, [], seed)["error"]
        assert f"data.dir={tmp_path / data}" in seen[0] and f"run.seed={seed}" in seen[0]
        seen.clear()
        assert pq.run_planner(20.0, tmp_path, tmp_path / "h.txt", tmp_path, [], seed)["error"]
        assert f"run.seed={seed}" in seen[0]


def test_nanogpt_keeps_its_2000_iterations_and_stretches_its_cosine_to_a_longer_budget():
    assert pq.schedule_iters(90.0, 0.05, 100, 2000) == 2000  # 1,864 fit: the recipe (clock ends it)
    assert pq.schedule_iters(100.0, 0.05, 100, 2000) == 2060
    assert pq.schedule_iters(290.0, 0.05, 100, 2000) == 100 + int(0.98 * 290 / 0.05)  # 5,784


def test_progress_reads_steps_and_tokens_of_the_last_training_row(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "loss": 5.0, "tokens_seen": 40960}\n'
                                            '{"step": 20, "loss": 4.0, "tokens_seen": 81920}\n'
                                            '{"step": 21, "val_loss": 3.9}\n')
    assert pq.progress(tmp_path) == {"steps": 20, "tokens": 81920}
    assert pq.progress(tmp_path / "none") == {}


def test_kjv_chapters_are_documents_with_one_line_per_verse():
    text = ("\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n"
            "  2 And the earth was without form,\nand void.\n\n"
            "1 Samuel 3\n\n  1 And the child Samuel ministered.\n")
    assert corpora.kjv_chapters(text) == [
        "Genesis 1\n\n1 In the beginning God created the heaven and the earth.\n2 And the earth was without "
        "form, and void.\n", "1 Samuel 3\n\n1 And the child Samuel ministered.\n"]
    assert "kjv" in corpora.CORPORA


def test_the_law_scan_recovers_a_law_and_says_what_it_would_choose():
    """bench/planner_law_scan.py: points made by a law on the scan's grid give that law back (A and B by least
    squares, rms ~0), and each cell's first is the shape that law's loss ranks first, its regret the first's
    bpb over the cell's best."""
    import numpy as np

    import planner_law_scan as scan
    from lmforge.tools.planner import effective_tokens

    true = dict(E=1.0, A=200.0, B=300.0, alpha=0.5, beta=0.3, h=4.0)

    def loss(n, tokens, distinct):
        return true["E"] + true["A"] / n ** true["alpha"] + true["B"] / effective_tokens(
            tokens, distinct, true["h"]) ** true["beta"]

    shapes = [(1e5, 2e7), (3e5, 1.2e7), (8e5, 7e6), (3e6, 3e6)]  # (N, tokens) at one budget, corpus 2.5M
    points = [{"n": n, "tokens": t * k, "train_tokens": 2.5e6, "loss": loss(n, t * k, 2.5e6)}
              for k in (0.15, 0.4, 1.0) for n, t in shapes]
    # one cell whose measured order is the law's, one where the measured best is not the law's first
    at = [loss(n, t, 2.5e6) for n, t in shapes]
    order = sorted(range(4), key=at.__getitem__)
    cells = [{"corpus": "right", "budget_s": 900.0,
              "shapes": [(shapes[i][0], shapes[i][1], 2.5e6, at[i]) for i in order]},
             {"corpus": "wrong", "budget_s": 900.0,
              "shapes": [(shapes[i][0], shapes[i][1], 2.5e6, 1.0 + 0.1 * j) for j, i in
                         enumerate([order[1], order[0], *order[2:]])]}]
    grid = dict(E=np.array([0.5, 1.0, 1.5]), alpha=np.array([0.4, 0.5, 0.6]), beta=np.array([0.2, 0.3, 0.4]))
    laws = scan.scan(points, cells, grid, half_lives=(2.0, 4.0, 15.4))
    best = laws[0]
    assert best["rms"] < 1e-9 and best["repeat_half_life"] == 4.0
    assert (best["E"], best["alpha"], best["beta"]) == (1.0, 0.5, 0.3)
    assert best["A"] == pytest.approx(200.0, rel=1e-6) and best["B"] == pytest.approx(300.0, rel=1e-6)
    judged = scan.judged(best, cells)
    assert judged["pattern"] == "Yn"  # in "wrong", the law's first is measured second best: 10% worse
    assert judged["regret_pct"] == {"right 900s": 0.0, "wrong 900s": 10.0}
    assert all(later["rms"] >= best["rms"] for later in laws)
