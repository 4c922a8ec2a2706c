"""Decontamination: documents sharing an eval n-gram are dropped, shorter overlaps are kept."""

from __future__ import annotations

import json

import pytest

from lmforge.config.curate import DecontaminateStep
from lmforge.data.curate.doc import Doc
from lmforge.data.curate.steps.decontaminate import Step

QUESTION = (
    "Which of the following best describes the primary function of mitochondria in eukaryotic cells "
    "during aerobic respiration?"
)
ANSWER = "They produce most of the cell's supply of adenosine triphosphate used as a source of energy."


@pytest.fixture()
def eval_files(tmp_path):
    jsonl = tmp_path / "mmlu_bio.jsonl"
    records = [
        {"question": QUESTION, "answer": ANSWER, "meta": {"id": 3, "choices": ["short", "ones"]}},
        {"question": "What is two plus two?", "answer": "four"},
    ]
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    txt = tmp_path / "story.txt"
    txt.write_text(
        "Once upon a time in a kingdom by the sea there lived a maiden whom you may know by the name "
        "of Annabel Lee and this maiden she lived with no other thought than to love and be loved by me.",
        encoding="utf-8",
    )
    return jsonl, txt


def _step(paths, ngram=13):
    return Step(DecontaminateStep(eval_files=[str(p) for p in paths], ngram=ngram))


def _words(text):
    return text.split()


def test_drops_doc_with_13_gram(eval_files):
    step = _step(eval_files)
    gram = " ".join(_words(QUESTION)[2:15])  # 13 words of the question
    out, reason = step.apply(Doc("a", f"Some preamble text. {gram} and then something unrelated."))
    assert out is None and reason == "decontaminate:mmlu_bio.jsonl"


def test_case_and_punctuation_do_not_hide_overlap(eval_files):
    step = _step(eval_files)
    gram = _words(QUESTION)[0:13]
    noisy = " -- ".join(w.upper() for w in gram[:6]) + ", " + "... ".join(gram[6:]) + "!"
    out, reason = step.apply(Doc("a", f"Quiz: {noisy}"))
    assert out is None and reason == "decontaminate:mmlu_bio.jsonl"
    story = "ONCE UPON A TIME, in a kingdom -- by the sea; there lived a maiden whom you may know!"
    assert step.apply(Doc("b", story)) == (None, "decontaminate:story.txt")


def test_keeps_doc_sharing_only_12_gram(eval_files):
    step = _step(eval_files)
    gram = " ".join(_words(QUESTION)[0:12])
    doc = Doc("a", f"{gram} zebra crossing was not part of the original exam question at all.")
    assert step.apply(doc) == (doc, None)
    clean = Doc("b", "A perfectly ordinary paragraph about cooking pasta with garlic and olive oil.")
    assert step.apply(clean) == (clean, None)


def test_ngrams_do_not_span_fields_and_short_texts_are_ignored(eval_files):
    step = _step(eval_files)
    # the end of the question followed by the start of the answer is not an eval n-gram
    spanning = " ".join(_words(QUESTION)[-6:] + _words(ANSWER)[:7])
    doc = Doc("a", spanning)
    assert step.apply(doc) == (doc, None)
    short = Doc("b", "What is two plus two? four")
    assert step.apply(short) == (short, None)


def test_answer_field_and_smaller_ngram(eval_files):
    step = _step(eval_files, ngram=8)
    doc = Doc("a", "Notes: the cell's supply of adenosine triphosphate used as a source of power.")
    assert step.apply(doc) == (None, "decontaminate:mmlu_bio.jsonl")


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        _step([tmp_path / "missing.jsonl"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        _step([bad])


def test_empty_eval_set_keeps_everything(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    step = _step([empty])
    doc = Doc("a", "anything at all " * 10)
    assert step.apply(doc) == (doc, None) and step.num_ngrams == 0


@pytest.mark.parametrize(
    "name, data, why",
    [
        ("binary.jsonl", b"\xff\xfe\x00\x01\n", "codec can't decode"),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ("deep.jsonl", b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"\n", "nested too deeply"),
    ],
)
def test_an_eval_file_that_cannot_be_read_is_a_clear_error(tmp_path, name, data, why):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match=rf"eval_files: cannot read .*{name} \(.*{why}"):
        _step([path])
