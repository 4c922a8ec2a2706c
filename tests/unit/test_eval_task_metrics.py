"""The task metric registry (eval/tasks/metrics.py): a metric registered there, and nowhere else, can be
named by a task file and is scored by the runners (per document with a standard error, or per corpus;
per filter for generation tasks); the registry is what the loader checks metric_list against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.eval.tasks import TaskError, load_task, run_task
from lmforge.eval.tasks import metrics as task_metrics

DOCS = [
    {"q": "one", "a": "alpha"},
    {"q": "two", "a": "beta"},
    {"q": "three", "a": "gamma"},
    {"q": "four", "a": "delta"},
]
REPLIES = {"one": "alpha", "two": "BETA", "three": "gamm", "four": "alpha"}


class Replies:
    """A scorer that answers each prompt from REPLIES (the runners call only generate_until here)."""

    def generate_until(self, contexts, until, max_gen_toks, temperature=0.0, top_k=None, top_p=None, seed=0):
        return [REPLIES[c] for c in contexts]


def _task(tmp_path: Path, metric_list: str, output_type: str = "generate_until") -> Path:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    path = tmp_path / "t.yaml"
    path.write_text(
        f"task: t\ndataset_path: {data}\noutput_type: {output_type}\ndoc_to_text: q\ndoc_to_target: a\n"
        f"metric_list: {metric_list}\n"
        "filter_list:\n  - {name: raw, filter: [{function: take_first}]}\n"
        "  - {name: lower, filter: [{function: lowercase}]}\n"
    )
    return path


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for the test to add to; the shipped one is left as it was."""
    monkeypatch.setattr(task_metrics, "REGISTRY", dict(task_metrics.REGISTRY))
    return task_metrics


def test_a_metric_registered_in_the_metrics_module_alone_is_scored(tmp_path, registry):
    path = _task(tmp_path, "[{metric: same_length}, {metric: caught, case: upper}, {metric: exact_match}]")
    with pytest.raises(TaskError, match=r"\[0\] .same_length. is not available for generate_until"):
        load_task(path)

    @registry.metric("same_length", "generate_until")
    def _same_length(d, opts):  # one value per document: the mean with its standard error
        return float(len(d.prediction) == len(d.references[0]))

    def _case_option(opts, path, i):
        if opts.get("case") not in ("upper", "lower"):
            raise TaskError(f"{path}: metric_list[{i}] caught.case must be upper or lower")
        return opts

    @registry.metric("caught", "generate_until", "corpus", options=_case_option)
    def _caught(c, opts):  # one value for the corpus: responses with a letter of that case
        test = str.isupper if opts["case"] == "upper" else str.islower
        return float(sum(any(test(ch) for ch in p) for p in c.predictions))

    task = load_task(path)
    assert task.metrics == {"same_length": {}, "caught": {"case": "upper"}, "exact_match": {}}
    result = run_task(task, Replies())
    # raw replies: alpha BETA gamm alpha; lowercased: alpha beta gamm alpha
    assert result.metrics == {
        "same_length,raw": 0.75,
        "exact_match,raw": 0.25,
        "same_length,lower": 0.75,
        "exact_match,lower": 0.5,
        "caught,raw": 1.0,
        "caught,lower": 0.0,
    }
    assert result.stderr["same_length,raw"] == pytest.approx(0.25)  # sample std 0.5 / sqrt(4)
    assert "caught,raw" not in result.stderr  # a corpus value has none

    bad = _task(tmp_path, "[{metric: caught, case: title}]")
    with pytest.raises(TaskError, match=r"metric_list\[0\] caught.case must be upper or lower"):
        load_task(bad)


def test_a_default_metric_is_scored_without_a_metric_list(tmp_path, registry):
    @registry.metric("reply_chars", "generate_until", default=True)
    def _reply_chars(d, opts):
        return float(len(d.prediction))

    path = _task(tmp_path, "null")
    task = load_task(path)
    assert list(task.metrics) == ["exact_match", "reply_chars"]
    assert run_task(task, Replies()).metrics["reply_chars,raw"] == 4.5  # (5 + 4 + 4 + 5) / 4


def test_registering_is_checked(registry):
    registry.metric("twice", "multiple_choice")(lambda d, opts: 0.0)
    with pytest.raises(ValueError, match="registered twice"):
        registry.metric("twice", "multiple_choice")(lambda d, opts: 0.0)
    with pytest.raises(ValueError, match="output type 'classification' is not one of"):
        registry.metric("m", "classification")
    with pytest.raises(ValueError, match="scope 'batch' is not one of document, corpus, generations"):
        registry.metric("m", "generate_until", "batch")


def test_every_shipped_metric_is_in_the_registry():
    """What task files could name before the registry, by output type, is what the registry offers."""
    assert {t: sorted(task_metrics.available(t)) for t in task_metrics.OUTPUT_TYPES} == {
        "multiple_choice": ["acc", "acc_bytes", "acc_norm", "brier_score"],
        "loglikelihood": ["acc", "perplexity"],
        "loglikelihood_rolling": ["bits_per_byte", "byte_perplexity", "word_perplexity"],
        "generate_until": ["bleu", "chrf", "exact_match", "f1", "pass_at_k", "rouge1", "rouge2", "rougeL"],
    }
