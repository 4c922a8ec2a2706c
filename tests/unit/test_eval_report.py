"""The eval report's parts a reader sees: the reliability diagram (what its dots are, how many predictions
each bin holds, a readable size) and the report's line on --limit."""

from __future__ import annotations

import matplotlib.figure
import numpy as np
import pytest
from PIL import Image

from lmforge.eval import metrics as M
from lmforge.eval.harness import write_report


@pytest.fixture
def figures(monkeypatch):
    """Every matplotlib figure saved while the test runs (to read its labels and texts)."""
    saved = []
    save = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return saved


@pytest.mark.parametrize("adaptive", [False, True])
def test_reliability_diagram_says_what_its_dots_are_and_counts_each_bin(tmp_path, figures, adaptive):
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.25, 1.0, 300)
    hit = (rng.uniform(size=300) < conf).astype(float)
    path = M.reliability_diagram(conf, hit, tmp_path / "r.png", "t", adaptive=adaptive)
    (fig,) = figures
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert "bin mean confidence" not in labels  # the dots are accuracies, placed at the mean confidence
    assert "bin accuracy at the bin's mean confidence" in labels
    bins = M.calibration_bins(conf, hit, 10, adaptive)
    shown = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert shown == [f"{n:,}" for n in bins.count if n > 0]
    assert sum(int(s.replace(",", "")) for s in shown) == 300
    with Image.open(path) as png:
        assert png.size == (640, 800)  # was 450 x 450: too small to read the labels


@pytest.mark.parametrize(
    ("limit", "line"),
    [
        (100.0, "Few-shot seed 1234, first 100 documents per task."),  # --limit 100 arrives as a float
        (7, "Few-shot seed 1234, first 7 documents per task."),
        (0.25, "Few-shot seed 1234, the first 25% of each task's documents."),
        (None, "Few-shot seed 1234."),
    ],
)
def test_report_states_the_limit_as_given(tmp_path, limit, line):
    out = {"step": 3, "weights": "model", "weights_from": "w", "seed": 1234, "limit": limit}
    text = write_report(tmp_path, "step_00000003", out, []).read_text()
    assert f"Weights: `w`. {line}\n" in text
