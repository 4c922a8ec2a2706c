"""Running a checked task on a `Scorer` (eval/scorer.py): the prompts, one scorer call per output type,
the metrics the task names (tasks/metrics.py's registry), chance levels and calibration."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmforge.errors import LmforgeError
from lmforge.eval import metrics as M
from lmforge.eval.tasks.errors import TaskError
from lmforge.eval.tasks.filters import apply_filter
from lmforge.eval.tasks.metrics import (
    Answer,
    Answers,
    Choices,
    Generations,
    TargetScore,
    Texts,
    lookup,
    scoped,
)
from lmforge.eval.tasks.spec import Task


@dataclass
class TaskResult:
    name: str
    output_type: str
    num_fewshot: int
    n_docs: int
    metrics: dict[str, float]  # "acc", "exact_match,strict-match", ...
    stderr: dict[str, float]
    chance: dict[str, float]
    samples: list[dict]
    calibration: dict[str, Any] | None = None  # multiple choice: confidences and hits for ECE

    def to_json(self) -> dict:
        return {
            "task": self.name,
            "output_type": self.output_type,
            "num_fewshot": self.num_fewshot,
            "n_docs": self.n_docs,
            "metrics": self.metrics,
            "stderr": self.stderr,
            "chance": self.chance,
            "calibration": None
            if self.calibration is None
            else {k: v for k, v in self.calibration.items() if k not in ("confidence", "correct")},
        }


def check_limit(limit: float | None) -> None:
    """--limit is a whole number of documents or a fraction below 1 (as the harness); 2.5 or NaN would
    otherwise be cut to a count nobody asked for."""
    if limit is None:
        return
    if not math.isfinite(limit) or limit <= 0 or (limit >= 1 and limit != int(limit)):
        raise LmforgeError(f"--limit {limit:g}: give a whole number of documents (e.g. 100) or a fraction "
                           "below 1 (e.g. 0.1)")


def select(n: int, limit: float | None) -> int:
    """How many documents --limit keeps: an int count, or a fraction below 1 (as the harness)."""
    if limit is None:
        return n
    check_limit(limit)
    return min(n, math.ceil(n * limit) if limit < 1 else int(limit))


def first_of_each(records: list[dict], key: str, limit: float | None) -> list[dict]:
    """--limit applied to each group of `records` (by `key`: a task, a red-team category) on its own, the
    first of each in file order, the order kept."""
    if limit is None:
        return records
    sizes: dict[str, int] = {}
    for r in records:
        sizes[r[key]] = sizes.get(r[key], 0) + 1
    keep = {k: select(n, limit) for k, n in sizes.items()}
    out, taken = [], dict.fromkeys(sizes, 0)
    for r in records:
        if taken[r[key]] < keep[r[key]]:
            taken[r[key]] += 1
            out.append(r)
    return out


def run_task(
    task: Task,
    scorer,
    *,
    limit: float | None = None,
    seed: int = 1234,
    say: Callable[[str], None] | None = None,
    chat: Callable[[list[dict]], str] | None = None,
    multiturn: bool = False,
    code_isolation: str = "os",
) -> TaskResult:
    """Score `scorer` (eval/scorer.py) on the task's evaluation split (with `chat`, prompts are
    conversations: see Task.context; the scorer must then read special tokens in its text).
    code_isolation: how pass@k runs model-written code ("os": the whole sandbox; "hook": the audit hook
    only, --unsafe-code-exec); the caller decides, never the task file."""
    docs = task.docs(task.eval_split)
    docs = docs[: select(len(docs), limit)]
    contexts = [
        task.context(i, d, w, task.num_fewshot, seed, chat, multiturn) for i, (w, d) in enumerate(docs)
    ]
    kind = task.output_type
    if say:
        say(
            f"{task.name}: {len(docs)} documents, {kind}, {task.num_fewshot}-shot"
            + (", chat" if chat else "")
        )
    if kind == "multiple_choice":
        # After a chat prompt the answer starts the assistant's turn: no delimiter (as the harness).
        return _multiple_choice(task, scorer, docs, contexts, "" if chat else task.target_delimiter)
    if kind == "loglikelihood":
        return _loglikelihood(task, scorer, docs, contexts)
    if kind == "loglikelihood_rolling":
        return _rolling(task, scorer, docs)
    return _generate(task, scorer, docs, contexts, seed, code_isolation)


def _result(
    task: Task, docs, per_doc: dict[str, list[float]], samples, chance=None, corpus=None, calibration=None
) -> TaskResult:
    metrics, stderr = {}, {}
    for k, values in per_doc.items():
        metrics[k], stderr[k] = M.mean_and_stderr(values)
    metrics.update(corpus or {})
    return TaskResult(
        task.name,
        task.output_type,
        task.num_fewshot,
        len(docs),
        metrics,
        {k: v for k, v in stderr.items() if not math.isnan(v)},
        chance or {},
        samples,
        calibration,
    )


def _scored(scorer, pairs, where_of: Callable[[int], str]) -> list[tuple[float, bool]]:
    from lmforge.eval.scorer import RequestError

    try:
        return scorer.loglikelihood(pairs)
    except RequestError as e:
        raise TaskError(f"{where_of(e.index)}: {e}") from None


def _scores(task: Task, per_doc_input: list, corpus_input: Any, suffix: str = "") -> tuple[dict, dict]:
    """The task's document metrics (one value per document; in the task file's order) and corpus metrics
    (one value; in the registry's order, as reports have always listed them) on what the runner gathered,
    keyed name + suffix (a generation task's filter)."""
    per_doc: dict[str, list[float]] = {}
    corpus: dict[str, float] = {}
    for name, opts in task.metrics.items():
        m = lookup(task.output_type, name)
        if m.scope == "document":
            per_doc[name + suffix] = [m.fn(d, opts) for d in per_doc_input]
    for m in scoped(task.output_type, "corpus"):
        if m.name in task.metrics:
            corpus[m.name + suffix] = m.fn(corpus_input, task.metrics[m.name])
    return per_doc, corpus


def _multiple_choice(task: Task, scorer, docs, contexts, delimiter: str) -> TaskResult:
    pairs, spans, golds, all_choices = [], [], [], []
    for (where, doc), ctx in zip(docs, contexts):
        choices = task.choices(doc, where)
        golds.append(task.gold_index(doc, where, choices))
        spans.append((len(pairs), len(choices)))
        pairs.extend((ctx, delimiter + c) for c in choices)
        all_choices.append(choices)
    owner = [k for k, (_, n) in enumerate(spans) for _ in range(n)]
    scores = _scored(scorer, pairs, lambda i: docs[owner[i]][0])
    scored, samples, conf, hit, probs = [], [], [], [], []
    for (where, _), ctx, (start, n), gold, choices in zip(docs, contexts, spans, golds, all_choices):
        lls = np.array([s[0] for s in scores[start : start + n]])
        chars = np.array([float(len(c)) for c in choices])
        pred, pred_norm = int(np.argmax(lls)), int(np.argmax(lls / chars))
        p = M.softmax(lls)
        probs.append(p)
        conf.append(float(p.max()))
        hit.append(float(pred == gold))
        scored.append(Choices(lls, choices, gold, p))
        samples.append(
            {
                "where": where,
                "context": ctx,
                "choices": choices,
                "gold": gold,
                "loglikelihoods": lls.tolist(),
                "pred": pred,
                "pred_norm": pred_norm,
            }
        )
    per_doc, corpus = _scores(task, scored, scored)
    chance = {}
    for m in per_doc:
        guess = lookup(task.output_type, m).chance
        if guess is not None:
            chance[m] = guess(all_choices)
    calibration = {
        "confidence": conf,
        "correct": hit,
        "ece": M.expected_calibration_error(conf, hit, 10),
        "ece_adaptive": M.expected_calibration_error(conf, hit, 10, adaptive=True),
        "brier_score": M.brier_score(probs, golds),
    }
    return _result(task, docs, per_doc, samples, chance, corpus=corpus, calibration=calibration)


def _loglikelihood(task: Task, scorer, docs, contexts) -> TaskResult:
    targets = [task.target_text(d, w) for w, d in docs]
    scores = _scored(scorer, list(zip(contexts, targets)), lambda i: docs[i][0])
    samples = [
        {"where": w, "context": c, "target": t, "loglikelihood": ll, "greedy": g}
        for (w, _), c, t, (ll, g) in zip(docs, contexts, targets, scores)
    ]
    per_doc, corpus = _scores(
        task, [TargetScore(ll, g) for ll, g in scores], Texts(targets, [ll for ll, _ in scores])
    )
    return _result(task, docs, per_doc, samples, corpus=corpus)


def _rolling(task: Task, scorer, docs) -> TaskResult:
    texts = [task.target_text(d, w) for w, d in docs]
    lls = scorer.rolling_loglikelihood(texts)
    samples = [{"where": w, "loglikelihood": ll} for (w, _), ll in zip(docs, lls)]
    per_doc, corpus = _scores(task, [], Texts(texts, list(lls)))
    return _result(task, docs, per_doc, samples, corpus=corpus)


def _generate(task: Task, scorer, docs, contexts, seed: int, code_isolation: str = "os") -> TaskResult:
    n = task.repeats
    generations = scorer.generate_until(
        [c for c in contexts for _ in range(n)],
        task.until,
        task.max_gen_toks,
        temperature=task.temperature,
        top_k=task.top_k,
        top_p=task.top_p,
        seed=seed,
    )
    per_sample = [generations[i * n : (i + 1) * n] for i in range(len(contexts))]
    outputs = [g[0] for g in per_sample]  # string metrics score the first generation (harness: take_first)
    refs = [task.references(d, w) for w, d in docs]
    per_doc: dict[str, list[float]] = {}
    corpus: dict[str, float] = {}
    samples = [
        {"where": w, "context": c, "references": r, "response": o}
        for (w, _), c, r, o in zip(docs, contexts, refs, outputs)
    ]
    for fname, steps in task.filters:
        suffix = "" if fname == "none" else f",{fname}"
        preds = [apply_filter(steps, o, f"{task.path}: filter {fname}") for o in outputs]
        for s, p in zip(samples, preds):
            s[f"filtered{suffix}"] = p
        doc_values, corpus_values = _scores(
            task, [Answer(p, r) for p, r in zip(preds, refs)], Answers(preds, refs), suffix
        )
        per_doc.update(doc_values)
        corpus.update(corpus_values)
    every = Generations(task, docs, contexts, per_sample, samples, code_isolation)
    for name, opts in task.metrics.items():
        m = lookup(task.output_type, name)
        if m.scope == "generations":
            per_doc.update(m.fn(every, opts))
    chance = {}
    if task.chance is not None:
        chance = {k: task.chance for k in per_doc}
    return _result(task, docs, per_doc, samples, chance, corpus=corpus)


def require_code_sandbox(tasks: Sequence[Task], code_isolation: str, unsafe_hint: str) -> str | None:
    """Before any model loads: where `tasks` run model-written code (pass@k), check that the sandbox can
    run it here (a TaskError saying what is missing and `unsafe_hint`, the caller's way around it).
    Returns how the code will be isolated, in words, or None when no task runs code."""
    from lmforge.eval.sandbox import SandboxUnavailable, check_isolation

    coders = [t.name for t in tasks if "pass_at_k" in t.metrics]
    if not coders:
        return None
    if code_isolation == "hook":
        return "UNSAFE: the in-process audit hook only (--unsafe-code-exec), no operating-system sandbox"
    try:
        return check_isolation()
    except SandboxUnavailable as e:
        raise TaskError(f"{', '.join(coders)}: pass@k runs model-written code: {e}. {unsafe_hint}") from None

