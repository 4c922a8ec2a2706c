"""Metrics of a classifier or regressor over a whole split, and `lmforge classify --report`.

Classification, from the confusion matrix C (C[i, j]: examples of true class i predicted j), with
scikit-learn's definitions (tests/integration/test_classify_metrics.py compares them within 1e-12):
accuracy; per-class precision C[k,k] / sum_i C[i,k], recall C[k,k] / sum_j C[k,j] and their F1 (0 where a
denominator is 0, sklearn's zero_division=0); macro-F1, the unweighted mean of the per-class F1 over the
classes that occur in the labels or the predictions (sklearn's `labels=None`); and the multiclass
Matthews correlation (Gorodkin's R_K, sklearn's matthews_corrcoef). Regression: Pearson's r and
Spearman's rho (Pearson of the average ranks, ties averaged; scipy's pearsonr / spearmanr), MSE.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch


def confusion(y_true: np.ndarray, y_pred: np.ndarray, num_labels: int) -> np.ndarray:
    """C (num_labels, num_labels) of counts, int64."""
    idx = np.asarray(y_true, dtype=np.int64) * num_labels + np.asarray(y_pred, dtype=np.int64)
    return np.bincount(idx, minlength=num_labels * num_labels).reshape(num_labels, num_labels)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(a.shape, dtype=np.float64), where=b > 0)


def classification_metrics(y_true, y_pred, num_labels: int) -> dict[str, Any]:
    """accuracy, macro_f1, mcc and per_class [{precision, recall, f1, support}] of the predictions."""
    c = confusion(y_true, y_pred, num_labels).astype(np.float64)
    tp, pred, true = np.diag(c), c.sum(0), c.sum(1)
    precision, recall = _ratio(tp, pred), _ratio(tp, true)
    f1 = _ratio(2 * precision * recall, precision + recall)
    present = (pred + true) > 0  # sklearn averages over the labels seen in y_true or y_pred
    n = c.sum()
    cov_yp = tp.sum() * n - true @ pred
    cov_yy, cov_pp = n * n - true @ true, n * n - pred @ pred
    mcc = 0.0 if cov_yy * cov_pp == 0 else float(cov_yp / math.sqrt(cov_yy * cov_pp))
    return {
        "examples": int(n),
        "accuracy": float(tp.sum() / n) if n else 0.0,
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
        "mcc": mcc,
        "per_class": [{"precision": float(precision[k]), "recall": float(recall[k]), "f1": float(f1[k]),
                       "support": int(true[k])} for k in range(num_labels)],
    }


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given their average rank (scipy.stats.rankdata's 'average')."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    first = np.concatenate([[True], sorted_x[1:] != sorted_x[:-1]])
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    ends = np.concatenate([starts[1:], [len(x)]])
    avg = (starts + ends + 1) / 2.0  # mean of the 1-based positions start+1 .. end
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = avg[group]
    return ranks


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    dx, dy = x - x.mean(), y - y.mean()
    denom = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float("nan") if denom == 0 else float(np.clip((dx @ dy) / denom, -1.0, 1.0))


def regression_metrics(y_true, y_pred) -> dict[str, float]:
    """pearson, spearman (nan for a constant side, as scipy) and mse."""
    t, p = np.asarray(y_true, dtype=np.float64), np.asarray(y_pred, dtype=np.float64)
    return {"examples": len(t), "pearson": _pearson(t, p), "spearman": _pearson(_ranks(t), _ranks(p)),
            "mse": float(np.mean((t - p) ** 2)) if len(t) else 0.0}


@torch.no_grad()
def predictions(run, max_batches: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(labels, predictions) of the run's evaluation loader: class indices, or numbers for a regressor."""
    from lmforge.engine.objectives.classify import classify_logits

    model, truth, preds = run.model, [], []
    model.eval()
    for batch in run.val_loader.iter_eval_batches(max_batches):
        batch = batch.to(run.device)
        logits = classify_logits(model, batch.input_ids, batch.lengths, batch.token_types)
        preds.append((logits.squeeze(-1) if logits.size(-1) == 1 else logits.argmax(-1)).cpu().numpy())
        truth.append(batch.labels.cpu().numpy())
    return np.concatenate(truth), np.concatenate(preds)


def split_report(run, max_batches: int | None = None) -> dict[str, Any]:
    """The metrics of the run's evaluation split, with the class names of its label map."""
    truth, preds = predictions(run, max_batches)
    n = run.cfg.model.num_labels
    if n == 1:
        return regression_metrics(truth, preds)
    out = classification_metrics(truth, preds, n)
    from lmforge.data import data_dir
    from lmforge.data.labelled import load_prepared_labelled

    labels = load_prepared_labelled(data_dir(run.cfg)).labels
    for k, row in enumerate(out["per_class"]):
        row["label"] = labels[k] if k < len(labels) else k
    return out


def report(cfg, say=print) -> dict[str, Any]:
    """`lmforge classify --report`: the run at run.dir evaluated on eval.split, printed and written to
    classify_<split>_step_N.json in the run dir."""
    from lmforge.assembly import build_run
    from lmforge.checkpoint.runs import run_config
    from lmforge.config.methods import method_facts
    from lmforge.errors import ConfigError
    from lmforge.utils.io import atomic_write_json

    saved, source = run_config(cfg.run.dir, [f"eval.split={cfg.eval.split}"])
    if method_facts(saved).data != "labelled" or not saved.model.score_head:
        raise ConfigError(f"{cfg.run.dir} is a run of objective {saved.objective.name}, not a classifier: "
                          "--report evaluates the run.dir of an `lmforge classify` run")
    run = build_run(saved, "eval", weights_from=source)
    out = {"step": run.step, "split": saved.eval.split, **split_report(run, saved.eval.max_batches)}
    written = Path(run.run_dir) / f"classify_{saved.eval.split}_step_{run.step:08d}.json"
    atomic_write_json(written, out)
    say(format_report(out))
    say(f"results: {written}")
    return out


def format_report(out: dict[str, Any]) -> str:
    head = f"{out['split']} ({out['examples']:,} examples, step {out['step']}): "
    if "pearson" in out:
        return head + f"pearson {out['pearson']:.4f}  spearman {out['spearman']:.4f}  mse {out['mse']:.4f}"
    lines = [head + f"accuracy {out['accuracy']:.4f}  macro-F1 {out['macro_f1']:.4f}  mcc {out['mcc']:.4f}",
             f"  {'label':<20} {'precision':>9} {'recall':>9} {'f1':>9} {'support':>8}"]
    for row in out["per_class"]:
        lines.append(f"  {json.dumps(row['label'])[:20]:<20} {row['precision']:>9.4f} {row['recall']:>9.4f} "
                     f"{row['f1']:>9.4f} {row['support']:>8}")
    return "\n".join(lines)
