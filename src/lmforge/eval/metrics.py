"""Scores of evaluation outputs: exact match, token F1, BLEU / chrF (sacrebleu), ROUGE (rouge-score),
pass@k, and calibration (expected calibration error with equal-width or adaptive bins, Brier score,
reliability diagrams).

The string metrics follow the tools users compare against: `exact_match` is Hugging Face evaluate's
(the metric lm-evaluation-harness uses), `token_f1` is SQuAD's, BLEU and chrF are sacrebleu's corpus
scores (lm-evaluation-harness's `bleu` and `chrf`), ROUGE is Google's rouge-score package. sacrebleu
and rouge-score are the `eval` extra (`pip install 'lmforge[eval]'`), imported when first used.
"""

from __future__ import annotations

import collections
import math
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.errors import LmforgeError
from lmforge.utils.safe_regex import compile_regex

_PUNCT_TABLE = str.maketrans("", "", string.punctuation)
_DIGIT_TABLE = str.maketrans("", "", string.digits)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def _require(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise LmforgeError(
            f"this metric needs the {package} package: pip install 'lmforge[eval]' (or pip install {package})"
        ) from None


# ------------------------------------------------------------------------------------- string match


def exact_match(
    prediction: str,
    references: str | Sequence[str],
    *,
    ignore_case: bool = False,
    ignore_punctuation: bool = False,
    ignore_numbers: bool = False,
    regexes_to_ignore: Sequence[str] = (),
) -> float:
    """1.0 when the prediction equals a reference after the optional normalisation, else 0.0.

    The normalisation is Hugging Face evaluate's `exact_match`, in its order: each regex removed, then
    case folded, then punctuation, then digits removed. Several references: a match with any counts."""
    refs = [references] if isinstance(references, str) else list(references)

    def norm(s: str) -> str:
        for pattern in regexes_to_ignore:  # from a task file: under the regex time budget
            s = compile_regex(pattern, "exact_match's regexes_to_ignore").sub("", s)
        if ignore_case:
            s = s.lower()
        if ignore_punctuation:
            s = s.translate(_PUNCT_TABLE)
        if ignore_numbers:
            s = s.translate(_DIGIT_TABLE)
        return s

    p = norm(prediction)
    return float(any(p == norm(r) for r in refs))


def squad_normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCT_TABLE)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, references: str | Sequence[str]) -> float:
    """SQuAD's token-overlap F1 between normalised prediction and reference (the best reference)."""
    refs = [references] if isinstance(references, str) else list(references)
    pred = squad_normalize(prediction).split()
    best = 0.0
    for ref in refs:
        gold = squad_normalize(ref).split()
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
        if common:
            precision, recall = common / len(pred), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def _reference_streams(references: Sequence[str | Sequence[str]]) -> list[list[str]]:
    """Per-document reference lists -> sacrebleu's reference streams (one list per reference slot);
    documents with fewer references are padded with None, which sacrebleu skips."""
    refs = [[r] if isinstance(r, str) else list(r) for r in references]
    if any(not r for r in refs):
        raise LmforgeError("every document needs at least one reference")
    width = max(len(r) for r in refs)
    return [[r[i] if i < len(r) else None for r in refs] for i in range(width)]


def corpus_bleu(predictions: Sequence[str], references: Sequence[str | Sequence[str]]) -> float:
    """sacrebleu's corpus BLEU (0-100; 13a tokenisation, exponential smoothing) of the predictions."""
    sacrebleu = _require("sacrebleu", "sacrebleu")
    return float(sacrebleu.corpus_bleu(list(predictions), _reference_streams(references)).score)


def corpus_chrf(predictions: Sequence[str], references: Sequence[str | Sequence[str]]) -> float:
    """sacrebleu's corpus chrF (0-100; character 6-grams, beta 2)."""
    sacrebleu = _require("sacrebleu", "sacrebleu")
    return float(sacrebleu.corpus_chrf(list(predictions), _reference_streams(references)).score)


ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def rouge(
    predictions: Sequence[str], references: Sequence[str | Sequence[str]], use_stemmer: bool = False
) -> dict[str, float]:
    """Mean ROUGE-1 / ROUGE-2 / ROUGE-L F-measure (0-100) over documents, by Google's rouge-score
    (several references: rouge-score's score_multi, the best one per document)."""
    rouge_scorer = _require("rouge_score.rouge_scorer", "rouge-score")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=use_stemmer)
    sums = dict.fromkeys(ROUGE_TYPES, 0.0)
    for pred, ref in zip(predictions, references, strict=True):
        refs = [ref] if isinstance(ref, str) else list(ref)
        scores = scorer.score_multi(refs, pred)
        for k in ROUGE_TYPES:
            sums[k] += scores[k].fmeasure
    n = max(len(predictions), 1)
    return {k: 100.0 * v / n for k, v in sums.items()}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from n samples of which c pass: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1 (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


# --------------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class CalibrationBins:
    """Per-bin counts, mean confidence and accuracy (empty bins: count 0, NaN means)."""

    edges: np.ndarray  # (n_bins + 1,)
    count: np.ndarray  # (n_bins,)
    confidence: np.ndarray
    accuracy: np.ndarray


def calibration_bins(
    confidence: Sequence[float], correct: Sequence[float], n_bins: int = 10, adaptive: bool = False
) -> CalibrationBins:
    """Group predictions by confidence: `n_bins` equal-width bins over [0, 1] (a confidence on an
    inner edge goes to the upper bin; 1.0 to the last bin), or, adaptive, equal-mass bins (each holds
    n // n_bins or one more of the sorted predictions, as in Nixon et al. 2019)."""
    conf = np.asarray(confidence, dtype=np.float64)
    hit = np.asarray(correct, dtype=np.float64)
    if conf.shape != hit.shape or conf.ndim != 1 or conf.size == 0:
        raise ValueError("calibration needs equal-length non-empty 1-D confidence and correctness")
    if n_bins < 1:
        raise ValueError("n_bins must be >= 1")
    if adaptive:
        order = np.argsort(conf, kind="stable")
        groups = np.array_split(order, min(n_bins, conf.size))
        edges = np.array([0.0] + [float(conf[g[-1]]) for g in groups[:-1]] + [1.0])
    else:
        edges = np.linspace(0.0, 1.0, n_bins + 1)
        which = np.clip(np.searchsorted(edges, conf, side="right") - 1, 0, n_bins - 1)
        groups = [np.flatnonzero(which == b) for b in range(n_bins)]
    count = np.array([len(g) for g in groups], dtype=np.int64)
    with np.errstate(invalid="ignore"):
        mean_conf = np.array([conf[g].mean() if len(g) else np.nan for g in groups])
        acc = np.array([hit[g].mean() if len(g) else np.nan for g in groups])
    return CalibrationBins(edges, count, mean_conf, acc)


def expected_calibration_error(
    confidence: Sequence[float], correct: Sequence[float], n_bins: int = 10, adaptive: bool = False
) -> float:
    """ECE = sum over bins of (bin size / n) * |accuracy - mean confidence| (Guo et al. 2017)."""
    bins = calibration_bins(confidence, correct, n_bins, adaptive)
    keep = bins.count > 0
    weights = bins.count[keep] / bins.count.sum()
    return float(np.sum(weights * np.abs(bins.accuracy[keep] - bins.confidence[keep])))


def brier_score(probabilities: Sequence[Sequence[float]], gold: Sequence[int]) -> float:
    """Mean over documents of sum_k (p_k - [k == gold])^2 (lm-evaluation-harness's brier_score for
    multiple choice: the probabilities are the softmax of the choices' log-likelihoods)."""
    total = 0.0
    for p, g in zip(probabilities, gold, strict=True):
        p = np.asarray(p, dtype=np.float64)
        onehot = np.zeros_like(p)
        onehot[g] = 1.0
        total += float(np.sum((p - onehot) ** 2))
    return total / max(len(gold), 1)


def softmax(logits: Sequence[float]) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def reliability_diagram(
    confidence: Sequence[float],
    correct: Sequence[float],
    path: str | Path,
    title: str,
    n_bins: int = 10,
    adaptive: bool = False,
) -> Path:
    """A PNG (640 x 800) of calibration: above, each bin's accuracy (bars) and the same accuracy placed at
    the bin's mean confidence (dots: on the diagonal when calibrated), with the ECE in the title; below,
    how many predictions each bin holds (a bin of 3 predictions says little), the count on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lmforge.utils.io import atomic_write_bytes

    bins = calibration_bins(confidence, correct, n_bins, adaptive)
    ece = expected_calibration_error(confidence, correct, n_bins, adaptive)
    fig, (ax, counts) = plt.subplots(
        2, 1, figsize=(6.4, 8.0), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    keep = bins.count > 0
    left, right = bins.edges[:-1][keep], bins.edges[1:][keep]
    ax.bar(
        left,
        np.nan_to_num(bins.accuracy[keep]),
        width=right - left,
        align="edge",
        alpha=0.7,
        edgecolor="black",
        label="accuracy of the bin",
    )
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax.plot(
        bins.confidence[keep],
        bins.accuracy[keep],
        "o",
        color="tab:red",
        label="bin accuracy at the bin's mean confidence",
    )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    kind = "adaptive" if adaptive else "equal-width"
    ax.set_title(
        f"{title}\nECE {ece:.3f} ({n_bins} {kind} bins, n={len(bins.count) and int(bins.count.sum())})",
        fontsize=10,
    )
    ax.legend(loc="upper left", fontsize=9)
    counts.bar(left, bins.count[keep], width=right - left, align="edge", color="tab:gray", edgecolor="black")
    for x0, x1, n in zip(left, right, bins.count[keep]):
        counts.annotate(f"{int(n):,}", ((x0 + x1) / 2, n), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 1), textcoords="offset points")
    counts.set_ylim(0, 1.25 * max(int(bins.count.max()), 1))  # room for the counts above the bars
    counts.set_ylabel("predictions")
    counts.set_xlabel("confidence")
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n), as lm-evaluation-harness's mean_stderr)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan
    if x.size == 1:
        return float(x[0]), math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))
