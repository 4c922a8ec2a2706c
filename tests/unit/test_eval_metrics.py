"""lmforge.eval.metrics against the references: lm-evaluation-harness's exact_match / bleu / chrf /
brier_score, sacrebleu, rouge-score, a plain-loop ECE, the Codex paper's pass@k; and the harness's
tokenisation rules and rolling windows in lmforge.eval.scorer."""

from __future__ import annotations

import math
import random
from itertools import combinations

import numpy as np
import pytest

from lmforge.eval import metrics as M
from lmforge.eval.scorer import rolling_windows

lm_metrics = pytest.importorskip("lm_eval.api.metrics")
sacrebleu = pytest.importorskip("sacrebleu")
rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")

PREDS = ["The cat sat on the mat.", "a quick brown fox", "Hello, World!", "42", "", "the the the"]
REFS = [
    ["The cat is on the mat.", "There is a cat on the mat."],
    ["The quick brown fox jumps"],
    ["hello world"],
    ["42."],
    ["nothing"],
    ["the cat"],
]


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"ignore_case": True},
        {"ignore_punctuation": True},
        {"ignore_case": True, "ignore_punctuation": True, "ignore_numbers": True},
        {"regexes_to_ignore": [r"\.$", "^the "], "ignore_case": True},
    ],
)
def test_exact_match_equals_the_harness(opts):
    cases = [
        ("Hello, World!", "hello world"),
        ("42.", "42"),
        ("The end.", "the end"),
        ("abc", "abc"),
        ("a1b2", "ab"),
        ("x ", "x"),
        ("Été!", "été"),
    ]
    for pred, ref in cases:
        theirs = lm_metrics.exact_match_hf_evaluate([pred], [ref], **opts)["exact_match"]
        assert M.exact_match(pred, ref, **opts) == float(theirs), (pred, ref, opts)


def test_bleu_and_chrf_equal_the_harness_corpus_scores():
    items = list(zip(REFS, PREDS))
    assert M.corpus_bleu(PREDS, REFS) == pytest.approx(lm_metrics.bleu(items), abs=1e-9)
    assert M.corpus_chrf(PREDS, REFS) == pytest.approx(lm_metrics.chrf(items), abs=1e-9)
    # and sacrebleu called directly on single references
    single = [r[0] for r in REFS]
    assert M.corpus_bleu(PREDS, single) == pytest.approx(
        sacrebleu.corpus_bleu(PREDS, [single]).score, abs=1e-9
    )
    assert M.corpus_bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(100.0)


def test_rouge_equals_rouge_score_and_a_hand_count():
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    ours = M.rouge(PREDS, REFS)
    for k in M.ROUGE_TYPES:
        expected = np.mean([scorer.score_multi(r, p)[k].fmeasure for p, r in zip(PREDS, REFS)]) * 100
        assert ours[k] == pytest.approx(expected, abs=1e-9)
    # "the cat sat" vs "the cat ran": unigrams 2/3 precision and recall, bigrams 1/2, LCS 2.
    one = M.rouge(["the cat sat"], ["the cat ran"])
    assert one["rouge1"] == pytest.approx(200 / 3)
    assert one["rouge2"] == pytest.approx(50.0)
    assert one["rougeL"] == pytest.approx(200 / 3)


def test_token_f1_squad():
    assert M.token_f1("The Cat sat", "a cat sat down") == pytest.approx(2 * (2 / 2) * (2 / 3) / (1 + 2 / 3))
    assert M.token_f1("", "") == 1.0
    assert M.token_f1("x", ["y", "x"]) == 1.0


def ece_loop(conf, hit, n_bins, adaptive):
    """The textbook ECE, written out: sort into bins, weigh each |accuracy - confidence| by its size."""
    n = len(conf)
    if adaptive:
        order = sorted(range(n), key=lambda i: conf[i])
        sizes = [n // n_bins + (1 if b < n % n_bins else 0) for b in range(n_bins)]
        bins, start = [], 0
        for s in sizes:
            bins.append(order[start : start + s])
            start += s
    else:
        bins = [[] for _ in range(n_bins)]
        for i, c in enumerate(conf):
            bins[min(int(c * n_bins), n_bins - 1)].append(i)
    total = 0.0
    for b in bins:
        if b:
            total += len(b) / n * abs(sum(hit[i] for i in b) / len(b) - sum(conf[i] for i in b) / len(b))
    return total


@pytest.mark.parametrize("adaptive", [False, True])
def test_ece_equals_a_plain_loop(adaptive):
    rng = random.Random(0)
    conf = [rng.uniform(0.25, 1.0) for _ in range(503)]
    hit = [float(rng.random() < c**1.5) for c in conf]
    for n_bins in (1, 5, 10, 15):
        assert M.expected_calibration_error(conf, hit, n_bins, adaptive) == pytest.approx(
            ece_loop(conf, hit, n_bins, adaptive), abs=1e-12
        )
    assert M.expected_calibration_error([1.0, 1.0], [1.0, 1.0]) == 0.0
    assert M.expected_calibration_error([0.9] * 10, [0.0] * 10) == pytest.approx(0.9)


def test_brier_equals_the_harness():
    rng = np.random.default_rng(0)
    probs = [M.softmax(rng.normal(size=4)) for _ in range(20)]
    gold = [int(g) for g in rng.integers(0, 4, size=20)]
    assert M.brier_score(probs, gold) == pytest.approx(
        lm_metrics.brier_score(list(zip(gold, probs))), abs=1e-12
    )


def test_pass_at_k_is_the_combinatorial_definition():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                draws = list(combinations(range(n), k))
                exact = sum(any(i < c for i in d) for d in draws) / len(draws)
                assert M.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_mean_stderr_equals_the_harness():
    x = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    mean, err = M.mean_and_stderr(x)
    assert mean == pytest.approx(5 / 7)
    assert err == pytest.approx(lm_metrics.mean_stderr(x), abs=1e-12)


def test_reliability_diagram_writes_a_png(tmp_path):
    path = M.reliability_diagram([0.3, 0.6, 0.9, 0.95], [0, 1, 1, 1], tmp_path / "r.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("length", [1, 5, 16, 17, 40])
def test_rolling_windows_cover_every_token_once_with_full_context(length):
    ids = list(range(100, 100 + length))
    L = 8
    windows = rolling_windows(ids, 0, L)
    scored = [t for _, cont in windows for t in cont]
    assert scored == ids
    ctx, cont = windows[0]
    assert ctx == [0] and cont == ids[:L]
    for ctx, cont in windows[1:]:
        inp = (ctx + cont)[-(L + 1) :][:-1]
        assert len(inp) == L and len(cont) <= L
        start = ids.index(cont[0])
        assert ctx == ids[start - (L + 1 - len(cont)) : start]


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        M.pass_at_k(3, 4, 1)
    assert math.isclose(M.pass_at_k(10, 0, 5), 0.0)


def test_ece_equals_torchmetrics():
    """torchmetrics' multiclass calibration error (max-probability confidence, 10 equal-width bins, L1)
    on softmax outputs; it accumulates in float32, hence 1e-6 (no confidence is exactly 1.0, which
    torchmetrics alone puts in a bin of its own)."""
    torch = pytest.importorskip("torch")
    classification = pytest.importorskip("torchmetrics.functional.classification")
    for seed, scale, n_bins in ((0, 2.0, 10), (1, 0.5, 15), (2, 5.0, 5)):
        g = torch.Generator().manual_seed(seed)
        probs = (torch.randn(700, 4, generator=g) * scale).softmax(-1).double()
        target = torch.randint(0, 4, (700,), generator=g)
        theirs = classification.multiclass_calibration_error(
            probs, target, num_classes=4, n_bins=n_bins, norm="l1"
        )
        conf = probs.max(-1).values.tolist()
        hit = (probs.argmax(-1) == target).double().tolist()
        assert M.expected_calibration_error(conf, hit, n_bins) == pytest.approx(float(theirs), abs=1e-6)
