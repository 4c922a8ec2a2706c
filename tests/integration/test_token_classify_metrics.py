"""Entity-level metrics of a tagger (lmforge.eval.span_metrics) against seqeval's: its documented example
worked by hand, and random BIO / IOB2 / IOBES / malformed tag sequences compared with seqeval itself."""

from __future__ import annotations

import random
import warnings

import pytest

from lmforge.eval.span_metrics import entities, entity_metrics, tagging_metrics


def test_seqeval_documented_example_by_hand():
    truth = [["O", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    pred = [["O", "O", "B-MISC", "I-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    # true entities: MISC words 3-5, PER words 8-9 (an O is counted after each sentence); the predicted
    # MISC starts one word early, so only PER matches: precision 1/2, recall 1/2
    assert entities(truth) == [("MISC", 3, 5), ("PER", 8, 9)]
    assert entities(pred) == [("MISC", 2, 5), ("PER", 8, 9)]
    out = entity_metrics(truth, pred)
    assert (out["precision"], out["recall"], out["f1"]) == (0.5, 0.5, 0.5)
    assert out["per_type"] == [{"type": "MISC", "precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1},
                               {"type": "PER", "precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 1}]
    # lenient IOB: an I- after O starts an entity; a type change ends one
    assert entities([["I-LOC", "I-LOC", "I-PER", "O", "B-LOC", "I-PER"]]) == [
        ("LOC", 0, 1), ("PER", 2, 2), ("LOC", 4, 4), ("PER", 5, 5)]
    labels = sorted({t for s in truth + pred for t in s})
    idx = lambda seqs: [[labels.index(t) for t in s] for s in seqs]  # noqa: E731
    report = tagging_metrics(idx(truth), idx(pred), labels)
    assert report["accuracy"] == 0.8 and report["entity_f1"] == 0.5 and report["words"] == 10


def test_random_sequences_match_seqeval():
    seqeval = pytest.importorskip("seqeval.metrics")
    rng = random.Random(0)
    tags = ["O", "O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "E-LOC", "S-PER", "I-MISC", "B-MISC"]
    for trial in range(200):
        truth = [[rng.choice(tags) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 5))]
        pred = [[t if rng.random() < 0.6 else rng.choice(tags) for t in s] for s in truth]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = (seqeval.precision_score(truth, pred), seqeval.recall_score(truth, pred),
                    seqeval.f1_score(truth, pred))
            per = seqeval.classification_report(truth, pred, output_dict=True)
        out = entity_metrics(truth, pred)
        assert (out["precision"], out["recall"], out["f1"]) == pytest.approx(want, abs=1e-12), trial
        for row in out["per_type"]:
            theirs = per[row["type"]]
            assert (row["precision"], row["recall"], row["f1"], row["support"]) == pytest.approx(
                (theirs["precision"], theirs["recall"], theirs["f1-score"], theirs["support"]), abs=1e-12)


def test_lengths_must_agree():
    with pytest.raises(ValueError, match="same lengths"):
        entity_metrics([["O", "B-X"]], [["O"]])
