"""`lmforge eval RUN --tasks ...`: task evaluation of a run (or checkpoint, or HF dir) with a results
JSON, the per-document samples (JSONL) and a markdown report with reliability diagrams.

Written into the run dir (never over anything but an earlier report of the same step and weights):
  eval_harness_step_N.json          scores, standard errors, chance levels, calibration, settings
  eval_harness_step_N.samples.jsonl one line per document: prompt, choices / response, scores
  eval_report_step_N.md             the tables, and eval_report_step_N/<task>_reliability.png
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from lmforge.eval import metrics as M
from lmforge.eval.bundle import BUNDLE, build_bundle
from lmforge.eval.scorer import Scorer
from lmforge.eval.tasks import TaskResult, load_tasks, run_task
from lmforge.utils.io import atomic_write_json, atomic_write_text


def resolve_items(items: Sequence[str], workdir: Path) -> list[str]:
    """--tasks items with `builtin:code` replaced by the dir the shipped tasks are built into."""
    out = []
    for item in items:
        if item == BUNDLE:
            build_bundle(workdir / "builtin_code")
            out.append(str(workdir / "builtin_code"))
        else:
            out.append(item)
    return out


def eval_harness(
    path: str | Path,
    items: Sequence[str],
    overrides: Sequence[str] = (),
    weights: str = "model",
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 16,
    seed: int = 1234,
    say: Callable[[str], None] = print,
) -> dict:
    from lmforge.eval.entry import load_run

    with tempfile.TemporaryDirectory(prefix="lmforge-tasks-") as tmp:
        tasks = load_tasks(resolve_items(items, Path(tmp)), num_fewshot)
        for t in tasks:  # read every task's documents before the model is loaded: errors come first
            t.docs(t.eval_split)
        run = load_run(path, list(overrides), weights)
        scorer = Scorer(
            run.model,
            run.tokenizer,
            device=run.device,
            batch_size=batch_size,
            autocast=run.precision.autocast,
        )
        results = [run_task(t, scorer, limit=limit, seed=seed, say=say) for t in tasks]
    suffix = "" if weights == "model" else f"_{weights}"
    stem = f"step_{run.step:08d}{suffix}"
    out = {
        "step": run.step,
        "weights": weights,
        "weights_from": str(run.weights_from),
        "seed": seed,
        "limit": limit,
        "tasks": {r.name: r.to_json() for r in results},
    }
    run_dir = run.run_dir
    atomic_write_json(run_dir / f"eval_harness_{stem}.json", out)
    lines = []
    for r in results:
        lines.extend(json.dumps({"task": r.name, **s}, default=float) for s in r.samples)
    atomic_write_text(run_dir / f"eval_harness_{stem}.samples.jsonl", "\n".join(lines) + "\n")
    write_report(run_dir, stem, out, results)
    return out


def write_report(run_dir: Path, stem: str, out: dict, results: list[TaskResult]) -> Path:
    """The markdown report of one evaluation, with a reliability diagram per multiple-choice task."""
    figures = run_dir / f"eval_report_{stem}"
    md = [
        f"# lmforge eval: {run_dir.name}, step {out['step']} ({out['weights']} weights)",
        "",
        f"Weights: `{out['weights_from']}`. Few-shot seed {out['seed']}"
        + (f", first {out['limit']} documents per task" if out["limit"] else "")
        + ".",
        "",
        "| task | type | shots | docs | metric | value | ± stderr | chance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for k, v in r.metrics.items():
            err = r.stderr.get(k)
            chance = r.chance.get(k)
            md.append(
                f"| {r.name} | {r.output_type} | {r.num_fewshot} | {r.n_docs} | {k} | {_fmt(k, v)} | "
                f"{'' if err is None else _fmt(k, err)} | {'' if chance is None else _fmt(k, chance)} |"
            )
    calibrated = [r for r in results if r.calibration]
    if calibrated:
        md += [
            "",
            "## Calibration (multiple choice: confidence = the softmax of the choices' log-likelihoods)",
            "",
            "| task | ECE (10 equal-width bins) | ECE (10 adaptive bins) | Brier score |",
            "|---|---|---|---|",
        ]
        for r in calibrated:
            c = r.calibration
            md.append(f"| {r.name} | {c['ece']:.4f} | {c['ece_adaptive']:.4f} | {c['brier_score']:.4f} |")
        md.append("")
        for r in calibrated:
            png = M.reliability_diagram(
                r.calibration["confidence"],
                r.calibration["correct"],
                figures / f"{r.name}_reliability.png",
                f"{r.name} (step {out['step']})",
            )
            md.append(f"![{r.name} reliability]({figures.name}/{png.name})")
    path = run_dir / f"eval_report_{stem}.md"
    atomic_write_text(path, "\n".join(md) + "\n")
    return path


def _fmt(metric: str, value: float) -> str:
    if metric.split(",")[0] in ("acc", "acc_norm", "acc_bytes", "exact_match", "f1"):
        return f"{100 * value:.2f}%"
    return f"{value:.4f}"
