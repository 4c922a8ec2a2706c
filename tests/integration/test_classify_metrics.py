"""The classification and regression metrics of `lmforge classify --report` against their references:
scikit-learn's accuracy, macro-F1, MCC and per-class precision / recall / F1 (zero_division=0), and
scipy's Pearson and Spearman (ties averaged), within 1e-12, on random, imbalanced and degenerate cases."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from lmforge.assembly.methods.classify import balanced_weights
from lmforge.eval.classification_metrics import classification_metrics, regression_metrics


def _cases():
    rng = np.random.default_rng(0)
    yield "random", rng.integers(0, 4, 300), rng.integers(0, 4, 300), 4
    truth = rng.choice(3, 200, p=[0.8, 0.15, 0.05])
    yield "imbalanced", truth, np.where(rng.random(200) < 0.7, truth, rng.integers(0, 3, 200)), 3
    yield "one class predicted", rng.integers(0, 2, 50), np.zeros(50, dtype=int), 2
    yield "perfect", np.arange(10) % 5, np.arange(10) % 5, 5
    yield "absent class", rng.integers(0, 2, 40), rng.integers(0, 2, 40), 4  # classes 2, 3 never occur


@pytest.mark.parametrize("name,truth,pred,k", list(_cases()), ids=[c[0] for c in _cases()])
def test_classification_metrics_equal_scikit_learn(name, truth, pred, k):
    out = classification_metrics(truth, pred, k)
    assert out["accuracy"] == pytest.approx(skm.accuracy_score(truth, pred), abs=1e-12)
    assert out["macro_f1"] == pytest.approx(skm.f1_score(truth, pred, average="macro", zero_division=0),
                                            abs=1e-12)
    assert out["mcc"] == pytest.approx(skm.matthews_corrcoef(truth, pred), abs=1e-12)
    p, r, f, s = skm.precision_recall_fscore_support(truth, pred, labels=list(range(k)), zero_division=0)
    for c, row in enumerate(out["per_class"]):
        assert (row["precision"], row["recall"], row["f1"], row["support"]) == pytest.approx(
            (p[c], r[c], f[c], s[c]), abs=1e-12)


def test_regression_metrics_equal_scipy():
    rng = np.random.default_rng(1)
    truth = rng.normal(size=200)
    pred = truth + rng.normal(scale=0.5, size=200)
    tied = np.round(truth * 2) / 2, np.round(pred)  # many ties: ranks averaged
    for t, p in ((truth, pred), tied):
        out = regression_metrics(t, p)
        assert out["pearson"] == pytest.approx(stats.pearsonr(t, p).statistic, abs=1e-12)
        assert out["spearman"] == pytest.approx(stats.spearmanr(t, p).statistic, abs=1e-12)
        assert out["mse"] == pytest.approx(skm.mean_squared_error(t, p), abs=1e-12)
    assert np.isnan(regression_metrics(truth, np.ones(200))["pearson"])  # a constant side, as scipy


def test_balanced_class_weights_equal_scikit_learn():
    from sklearn.utils.class_weight import compute_class_weight

    labels = np.array([0] * 70 + [1] * 20 + [2] * 10)
    want = compute_class_weight("balanced", classes=np.arange(3), y=labels)
    assert balanced_weights(labels, 3) == pytest.approx(list(want), abs=1e-12)
