"""`lmforge eval tasks RUN --tasks ...`: task evaluation of a run (or checkpoint, or HF dir) with a results
JSON, the per-document samples (JSONL) and a markdown report with reliability diagrams.

Written into the run dir (never over anything but an earlier report of the same step and weights):
  eval_harness_step_N.json          scores, standard errors, chance levels, calibration, settings
  eval_harness_step_N.samples.jsonl one line per document: prompt, choices / response, scores
  eval_report_step_N.md             the tables, and eval_report_step_N/<task>_reliability.png
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from lmforge.errors import LmforgeError
from lmforge.eval import metrics as M
from lmforge.eval.bundle import BUNDLE, build_bundle
from lmforge.eval.scorer import Scorer
from lmforge.eval.tasks import Task, TaskResult, load_tasks, require_code_sandbox, run_task
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


def load_task_set(items: Sequence[str], num_fewshot: int | None = None) -> list[Task]:
    """The tasks `items` name, with every split they use read into memory (the built-in tasks are
    built in a temporary dir that is gone afterwards)."""
    with tempfile.TemporaryDirectory(prefix="lmforge-tasks-") as tmp:
        tasks = load_tasks(resolve_items(items, Path(tmp)), num_fewshot)
        for t in tasks:
            t.docs(t.eval_split)
            if t.num_fewshot and t.fewshot_split is not None:
                t.docs(t.fewshot_split)
    return tasks


def eval_harness(
    paths: str | Path | Sequence[str | Path],
    items: Sequence[str],
    overrides: Sequence[str] = (),
    weights: str = "model",
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 16,
    seed: int = 1234,
    chat: bool = False,
    multiturn: bool = False,
    all_checkpoints: bool = False,
    compare_out: str | Path | None = None,
    contamination: bool = True,
    say: Callable[[str], None] = print,
    code_isolation: str = "os",
) -> list[dict]:
    """Evaluate the tasks named by `items` on each run of `paths` (run dirs, checkpoint dirs or HF dirs).

    all_checkpoints: every kept checkpoint of each run, then a curve per task metric
    (eval_curves.md / eval_curves.png in the run dir). Several paths: a side-by-side comparison of
    their (latest) results, written to `compare_out` (default eval_compare.md here).
    chat / multiturn: prompts rendered with each run's chat template (Task.context).
    contamination: each task's word 13-gram overlap with the run's training data (eval/contamination.py).
    code_isolation: how pass@k tasks run model-written code: "os" (the sandbox; refused where it cannot
    run) or "hook" (--unsafe-code-exec: the in-process audit hook only).
    Returns the results of each path's last evaluation."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise LmforgeError("give at least one run dir, checkpoint dir or Hugging Face dir")
    outs = []
    tasks = load_task_set(items, num_fewshot)  # every document read before a model is loaded
    code = require_code_sandbox(tasks, code_isolation, UNSAFE_HINT)
    if code is not None:
        say(f"{'warning: ' if code_isolation == 'hook' else ''}model-written code runs under {code}")
    for path in paths:
        overlap = contamination_of(path, tasks, limit, say) if contamination else None
        targets = checkpoints_of(path) if all_checkpoints else [Path(path)]
        run_outs = []
        for target in targets:
            if len(targets) > 1:
                say(f"{target}:")
            run_outs.append(
                evaluate_run(
                    target, tasks, overrides, weights, limit, batch_size, seed, chat, multiturn, say, overlap,
                    code_isolation=code_isolation, code_execution=code,
                )
            )
        if all_checkpoints:
            curves = write_curves(Path(run_outs[-1]["run_dir"]), run_outs)
            say(f"curves:  {curves} (and {curves.with_suffix('.png').name})")
        outs.append(run_outs[-1])
    if len(paths) > 1:
        compared = write_comparison(Path(compare_out or "eval_compare.md"), [str(p) for p in paths], outs)
        say(f"comparison: {compared}")
    return outs


UNSAFE_HINT = (
    "Or pass --unsafe-code-exec to run it with the in-process audit hook only (not a security boundary: "
    "only for code you trust)"
)
CONTAMINATION_MAX_CHARS = 500_000_000  # training text read for the overlap report, at most


def contamination_of(
    path: str | Path, tasks: list[Task], limit: float | None, say: Callable[[str], None]
) -> dict:
    """Word 13-gram overlap of each task's documents (every string in a document, as the curation
    step's decontamination reads eval files) with the training split of the run at `path`."""
    from lmforge.checkpoint.runs import run_config
    from lmforge.data.curate.steps.decontaminate import _strings
    from lmforge.errors import DataError
    from lmforge.eval.contamination import run_contamination
    from lmforge.eval.tasks import select

    cfg, _ = run_config(path)
    if not (Path(cfg.run.dir) / "config.yaml").is_file():
        return {"skipped": "a Hugging Face model dir: lmforge does not know its training data"}
    docs = {}
    for t in tasks:
        kept = t.docs(t.eval_split)
        docs[t.name] = ["\n\n".join(_strings(d)) for _, d in kept[: select(len(kept), limit)]]
    try:
        out = run_contamination(cfg, docs, max_chars=CONTAMINATION_MAX_CHARS)
    except DataError as e:
        return {"skipped": f"the training data cannot be read: {e}"}
    flagged = {k: v["contaminated"] for k, v in out["tasks"].items() if v["contaminated"]}
    say(
        "contamination (13-gram overlap with the training data): "
        + (
            ", ".join(f"{k} {n} document{'s' * (n != 1)}" for k, n in flagged.items())
            if flagged
            else "none found"
        )
    )
    return out


def checkpoints_of(path: str | Path) -> list[Path]:
    """The kept checkpoints of the run at `path`, oldest first."""
    from lmforge.checkpoint.manager import list_checkpoints
    from lmforge.checkpoint.runs import run_config

    cfg, _ = run_config(path)
    found = [c.path for c in list_checkpoints(Path(cfg.run.dir) / "checkpoints")]
    if not found:
        raise LmforgeError(
            f"{path}: --all-checkpoints found no checkpoints in {Path(cfg.run.dir) / 'checkpoints'}"
        )
    return found


def evaluate_run(
    path: Path,
    tasks: list[Task],
    overrides: Sequence[str],
    weights: str,
    limit: float | None,
    batch_size: int,
    seed: int,
    chat: bool,
    multiturn: bool,
    say: Callable[[str], None],
    contamination: dict | None = None,
    code_isolation: str = "os",
    code_execution: str | None = None,
) -> dict:
    """One model on every task; results JSON, samples and report written into its run dir."""
    from lmforge.data.chat_template import stop_ids
    from lmforge.eval.open_run import chat_template_of, load_run

    run = load_run(path, list(overrides), weights)
    render, stops = None, None
    if chat:
        template = chat_template_of(run)
        stops = stop_ids(template, run.tokenizer)
        render = lambda messages: template.render(messages, add_generation_prompt=True)  # noqa: E731
    scorer = Scorer(
        run.model,
        run.tokenizer,
        device=run.device,
        batch_size=batch_size,
        autocast=run.precision.autocast,
        chat=chat,
        stops=stops,
    )
    results = [
        run_task(
            t, scorer, limit=limit, seed=seed, say=say, chat=render, multiturn=multiturn,
            code_isolation=code_isolation,
        )
        for t in tasks
    ]
    suffix = "" if weights == "model" else f"_{weights}"
    stem = f"step_{run.step:08d}{suffix}"
    out = {
        "run_dir": str(run.run_dir),
        "step": run.step,
        "weights": weights,
        "weights_from": str(run.weights_from),
        "seed": seed,
        "limit": limit,
        "chat": chat,
        "fewshot_as_multiturn": multiturn,
        "tasks": {r.name: r.to_json() for r in results},
        "contamination": contamination,
        "code_execution": code_execution,
    }
    run_dir = run.run_dir
    del run, scorer  # the next checkpoint's model is loaded next
    results_json = run_dir / f"eval_harness_{stem}.json"
    atomic_write_json(results_json, out)
    say(f"results: {results_json}")
    lines = []
    for r in results:
        lines.extend(json.dumps({"task": r.name, **s}, default=float) for s in r.samples)
    samples_jsonl = run_dir / f"eval_harness_{stem}.samples.jsonl"
    atomic_write_text(samples_jsonl, "\n".join(lines) + "\n")
    say(f"samples: {samples_jsonl}")
    report = write_report(run_dir, stem, out, results)
    diagrams = sum(1 for r in results if r.calibration)
    say(f"report:  {report}" + (f" (reliability diagrams in {report.with_suffix('')}/)" if diagrams else ""))
    return out


def _rows(out: dict) -> dict[tuple[str, str], tuple[float, float | None]]:
    return {
        (task, k): (v, r["stderr"].get(k))
        for task, r in out["tasks"].items()
        for k, v in r["metrics"].items()
    }


def write_curves(run_dir: Path, outs: list[dict]) -> Path:
    """Task metrics against the training step: eval_curves.md (a table) and eval_curves.png."""
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    from lmforge.utils.io import atomic_write_bytes

    keys = list(_rows(outs[-1]))
    steps = [o["step"] for o in outs]
    md = [
        f"# lmforge eval: {run_dir.name}, task scores by checkpoint",
        "",
        "| task | metric | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for task, k in keys:
        values = [_rows(o).get((task, k), (math.nan, None))[0] for o in outs]
        md.append(f"| {task} | {k} | " + " | ".join(_fmt(k, v) for v in values) + " |")
    n = len(keys)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), dpi=100, squeeze=False)
    for ax, (task, k) in zip(axes.flat, keys):
        values = [_rows(o).get((task, k), (math.nan, None)) for o in outs]
        ys = [v for v, _ in values]
        errs = [e if e is not None else 0.0 for _, e in values]
        ax.errorbar(steps, ys, yerr=errs, marker="o", capsize=3)
        chance = outs[-1]["tasks"][task]["chance"].get(k)
        if chance is not None:
            ax.axhline(chance, color="gray", linestyle="--", label="chance")
            ax.legend(fontsize=7)
        ax.set_title(f"{task}: {k}", fontsize=9)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(run_dir / "eval_curves.png", buf.getvalue())
    md += ["", "![task scores by checkpoint](eval_curves.png)"]
    path = run_dir / "eval_curves.md"
    atomic_write_text(path, "\n".join(md) + "\n")
    return path


def comparison_rows(outs: list[dict]) -> list[list[str]]:
    """task, metric, each run's value, and (two runs) the difference with its z-score when both have a
    standard error (difference / sqrt(se_a^2 + se_b^2): |z| > 2 is unlikely to be noise)."""
    tables = [_rows(o) for o in outs]
    keys = [k for k in tables[0] if all(k in t for t in tables[1:])]
    rows = []
    for task, k in keys:
        row = [task, k] + [_fmt(k, t[(task, k)][0]) for t in tables]
        if len(tables) == 2:
            (a, sa), (b, sb) = tables[0][(task, k)], tables[1][(task, k)]
            z = (b - a) / math.sqrt(sa**2 + sb**2) if sa and sb else None
            row += [_fmt(k, b - a), "" if z is None else f"{z:+.2f}"]
        rows.append(row)
    return rows


def write_comparison(path: Path, names: list[str], outs: list[dict]) -> Path:
    header = ["task", "metric", *[f"{n} (step {o['step']})" for n, o in zip(names, outs)]]
    if len(outs) == 2:
        header += ["B - A", "z"]
    md = [
        "# lmforge eval: runs side by side",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    md += ["| " + " | ".join(r) + " |" for r in comparison_rows(outs)]
    atomic_write_text(path, "\n".join(md) + "\n")
    return path


def write_report(run_dir: Path, stem: str, out: dict, results: list[TaskResult]) -> Path:
    """The markdown report of one evaluation, with a reliability diagram per multiple-choice task."""
    figures = run_dir / f"eval_report_{stem}"
    md = [
        f"# lmforge eval: {run_dir.name}, step {out['step']} ({out['weights']} weights)",
        "",
        f"Weights: `{out['weights_from']}`. Few-shot seed {out['seed']}"
        + _limit_words(out["limit"])
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
    md += _contamination_md(out.get("contamination"))
    path = run_dir / f"eval_report_{stem}.md"
    atomic_write_text(path, "\n".join(md) + "\n")
    return path


def _limit_words(limit: float | None) -> str:
    """--limit as the user gave it: a count (which arrives as a float: 100.0 reads "100") or a fraction."""
    if not limit:
        return ""
    if limit < 1:
        return f", the first {100 * limit:g}% of each task's documents"
    return f", first {int(limit):,} documents per task"


def _contamination_md(c: dict | None) -> list[str]:
    if not c:
        return []
    md = ["", f"## Contamination (word {c.get('ngram', 13)}-gram overlap with the training data)", ""]
    if "skipped" in c:
        return md + [f"Not measured: {c['skipped']}."]
    t = c["training"]
    md += [
        f"Training data read: {t['documents']:,} documents, {t['chars']:,} characters"
        + (" (stopped at the reading budget)" if t.get("budget_hit") else "")
        + ".",
        "",
        "| task | documents checked | contaminated | fraction | mean n-gram overlap | too short |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in c["tasks"].items():
        frac = "" if r["contaminated_fraction"] is None else f"{100 * r['contaminated_fraction']:.1f}%"
        mean = "" if r["mean_overlap"] is None else f"{100 * r['mean_overlap']:.2f}%"
        md.append(f"| {name} | {r['checked']} | {r['contaminated']} | {frac} | {mean} | {r['too_short']} |")
    return md


def _fmt(metric: str, value: float) -> str:
    if metric.split(",")[0] in ("acc", "acc_norm", "acc_bytes", "exact_match", "f1") or metric.startswith(
        "pass@"
    ):
        return f"{100 * value:.2f}%"
    return f"{value:.4f}"
