"""Contamination report: eval documents sharing word n-grams with a run's training data are flagged,
with the same n-grams (and verdicts) as curation's decontaminate step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.config.curate import DecontaminateStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.steps.decontaminate import Step
from lmforge.data.prepare import split_of
from lmforge.data.sources import SourceStats, iter_documents
from lmforge.errors import DataError
from lmforge.eval.contamination import (
    NgramIndex,
    TrainingStats,
    contamination_report,
    run_contamination,
    training_texts,
)

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"

# 15 words found nowhere else in these tests
SECRET = (
    "the violet heron counted seven amber lanterns drifting slowly "
    "beneath quiet northern bridges until tonight"
)
TRAIN = [
    f"Field notes from the estuary. {SECRET}. After that the tide turned and everyone went home.",
    "A completely different story about compilers, parsers and the registers of a small machine.",
]
FILLER_A = "alpha bravo charlie delta echo foxtrot golf hotel india juliet"  # 10 words, not in TRAIN
FILLER_B = "kilo lima mike november oscar papa quebec romeo sierra tango"


def test_planted_sentence_is_flagged_with_its_fraction():
    doc = f"{FILLER_A} {SECRET} {FILLER_B}"  # 35 words: 23 13-grams, 3 of them inside SECRET
    clean = f"{FILLER_A} {FILLER_B} {FILLER_A}"
    r = contamination_report({"quiz": [clean, doc]}, TRAIN)["quiz"]
    assert (r["documents"], r["checked"], r["too_short"], r["contaminated"]) == (2, 2, 0, 1)
    assert r["contaminated_docs"] == [1] and r["contaminated_fraction"] == 0.5
    assert (r["ngrams"], r["ngrams_found"]) == (23 + 18, 3)
    assert r["mean_overlap"] == pytest.approx((0 + 3 / 23) / 2, abs=1e-12)
    assert NgramIndex(TRAIN).overlap([doc])[0].fraction == pytest.approx(3 / 23, abs=1e-12)


def test_disjoint_eval_set_gives_zero():
    docs = [f"{FILLER_A} {FILLER_B}", f"{FILLER_B} {FILLER_A} {FILLER_B}"]
    r = contamination_report({"quiz": docs}, TRAIN)["quiz"]
    assert (r["contaminated"], r["contaminated_fraction"], r["mean_overlap"], r["ngrams_found"]) == (
        0,
        0.0,
        0.0,
        0,
    )
    assert r["ngrams"] == 8 + 18


def test_case_and_punctuation_do_not_hide_overlap():
    w = SECRET.split()
    noisy = " -- ".join(x.upper() for x in w[:7]) + ", " + "... ".join(x.title() for x in w[7:]) + "!?"
    r = contamination_report({"quiz": [f"Q: {noisy}"]}, TRAIN)["quiz"]
    assert r["contaminated"] == 1 and r["ngrams"] == 4 and r["ngrams_found"] == 3  # "q" + 15 words


def test_short_documents_are_neither_clean_nor_contaminated():
    w = SECRET.split()
    short = " ".join(w[:12])  # every word is in training, but there is no 13-gram
    exact = " ".join(w[:13])
    r = contamination_report({"quiz": [short, exact, "four"], "tiny": [short, ""]}, TRAIN)
    q = r["quiz"]
    assert (q["documents"], q["too_short"], q["checked"], q["contaminated"]) == (3, 2, 1, 1)
    assert q["contaminated_docs"] == [1] and q["contaminated_fraction"] == 1.0 and q["mean_overlap"] == 1.0
    t = r["tiny"]
    assert (t["documents"], t["too_short"], t["checked"], t["contaminated"], t["ngrams"]) == (2, 2, 0, 0, 0)
    assert t["contaminated_fraction"] is None and t["mean_overlap"] is None


def test_ngram_size_is_honoured():
    w = SECRET.split()
    doc = f"{FILLER_A} {' '.join(w[:9])} {FILLER_B}"  # 9 shared words: two 8-grams, no 13-gram
    r13 = contamination_report({"q": [doc]}, TRAIN)["q"]
    r8 = contamination_report({"q": [doc, " ".join(w[:7])]}, TRAIN, ngram=8)["q"]
    assert r13["contaminated"] == 0 and r13["ngram"] == 13 and r13["ngrams"] == 29 - 12
    assert (r8["contaminated"], r8["too_short"], r8["ngrams"], r8["ngrams_found"]) == (1, 1, 29 - 7, 2)
    with pytest.raises(ValueError, match="ngram"):
        contamination_report({"q": [doc]}, TRAIN, ngram=0)


def test_agrees_with_the_curation_decontaminate_step(tmp_path):
    w = SECRET.split()
    eval_docs = [f"{FILLER_A} {' '.join(w[2:15])}", f"{FILLER_B} {FILLER_A}", " ".join(w[:12])]
    path = tmp_path / "quiz.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in eval_docs), encoding="utf-8")
    step = Step(DecontaminateStep(eval_files=[str(path)], ngram=13))
    train = [
        *TRAIN,
        f"Upper case copy: {FILLER_B.upper()}, {FILLER_A.upper()}!",  # every word of eval doc 2
        " ".join(w[:12]) + " and more",  # eval doc 3's words, but it is too short to match
        " ".join(w[3:15]),  # 12 words of doc 1's span: no full 13-gram
    ]
    dropped = [step.apply(Doc(str(i), t))[0] is None for i, t in enumerate(train)]
    assert dropped == [True, False, True, False, False]
    eval_side = NgramIndex(eval_docs)
    assert [o.contaminated for o in eval_side.overlap(train)] == dropped
    # a training doc the step drops is exactly one that makes the report flag an eval doc
    for t, drop in zip(train, dropped):
        assert (contamination_report({"quiz": eval_docs}, [t])["quiz"]["contaminated"] > 0) == drop
    r = contamination_report({"quiz": eval_docs}, train)["quiz"]
    assert r["contaminated_docs"] == [0, 1] and r["too_short"] == 1


def test_training_side_index_matches_the_streamed_report():
    train = [*TRAIN, f"{FILLER_A} {FILLER_B}", SECRET.upper()] * 3
    docs = [f"{FILLER_A} {SECRET}", f"{FILLER_A} {FILLER_B} zulu", "short one", f"{FILLER_B} {FILLER_B}"]
    index = NgramIndex(train, chunk=5)  # tiny chunks: the merge of deduplicated chunks is exercised
    assert len(index) == len(NgramIndex(train)) and len(index) == len(set(index.grams.tolist()))
    per = index.overlap(docs)
    r = contamination_report({"q": docs}, train)["q"]
    assert r["contaminated_docs"] == [i for i, o in enumerate(per) if o.contaminated] == [0, 1]
    assert r["ngrams_found"] == sum(o.found for o in per) and r["ngrams"] == sum(o.ngrams for o in per)
    assert per[2].too_short and len(NgramIndex()) == 0


def _tiny(*sets):
    return load_config(
        REPO / "configs/debug/tiny.yaml", [f"data.sources=[{CORPUS}]", "data.max_chars=null", *sets]
    )


def test_training_texts_of_a_pretraining_run_are_its_train_split():
    cfg = _tiny()
    stats = TrainingStats()
    texts = list(training_texts(cfg, stats=stats))
    corpus = list(iter_documents(cfg.data, SourceStats()))
    train = [d for i, d in enumerate(corpus) if split_of(i, cfg.run.seed, cfg.data.val_fraction) == "train"]
    assert texts == train and 0 < len(train) < len(corpus) == 79
    assert (stats.documents, stats.held_out, stats.chars) == (
        len(train),
        len(corpus) - len(train),
        sum(map(len, train)),
    )
    assert stats.section == "data.sources" and not stats.budget_hit and not stats.data_max_chars_hit

    held_out = next(d for d in corpus if d not in train)
    eval_docs = {"seen": [" ".join(train[3].split()[:300])], "held_out": [" ".join(held_out.split()[:300])]}
    out = run_contamination(cfg, eval_docs)
    assert out["tasks"]["seen"]["contaminated"] == 1 and out["tasks"]["seen"]["mean_overlap"] == 1.0
    assert out["tasks"]["held_out"]["mean_overlap"] < 1.0 and out["training"]["documents"] == len(train)


def test_max_chars_budget_and_data_max_chars():
    stats = TrainingStats()
    texts = list(training_texts(_tiny(), max_chars=5000, stats=stats))
    assert sum(map(len, texts)) == stats.chars == 5000 and stats.budget_hit and "budget" in stats.summary()
    stats = TrainingStats()
    texts = list(training_texts(_tiny("data.max_chars=20000"), stats=stats))
    assert stats.data_max_chars_hit and not stats.budget_hit and stats.chars < 20000
    with pytest.raises(DataError, match="data.sources"):
        list(training_texts(_tiny("data.sources=[]")))


def test_training_texts_of_a_finetuning_run_are_its_accepted_train_records(tmp_path):
    records = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i}"},
            ]
        }
        for i in range(20)
    ]
    lines = [json.dumps(r) for r in records]
    lines.insert(5, json.dumps({"messages": [{"role": "user", "content": "never answered"}]}))  # no assistant
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")

    stats = TrainingStats()
    texts = list(
        training_texts(_tiny("objective.name=sft", f"sft.data=[{data}]", "sft.val_fraction=0.3"), stats=stats)
    )
    kept = [i for i in range(20) if split_of(i, 1337, 0.3) == "train"]
    assert texts == [s for i in kept for s in ("user", f"question {i}", "assistant", f"answer {i}")]
    assert (stats.section, stats.documents, stats.held_out, stats.skipped_bad) == (
        "sft.data",
        len(kept),
        20 - len(kept),
        1,
    )

    stats = TrainingStats()
    cfg = _tiny("objective.name=sft", f"sft.data=[{data}]", f"sft.val_data=[{data}]")
    assert len(list(training_texts(cfg, stats=stats))) == 80 and stats.held_out == 0

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        json.dumps({"prompt": "p q", "chosen": "good", "rejected": "bad"}) + "\n", encoding="utf-8"
    )
    cfg = _tiny("objective.name=dpo", f"preference.data=[{pairs}]", f"preference.val_data=[{pairs}]")
    stats = TrainingStats()
    assert (
        list(training_texts(cfg, stats=stats)) == ["p q", "good", "bad"]
        and stats.section == "preference.data"
    )
    with pytest.raises(DataError, match="rl.data"):
        list(training_texts(_tiny("objective.name=rl")))
