"""Exact match and F1 of extractive QA (lmforge.eval.span_metrics) as the SQuAD v1.1 evaluation script
defines them: hand-worked examples, and random answers against torchmetrics' copy of the script (which
agrees with v1.1 wherever neither answer normalizes to nothing), and best_span's rule."""

from __future__ import annotations

import random

import pytest
import torch

from lmforge.eval.span_metrics import best_span, normalize_answer, squad_exact, squad_f1, squad_metrics


def test_hand_worked_examples():
    assert normalize_answer("  The  Denver Broncos!! ") == "denver broncos"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("Theory") == "theory"  # an article only as a whole word
    assert squad_exact("the Denver Broncos", "Denver Broncos.") == 1.0
    # prediction "denver broncos team" vs gold "broncos": 1 common token, precision 1/3, recall 1
    assert squad_f1("Denver Broncos team", "Broncos") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert squad_f1("", "Broncos") == 0.0 and squad_f1("the", "a") == 0.0  # v1.1: no common token, 0
    # repeated tokens count as often as both have them (a multiset intersection)
    assert squad_f1("x b b", "b b c") == pytest.approx(2 / 3)
    assert squad_f1("a b b", "b b c") == pytest.approx(0.8)  # "a" is an article: "b b", precision 1
    # each question scores its best gold answer; means in percent
    out = squad_metrics(["Denver Broncos", "Santa Clara", "1"],
                        [["Denver Broncos", "Broncos"], ["Levi's Stadium", "Santa Clara, California"], ["2"]])
    f1_2 = 2 * 1.0 * (2 / 3) / (1 + 2 / 3)
    assert out == pytest.approx({"questions": 3, "exact_match": 100 / 3, "f1": 100 * (1 + f1_2 + 0) / 3})
    with pytest.raises(ValueError, match="predictions for"):
        squad_metrics(["x"], [])


def test_random_answers_match_torchmetrics_squad():
    tm = pytest.importorskip("torchmetrics.functional.text")
    rng = random.Random(0)
    words = ["the", "a", "Denver", "broncos", "Broncos!", "team", "won", "in", "1999", "x-y", "an", "Bay"]
    preds, golds = [], []
    for _ in range(300):
        preds.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 5))))
        golds.append([" ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 3))])
    keep = [i for i in range(300) if normalize_answer(preds[i]) and all(map(normalize_answer, golds[i]))]
    assert len(keep) > 150
    p, g = [preds[i] for i in keep], [golds[i] for i in keep]
    theirs = tm.squad([{"prediction_text": x, "id": str(i)} for i, x in enumerate(p)],
                      [{"answers": {"answer_start": [0] * len(a), "text": a}, "id": str(i)}
                       for i, a in enumerate(g)])
    ours = squad_metrics(p, g)
    assert ours["exact_match"] == pytest.approx(float(theirs["exact_match"]), abs=1e-4)
    assert ours["f1"] == pytest.approx(float(theirs["f1"]), abs=1e-4)


def test_best_span_is_the_best_valid_one():
    start = torch.tensor([9.0, 1.0, 5.0, 0.0, 3.0])
    end = torch.tensor([9.0, 4.0, 0.0, 2.0, 1.0])
    valid = torch.tensor([False, True, True, True, True])  # position 0 is the question: never an answer
    assert best_span(start, end, valid, 30) == (7.0, 2, 3)  # not (2, 1): an end before its start
    assert best_span(start, end, valid, 1)[1:] == (1, 1)  # one-token answers only: 1+4 beats 5+0
    assert best_span(start, end, torch.zeros(5, dtype=torch.bool), 30) is None
