"""Span metrics of the understanding tasks, over a whole split: entity-level precision / recall / F1 of a
tagger's BIO / IOB2 tags (seqeval's definitions) and exact match / F1 of an extractive reader's answers
(the SQuAD v1.1 evaluation script's), and `lmforge tag --report` / `lmforge qa --report`.

Entities (seqeval 1.2.2's default, lenient mode, `get_entities`): the sentences are read as one sequence
with an O between them; a tag is split into its prefix (B, I, E, S, or O) and type (what follows the
first '-'); a chunk ends where the prefix or the type says so (B/I followed by B, S or O; E or S; a type
change) and starts at B or S, at I/E after O or E/S, or at a type change; an I-X after O starts an
entity. An entity is (type, first word, last word); precision = true entities predicted exactly /
predicted entities, recall = / true entities, F1 their harmonic mean (0 where a denominator is 0), micro
over all types and per type. Only whole-entity matches count.

SQuAD: normalize_answer lowercases, drops punctuation (string.punctuation), the articles a / an / the and
extra whitespace; exact match is the normalized strings' equality, F1 the bag-of-tokens F1 of the two
normalized answers (0 with no common token); each question scores its best gold answer; both are means
in percent.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.eval.classification_metrics import classification_metrics


# -- entities (seqeval) -------------------------------------------------------------------------------
def _split_tag(tag: str) -> tuple[str, str]:
    return tag[0], tag[1:].split("-", maxsplit=1)[-1] or "_"


def _ends(prev: str, tag: str, prev_type: str, type_: str) -> bool:
    return (prev in ("E", "S") or (prev in ("B", "I") and tag in ("B", "S", "O"))
            or (prev not in ("O", ".") and prev_type != type_))


def _starts(prev: str, tag: str, prev_type: str, type_: str) -> bool:
    return (tag in ("B", "S") or (prev in ("E", "S", "O") and tag in ("E", "I"))
            or (tag not in ("O", ".") and prev_type != type_))


def entities(sentences: list[list[str]]) -> list[tuple[str, int, int]]:
    """(type, first, last) of each entity of the sentences, positions counted over the sentences joined
    with an O after each (seqeval's get_entities of a list of lists)."""
    seq = [t for s in sentences for t in (*s, "O")]
    prev, prev_type, begin, out = "O", "", 0, []
    for i, tag in enumerate([*seq, "O"]):
        t, type_ = _split_tag(tag)
        if _ends(prev, t, prev_type, type_):
            out.append((prev_type, begin, i - 1))
        if _starts(prev, t, prev_type, type_):
            begin = i
        prev, prev_type = t, type_
    return out


def _prf(correct: int, pred: int, true: int) -> dict[str, float]:
    p = correct / pred if pred else 0.0
    r = correct / true if true else 0.0
    return {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0}


def entity_metrics(truth: list[list[str]], pred: list[list[str]]) -> dict[str, Any]:
    """Micro precision / recall / F1 of the entities and the same per entity type with its support."""
    if [len(s) for s in truth] != [len(s) for s in pred]:
        raise ValueError("the true and predicted tag sequences must have the same lengths")
    t, p = set(entities(truth)), set(entities(pred))
    out = _prf(len(t & p), len(p), len(t))
    per = []
    for kind in sorted({e[0] for e in t | p}):
        tk, pk = {e for e in t if e[0] == kind}, {e for e in p if e[0] == kind}
        per.append({"type": kind, **_prf(len(tk & pk), len(pk), len(tk)), "support": len(tk)})
    return {**out, "entities": len(t), "per_type": per}


def tagging_metrics(truth: list[list[int]], pred: list[list[int]], labels: list) -> dict[str, Any]:
    """A tagger's split: token accuracy and per-tag precision / recall / F1 over the tagged words, and
    the entity metrics of the tag names (BIO / IOB2)."""
    flat_t = np.asarray([x for s in truth for x in s], dtype=np.int64)
    flat_p = np.asarray([x for s in pred for x in s], dtype=np.int64)
    n = max(len(labels), int(flat_t.max(initial=0)) + 1, int(flat_p.max(initial=0)) + 1)
    tokens = classification_metrics(flat_t, flat_p, n)
    name = lambda k: str(labels[k]) if k < len(labels) else str(k)  # noqa: E731
    per_tag = [{"label": name(k), **row} for k, row in enumerate(tokens["per_class"])]
    ents = entity_metrics([[name(k) for k in s] for s in truth], [[name(k) for k in s] for s in pred])
    return {"sentences": len(truth), "words": int(len(flat_t)), "accuracy": tokens["accuracy"],
            "entity_precision": ents["precision"], "entity_recall": ents["recall"], "entity_f1": ents["f1"],
            "entities": ents["entities"], "per_type": ents["per_type"], "per_tag": per_tag}


# -- SQuAD v1.1 ---------------------------------------------------------------------------------------
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD v1.1 script's)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def squad_f1(prediction: str, truth: str) -> float:
    p, t = normalize_answer(prediction).split(), normalize_answer(truth).split()
    same = sum((Counter(p) & Counter(t)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(t)
    return 2 * precision * recall / (precision + recall)


def squad_exact(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def squad_metrics(predictions: list[str], answers: list[list[str]]) -> dict[str, float]:
    """exact_match and f1 in percent: each prediction against its best gold answer."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} questions")
    em = sum(max(squad_exact(p, a) for a in golds) for p, golds in zip(predictions, answers))
    f1 = sum(max(squad_f1(p, a) for a in golds) for p, golds in zip(predictions, answers))
    n = len(predictions)
    return {"questions": n, "exact_match": 100.0 * em / n if n else 0.0, "f1": 100.0 * f1 / n if n else 0.0}


# -- lmforge tag --report ----------------------------------------------------------------------------
@torch.no_grad()
def tag_predictions(run, max_batches: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """(true, predicted) tag indices of each validation sentence's words (their first sub-words)."""
    from lmforge.data.batch import IGNORE_INDEX
    from lmforge.engine.objectives.token_classify import token_scores

    model, truth, preds = run.model, [], []
    model.eval()
    for batch in run.val_loader.iter_eval_batches(max_batches):
        batch = batch.to(run.device)
        best = token_scores(model, batch.input_ids, batch.lengths).argmax(-1).cpu().numpy()
        labels = batch.labels.cpu().numpy()
        for row_labels, row_best in zip(labels, best):
            keep = row_labels != IGNORE_INDEX
            truth.append(row_labels[keep].tolist())
            preds.append(row_best[keep].tolist())
    return truth, preds


def tag_report(cfg, say=print) -> dict[str, Any]:
    """`lmforge tag --report`: the run at run.dir evaluated on eval.split, printed and written to
    tag_<split>_step_N.json in the run dir."""
    from lmforge.assembly import build_run
    from lmforge.checkpoint.runs import run_config
    from lmforge.config.methods import method_facts
    from lmforge.data import data_dir
    from lmforge.data.task_data import load_task_data
    from lmforge.errors import ConfigError
    from lmforge.utils.io import atomic_write_json

    saved, source = run_config(cfg.run.dir, [f"eval.split={cfg.eval.split}"])
    if method_facts(saved).data != "tagged":
        raise ConfigError(f"{cfg.run.dir} is a run of objective {saved.objective.name}, not a tagger: "
                          "--report evaluates the run.dir of an `lmforge tag` run")
    run = build_run(saved, "eval", weights_from=source)
    truth, preds = tag_predictions(run, saved.eval.max_batches)
    labels = load_task_data(data_dir(saved)).labels
    out = {"step": run.step, "split": saved.eval.split, **tagging_metrics(truth, preds, labels)}
    written = Path(run.run_dir) / f"tag_{saved.eval.split}_step_{run.step:08d}.json"
    atomic_write_json(written, out)
    say(format_tag_report(out))
    say(f"results: {written}")
    return out


def format_tag_report(out: dict[str, Any]) -> str:
    lines = [f"{out['split']} ({out['sentences']:,} sentences, {out['words']:,} words, step {out['step']}): "
             f"token accuracy {out['accuracy']:.4f}  entity precision {out['entity_precision']:.4f}  "
             f"recall {out['entity_recall']:.4f}  F1 {out['entity_f1']:.4f}",
             f"  {'entity type':<20} {'precision':>9} {'recall':>9} {'f1':>9} {'support':>8}"]
    for row in out["per_type"]:
        lines.append(f"  {json.dumps(row['type'])[:20]:<20} {row['precision']:>9.4f} {row['recall']:>9.4f} "
                     f"{row['f1']:>9.4f} {row['support']:>8}")
    lines.append(f"  {'label':<20} {'precision':>9} {'recall':>9} {'f1':>9} {'support':>8}")
    for row in out["per_tag"]:
        lines.append(f"  {json.dumps(row['label'])[:20]:<20} {row['precision']:>9.4f} {row['recall']:>9.4f} "
                     f"{row['f1']:>9.4f} {row['support']:>8}")
    return "\n".join(lines)


# -- lmforge qa --report ------------------------------------------------------------------------------
def best_span(start: torch.Tensor, end: torch.Tensor, valid: torch.Tensor, max_tokens: int
              ) -> tuple[float, int, int] | None:
    """(score, first, last) of the span of context tokens (`valid`) with the highest start + end logit,
    first <= last and at most max_tokens long (run_qa's rule); None when no token is valid."""
    t = start.numel()
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    ok = valid[:, None] & valid[None, :] & (j >= i) & (j - i < max_tokens)
    if not bool(ok.any()):
        return None
    scores = (start[:, None] + end[None, :]).masked_fill(~ok, float("-inf"))
    k = int(scores.flatten().argmax())
    return float(scores.flatten()[k]), k // t, k % t


@torch.no_grad()
def qa_predictions(run, split: str, max_batches: int | None = None) -> tuple[list[str], list[list[str]]]:
    """(predicted answer, gold answers) of each record of `split` whose windows the evaluation reads
    (eval.max_batches batches of them; a record cut off by that limit is left out): the best valid span
    over all its windows ("" when none has one)."""
    from lmforge.data import data_dir
    from lmforge.data.squad import read_examples
    from lmforge.engine.objectives.qa import span_logits

    loader, model = run.val_loader, run.model
    examples = read_examples(data_dir(run.cfg), split)
    windows = loader.split
    size = run.cfg.train.micro_batch_size
    limit = len(windows) if max_batches is None else min(len(windows), max_batches * size)
    max_tokens = run.cfg.qa.max_answer_tokens
    best: dict[int, tuple[float, str]] = {}
    model.eval()
    for b in range(0, limit, size):
        rows = np.arange(b, min(b + size, limit))
        start, end = span_logits(model, loader.collate(rows).to(run.device))
        for r, w in enumerate(rows):
            k = int(windows.example[w])
            cs, ce = windows.rows("char_start", int(w)), windows.rows("char_end", int(w))
            found = best_span(start[r, : len(cs)].cpu(), end[r, : len(cs)].cpu(), torch.from_numpy(cs >= 0),
                              max_tokens)
            if found is None:
                best.setdefault(k, (float("-inf"), ""))
                continue
            score, s, e = found
            if k not in best or score > best[k][0]:
                best[k] = (score, examples[k]["context"][int(cs[s]): int(ce[e])].strip())
    cut = set(windows.example[limit:].tolist())  # records whose later windows were not read
    seen = sorted(k for k in best if k not in cut)
    return [best[k][1] for k in seen], [examples[k]["answers"] for k in seen]


def qa_report(cfg, say=print) -> dict[str, Any]:
    """`lmforge qa --report`: the run at run.dir evaluated on eval.split, printed and written to
    qa_<split>_step_N.json in the run dir."""
    from lmforge.assembly import build_run
    from lmforge.checkpoint.runs import run_config
    from lmforge.config.methods import method_facts
    from lmforge.errors import ConfigError
    from lmforge.utils.io import atomic_write_json

    saved, source = run_config(cfg.run.dir, [f"eval.split={cfg.eval.split}"])
    if method_facts(saved).data != "spans":
        raise ConfigError(f"{cfg.run.dir} is a run of objective {saved.objective.name}, not a question "
                          "answerer: --report evaluates the run.dir of an `lmforge qa` run")
    run = build_run(saved, "eval", weights_from=source)
    preds, golds = qa_predictions(run, saved.eval.split, saved.eval.max_batches)
    out = {"step": run.step, "split": saved.eval.split, **squad_metrics(preds, golds),
           "samples": [{"prediction": p, "answers": g} for p, g in list(zip(preds, golds))[:20]]}
    written = Path(run.run_dir) / f"qa_{saved.eval.split}_step_{run.step:08d}.json"
    atomic_write_json(written, out)
    say(f"{out['split']} ({out['questions']:,} questions, step {out['step']}): exact match "
        f"{out['exact_match']:.2f}  F1 {out['f1']:.2f}")
    say(f"results: {written}")
    return out
