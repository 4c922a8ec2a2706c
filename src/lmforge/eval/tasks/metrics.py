"""The metrics a task file may name in its `metric_list`, in one registry: a new metric is one decorated
function here (and its test); the task loader, the runners and the error messages read the registry.

Each metric belongs to one output type and has a scope, which says what its function is given:

  document     fn(one document's scores, options) -> float; the task's value is the mean over documents,
               with its standard error (acc, exact_match, f1, brier_score)
  corpus       fn(every document's scores, options) -> float; one value, no standard error (perplexity,
               bleu, chrf, rouge)
  generations  fn(Generations, options) -> {name: per-document values}; for metrics that need every
               sampled generation, not the filtered first one (pass@k runs them in the sandbox)

What a function is given per output type (the dataclasses below):

  multiple_choice        document: Choices
  loglikelihood          document: TargetScore; corpus: Texts (the targets and their log-likelihoods)
  loglikelihood_rolling  corpus: Texts (the documents and their log-likelihoods)
  generate_until         document: Answer; corpus: Answers (both per filter); generations: Generations

`options` are the metric's other keys in the task file, as its `options` check returned them (a metric
without a check takes none of its own). Generation metrics are reported per filter ("exact_match,strict").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.eval import metrics as M
from lmforge.eval.tasks.errors import TaskError
from lmforge.eval.tasks.spec import BOUNDS, OUTPUT_TYPES
from lmforge.utils.safe_regex import compile_regex

SCOPES = ("document", "corpus", "generations")


@dataclass(frozen=True)
class Metric:
    name: str
    output_type: str
    scope: str
    fn: Callable[..., Any]
    default: bool  # scored when the task file has no metric_list
    options: Callable[[dict, Path, int], dict] | None  # checks a metric_list entry's options
    chance: Callable[[Sequence[list[str]]], float] | None  # multiple choice: a uniform guess's value


REGISTRY: dict[tuple[str, str], Metric] = {}  # (output type, name) -> metric, in registration order


def metric(
    name: str,
    output_type: str,
    scope: str = "document",
    *,
    default: bool = False,
    options: Callable[[dict, Path, int], dict] | None = None,
    chance: Callable[[Sequence[list[str]]], float] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as metric `name` of `output_type` tasks (see the module doc)."""
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"metric {name}: output type {output_type!r} is not one of "
                         f"{', '.join(OUTPUT_TYPES)}")
    if scope not in SCOPES:
        raise ValueError(f"metric {name}: scope {scope!r} is not one of {', '.join(SCOPES)}")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if (output_type, name) in REGISTRY:
            raise ValueError(f"metric {name} of {output_type} tasks is registered twice")
        REGISTRY[(output_type, name)] = Metric(name, output_type, scope, fn, default, options, chance)
        return fn

    return register


def available(output_type: str) -> list[str]:
    return [name for (kind, name) in REGISTRY if kind == output_type]


def lookup(output_type: str, name: str) -> Metric:
    return REGISTRY[(output_type, name)]


def scoped(output_type: str, scope: str) -> list[Metric]:
    """The metrics of `output_type` tasks with `scope`, in registration order."""
    return [m for (kind, _), m in REGISTRY.items() if kind == output_type and m.scope == scope]


def parse_metrics(metric_list: Any, output_type: str, path: Path) -> dict[str, dict]:
    """A task file's metric_list, checked: metric -> its options (the defaults without a list)."""
    if metric_list is None:
        return {m.name: {} for (kind, _), m in REGISTRY.items() if kind == output_type and m.default}
    if not isinstance(metric_list, list) or not metric_list:
        raise TaskError(f"{path}: key 'metric_list' must be a non-empty list of {{metric: name, ...}}")
    out = {}
    for i, item in enumerate(metric_list):
        if not isinstance(item, dict) or not isinstance(item.get("metric"), str):
            raise TaskError(f"{path}: metric_list[{i}] needs a 'metric' name")
        name = item["metric"]
        if (output_type, name) not in REGISTRY:
            raise TaskError(
                f"{path}: metric_list[{i}] '{name}' is not available for {output_type} "
                f"(available: {', '.join(sorted(available(output_type)))})"
            )
        opts = {k: v for k, v in item.items() if k not in ("metric", "aggregation", "higher_is_better")}
        check = REGISTRY[(output_type, name)].options
        out[name] = opts if check is None else check(opts, path, i)
    return out


# ------------------------------------------------------------------------------ what metrics are given


@dataclass
class Choices:
    """One multiple-choice document: the choices' log-likelihoods, the choices, the gold index and the
    softmax of the log-likelihoods."""

    loglikelihoods: np.ndarray
    choices: list[str]
    gold: int
    probs: np.ndarray


@dataclass
class TargetScore:
    """One loglikelihood document: the target's log-likelihood and whether it is the greedy reply."""

    loglikelihood: float
    greedy: bool


@dataclass
class Texts:
    """Every document's text (a loglikelihood task's targets, a rolling task's documents) and its
    log-likelihood."""

    texts: list[str]
    loglikelihoods: list[float]


@dataclass
class Answer:
    """One generation document: its response after a filter, and its references."""

    prediction: str
    references: list[str]


@dataclass
class Answers:
    """Every generation document's filtered response and references; `once` keeps a value several
    metrics share (ROUGE scores its three variants in one pass)."""

    predictions: list[str]
    references: list[list[str]]
    _kept: dict[str, Any] = field(default_factory=dict, repr=False)

    def once(self, key: str, compute: Callable[[], Any]) -> Any:
        if key not in self._kept:
            self._kept[key] = compute()
        return self._kept[key]


@dataclass
class Generations:
    """A generation task's every sample: `per_sample[i]` holds document i's `task.repeats` generations;
    a metric may add what it found to `samples[i]` (the samples JSONL)."""

    task: Any  # spec.Task
    docs: list[tuple[str, dict]]
    contexts: list[str]
    per_sample: list[list[str]]
    samples: list[dict]
    isolation: str  # how model-written code runs: "os" or "hook" (runners.run_task)


# ---------------------------------------------------------------------------------- multiple choice


def _choice_chance(all_choices: Sequence[list[str]]) -> float:
    return float(np.mean([1.0 / len(c) for c in all_choices]))


@metric("acc", "multiple_choice", default=True, chance=_choice_chance)
def _mc_acc(d: Choices, opts: dict) -> float:
    return float(int(np.argmax(d.loglikelihoods)) == d.gold)


@metric("acc_norm", "multiple_choice", default=True, chance=_choice_chance)
def _mc_acc_norm(d: Choices, opts: dict) -> float:
    """Per character of the choice, as the harness."""
    chars = np.array([float(len(c)) for c in d.choices])
    return float(int(np.argmax(d.loglikelihoods / chars)) == d.gold)


@metric("acc_bytes", "multiple_choice", chance=_choice_chance)
def _mc_acc_bytes(d: Choices, opts: dict) -> float:
    nbytes = np.array([float(len(c.encode("utf-8"))) for c in d.choices])
    return float(int(np.argmax(d.loglikelihoods / nbytes)) == d.gold)


@metric("brier_score", "multiple_choice", default=True,
        chance=lambda all_choices: float(np.mean([1.0 - 1.0 / len(c) for c in all_choices])))
def _mc_brier(d: Choices, opts: dict) -> float:
    return M.brier_score([d.probs], [d.gold])


# --------------------------------------------------------------------------------------- likelihood


@metric("perplexity", "loglikelihood", "corpus", default=True)
def _ll_perplexity(c: Texts, opts: dict) -> float:
    """The harness: exp(-mean log-likelihood per document)."""
    return math.exp(min(-float(np.mean(c.loglikelihoods)), 700.0))


@metric("acc", "loglikelihood", default=True)
def _ll_acc(d: TargetScore, opts: dict) -> float:
    return float(d.greedy)


@metric("word_perplexity", "loglikelihood_rolling", "corpus", default=True)
def _word_perplexity(c: Texts, opts: dict) -> float:
    words = sum(len(re.split(r"\s+", t)) for t in c.texts)  # the harness's count_words
    return math.exp(min(-float(sum(c.loglikelihoods)) / words, 700.0))


def _bytes(c: Texts) -> int:
    return sum(len(t.encode("utf-8")) for t in c.texts)


@metric("byte_perplexity", "loglikelihood_rolling", "corpus", default=True)
def _byte_perplexity(c: Texts, opts: dict) -> float:
    return math.exp(min(-float(sum(c.loglikelihoods)) / _bytes(c), 700.0))


@metric("bits_per_byte", "loglikelihood_rolling", "corpus", default=True)
def _bits_per_byte(c: Texts, opts: dict) -> float:
    return -float(sum(c.loglikelihoods)) / _bytes(c) / math.log(2)


# --------------------------------------------------------------------------------------- generation


def _exact_match_options(opts: dict, path: Path, i: int) -> dict:
    allowed = {"ignore_case", "ignore_punctuation", "ignore_numbers", "regexes_to_ignore"}
    bad = sorted(set(opts) - allowed)
    if bad:
        raise TaskError(f"{path}: metric_list[{i}] exact_match has unknown option(s) {', '.join(bad)}")
    regexes = opts.get("regexes_to_ignore", [])
    regexes = [regexes] if isinstance(regexes, str) else regexes
    if not isinstance(regexes, list):
        raise TaskError(f"{path}: metric_list[{i}] exact_match.regexes_to_ignore must be a list of regexes")
    for pattern in regexes:  # each compiles (and is kept) under the regex time budget
        compile_regex(pattern, f"{path}: exact_match.regexes_to_ignore", TaskError)
    return {**opts, "regexes_to_ignore": regexes} if regexes else opts


@metric("exact_match", "generate_until", default=True, options=_exact_match_options)
def _exact_match(d: Answer, opts: dict) -> float:
    return M.exact_match(d.prediction, d.references, **opts)


@metric("f1", "generate_until")
def _f1(d: Answer, opts: dict) -> float:
    return M.token_f1(d.prediction, d.references)


@metric("bleu", "generate_until", "corpus")
def _bleu(c: Answers, opts: dict) -> float:
    return M.corpus_bleu(c.predictions, c.references)


@metric("chrf", "generate_until", "corpus")
def _chrf(c: Answers, opts: dict) -> float:
    return M.corpus_chrf(c.predictions, c.references)


def _rouge(kind: str) -> Callable[[Answers, dict], float]:
    def score(c: Answers, opts: dict) -> float:
        return c.once("rouge", lambda: M.rouge(c.predictions, c.references))[kind]

    return score


for _kind in M.ROUGE_TYPES:
    metric(_kind, "generate_until", "corpus")(_rouge(_kind))


def _pass_at_k_options(opts: dict, path: Path, i: int) -> dict:
    bad = sorted(set(opts) - {"k", "test", "timeout_s", "memory_mb"})
    if bad:
        raise TaskError(f"{path}: metric_list[{i}] pass_at_k has unknown option(s) {', '.join(bad)}")
    ks = opts.get("k", [1])
    ks = [ks] if isinstance(ks, int) else ks
    if not isinstance(ks, list) or not ks:
        raise TaskError(f"{path}: metric_list[{i}] pass_at_k.k must be a positive integer or a list of them")
    for k in ks:
        BOUNDS["pass_at_k.k"].check(k, f"{path}: metric_list[{i}] pass_at_k.k", TaskError)
    if not isinstance(opts.get("test"), str) or not opts["test"].strip():
        raise TaskError(
            f"{path}: metric_list[{i}] pass_at_k needs 'test': a document field or a template of "
            "the test code run after the prompt and the completion (e.g. "
            '"{{test}}\\ncheck({{entry_point}})")'
        )
    for key in ("timeout_s", "memory_mb"):
        if opts.get(key) is not None:
            where = f"{path}: metric_list[{i}] pass_at_k.{key}"
            BOUNDS[f"pass_at_k.{key}"].check(opts[key], where, TaskError)
    return {**opts, "k": ks}


@metric("pass_at_k", "generate_until", "generations", options=_pass_at_k_options)
def _pass_at_k(g: Generations, opts: dict) -> dict[str, list[float]]:
    """Run prompt + completion + the test code of every generation in the sandbox; per document the
    unbiased pass@k estimate from its `repeats` generations (k larger than repeats: not reported)."""
    from lmforge.eval.sandbox import run_many

    task, programs = g.task, []
    for (where, doc), ctx, gens in zip(g.docs, g.contexts, g.per_sample):
        test = task._field(opts["test"], doc, where, "pass_at_k.test")
        if not isinstance(test, str):
            raise TaskError(f"{where}: pass_at_k.test gives {type(test).__name__}, not code")
        programs.extend(ctx + gen + "\n\n" + test + "\n" for gen in gens)
    outcomes = run_many(
        programs,
        timeout_s=float(opts.get("timeout_s", 5.0)),
        memory_mb=int(opts.get("memory_mb", 512)),
        isolation=g.isolation,
    )
    n = task.repeats
    out: dict[str, list[float]] = {f"pass@{k}": [] for k in opts["k"] if k <= n}
    for i, s in enumerate(g.samples):
        mine = outcomes[i * n : (i + 1) * n]
        c = sum(o.passed for o in mine)
        s["generations"] = g.per_sample[i]
        s["outcomes"] = [f"{o.status}: {o.detail}" if o.detail else o.status for o in mine]
        for k in out:
            out[k].append(M.pass_at_k(n, c, int(k.split("@")[1])))
    return out
