"""The curation report: report.json (every number), report.md (readable, with plots), and the
strictness trade-off curve (how much is kept, and how good it is, as the filter thresholds move).

Token counts are estimates (characters / 4, about right for English BPE); they are labelled as such.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmforge.data.curate.doc import Doc
from lmforge.data.curate.step import MapStep
from lmforge.data.curate.text import GOPHER_STOP_WORDS, count_alpha_words, ngrams, split_words
from lmforge.utils.io import atomic_write_json, atomic_write_text

CHARS_PER_TOKEN = 4.0


def tokens_estimate(chars: int) -> int:
    return int(round(chars / CHARS_PER_TOKEN))


# ---- strictness trade-off ------------------------------------------------------------------------


def scaled(entry: Any, m: float) -> Any:
    """A copy of a step's config with its thresholds made `m` times stricter: fields named min_* are
    multiplied by m, max_* divided by m (dict values too, e.g. n -> max fraction); ratios and
    fractions (fields bounded by 1, or named *_ratio / *_frac*) are clamped to [0, 1], integers are
    rounded. m > 1 is stricter, m < 1 looser; other fields are unchanged."""
    if m <= 0:
        raise ValueError(f"strictness multiplier must be > 0, got {m}")
    update: dict[str, Any] = {}
    for name, info in type(entry).model_fields.items():
        value = getattr(entry, name)
        if value is None or isinstance(value, bool) or not name.startswith(("min_", "max_")):
            continue
        factor = m if name.startswith("min_") else 1.0 / m
        ratio = "ratio" in name or "frac" in name or any(getattr(c, "le", None) == 1 for c in info.metadata)

        def scale(v: Any, factor: float = factor, ratio: bool = ratio) -> Any:
            out = v * factor
            if ratio:
                out = min(max(out, 0.0), 1.0)
            return int(round(out)) if isinstance(v, int) else out

        if isinstance(value, dict):
            update[name] = {k: scale(v) for k, v in value.items()}
        elif isinstance(value, (int, float)):
            update[name] = scale(value)
    return entry.model_copy(update=update)


def quality_proxies(texts: list[str]) -> dict[str, float]:
    """Proxies of how good a set of documents is: mean stop-word ratio (share of words that are
    Gopher stop words: natural prose), mean alpha-word ratio, and the distinct word 3-gram ratio over
    the whole set (1.0 = no repeated phrasing)."""
    stop, alpha = [], []
    grams: Counter = Counter()
    for text in texts:
        words = split_words(text.lower())
        n = max(len(words), 1)
        stop.append(sum(w in GOPHER_STOP_WORDS for w in words) / n)
        alpha.append(count_alpha_words(words) / n)
        grams.update(ngrams(words, 3))
    total = sum(grams.values())
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    return {"mean_stop_word_ratio": round(mean(stop), 6), "mean_alpha_ratio": round(mean(alpha), 6),
            "distinct_3gram_ratio": round(len(grams) / total, 6) if total else 0.0}


def strictness_curve(entries: list[Any], sample: list[Doc], multipliers: list[float],
                     build_step: Callable[[Any], MapStep]) -> list[dict]:
    """For each multiplier: the fraction of `sample` the map steps keep with scaled thresholds, and the
    quality proxies of what is kept (one point of the trade-off curve each)."""
    # leading steps without thresholds (normalize, say) are the same at every m: apply them once
    fixed = 0
    while fixed < len(entries) and all(scaled(entries[fixed], m) == entries[fixed] for m in multipliers):
        fixed += 1
    prefix = [build_step(e) for e in entries[:fixed]]
    start: list[Doc] = []
    for doc in sample:
        out: Doc | None = Doc(doc.id, doc.text)
        for step in prefix:
            out, _ = step.apply(out)
            if out is None:
                break
        if out is not None:
            start.append(out)
    points = []
    for m in multipliers:
        steps = [build_step(scaled(e, m)) for e in entries[fixed:]]
        kept: list[str] = []
        for doc in start:
            out = Doc(doc.id, doc.text)
            for step in steps:
                out, _ = step.apply(out)
                if out is None:
                    break
            if out is not None:
                kept.append(out.text)
        for step in steps:
            step.take_counts()
        points.append({"multiplier": m, "sample_docs": len(sample), "kept": len(kept),
                       "kept_fraction": round(len(kept) / len(sample), 6) if sample else 0.0,
                       **quality_proxies(kept)})
    return points


# ---- report.json --------------------------------------------------------------------------------


def step_entry(d: dict) -> dict:
    """A StepStats dict as a report row, with removed and token estimates."""
    return {
        "name": d["name"], "docs_in": d["docs_in"], "docs_out": d["docs_out"],
        "removed": d["docs_in"] - d["docs_out"], "changed": d["changed"],
        "chars_in": d["chars_in"], "chars_out": d["chars_out"],
        "tokens_in_est": tokens_estimate(d["chars_in"]), "tokens_out_est": tokens_estimate(d["chars_out"]),
        "reasons": {r: {"count": n, "examples": d["examples"].get(r, [])}
                    for r, n in sorted(d["reasons"].items(), key=lambda kv: (-kv[1], kv[0]))},
        "counts": d["counts"],
    }


def build_report(*, inputs: list[str], output_dir: str, docs_read: int, chars_read: int, bytes_read: int,
                 steps: list[dict], bad_input: dict, dedup: dict, shards: list[dict], units: int,
                 resumed_units: int, timings: dict, strictness: list[dict],
                 settings: dict[str, dict] | None = None) -> dict:
    """Assemble report.json from the merged stats (all steps in order: map steps, then dedup);
    `settings`: what a step used beyond its config (MapStep.describe), by step name."""
    rows = [step_entry(s) for s in steps]
    for r in rows:
        if (settings or {}).get(r["name"]):
            r["settings"] = settings[r["name"]]
    docs_out = sum(s["docs"] for s in shards)
    chars_out = rows[-1]["chars_out"] if rows else chars_read
    reasons: Counter = Counter()
    for r in rows:
        for reason, v in r["reasons"].items():
            reasons[reason] += v["count"]
    pii: Counter = Counter()
    for r in rows:
        if r["name"].split("#")[0] == "pii":
            pii.update(r["counts"])
    pipeline_s = max(sum(timings.get(k, 0.0) for k in ("plan_s", "map_s", "dedup_s", "write_s")), 1e-9)
    return {
        "inputs": inputs, "output_dir": output_dir, "units": units, "resumed_units": resumed_units,
        "docs_in": docs_read, "docs_out": docs_out, "removed": docs_read - docs_out,
        "chars_in": chars_read, "chars_out": chars_out,
        "tokens_in_est": tokens_estimate(chars_read), "tokens_out_est": tokens_estimate(chars_out),
        "bytes_in": bytes_read,
        "steps": rows,
        "removal_reasons": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "pii": dict(sorted(pii.items())),
        "dedup": dedup,
        "bad_input": bad_input,
        "shards": shards,
        "timings": timings,
        "throughput": {"docs_per_s": round(docs_read / pipeline_s, 2),
                       "mb_per_s": round(bytes_read / 1e6 / pipeline_s, 3),
                       "note": "over this invocation's plan+map+dedup+write wall time (report excluded)"
                       + ("; resumed units were not re-read" if resumed_units else "")},
        "strictness": strictness,
    }


# ---- plots and report.md --------------------------------------------------------------------------


def write_report(root: Path, report: dict) -> dict[str, str]:
    """Write report.json, the PNG plots under plots/, and report.md; returns {plot name: path}."""
    plots = _plots(root / "plots", report)
    report = dict(report, plots={k: str(Path(v).relative_to(root)) for k, v in plots.items()})
    atomic_write_json(root / "report.json", report)
    atomic_write_text(root / "report.md", _markdown(report))
    return plots


def _plots(out: Path, r: dict) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        paths[name] = out / f"{name}.png"
        tmp = out / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        tmp.replace(paths[name])

    labels = ["input"] + [s["name"] for s in r["steps"]]
    values = [r["docs_in"]] + [s["docs_out"] for s in r["steps"]]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.2))
    ax.barh(range(len(labels)), values, color="tab:blue")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,}", va="center", fontsize=8)
    ax.set_xlabel("documents remaining after step")
    ax.set_title("Curation funnel")
    save(fig, "funnel")

    reasons = list(r["removal_reasons"].items())[:20]
    fig, ax = plt.subplots(figsize=(7, 0.4 * max(len(reasons), 1) + 1.2))
    if reasons:
        ax.barh(range(len(reasons)), [n for _, n in reasons], color="tab:red")
        ax.set_yticks(range(len(reasons)), [k for k, _ in reasons], fontsize=8)
        ax.invert_yaxis()
    else:
        ax.text(0.5, 0.5, "nothing removed", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("documents removed")
    ax.set_title("Removal reasons")
    save(fig, "reasons")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    for shift, (key, label) in zip((-width / 2, width / 2), (("exact_group_sizes", "exact"),
                                                           ("minhash_cluster_sizes", "near (MinHash)"))):
        hist = {int(k): v for k, v in r["dedup"].get(key, {}).items()}
        if hist:
            ax.bar([k + shift for k in hist], list(hist.values()), width=width, label=label)
    ax.set_xlabel("cluster size (documents)")
    ax.set_ylabel("clusters")
    ax.set_title("Duplicate cluster sizes")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no duplicates", ha="center", va="center", transform=ax.transAxes)
    save(fig, "clusters")

    pts = r["strictness"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, key, label in ((axes[0], "mean_stop_word_ratio", "mean stop-word ratio of kept docs"),
                           (axes[1], "distinct_3gram_ratio", "distinct word 3-gram ratio of kept docs")):
        xs = [p["kept_fraction"] for p in pts]
        ys = [p[key] for p in pts]
        ax.plot(xs, ys, "o-")
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"x{p['multiplier']:g}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        ax.set_xlabel("fraction of sample kept")
        ax.set_ylabel(label)
    n = pts[0]["sample_docs"] if pts else 0
    fig.suptitle(f"Strictness trade-off ({n:,} sampled docs; x>1 = stricter thresholds)")
    save(fig, "strictness")
    return paths


def _markdown(r: dict) -> str:
    pct = lambda a, b: f"{100 * a / b:.1f}%" if b else "-"
    lines = [
        "# Curation report", "",
        f"Inputs: {', '.join(f'`{i}`' for i in r['inputs'])}  ",
        f"Output: `{r['output_dir']}` ({len(r['shards'])} shards)", "",
        "| | documents | characters | tokens (est.) |", "|---|---:|---:|---:|",
        f"| in | {r['docs_in']:,} | {r['chars_in']:,} | {r['tokens_in_est']:,} |",
        f"| out | {r['docs_out']:,} ({pct(r['docs_out'], r['docs_in'])}) | {r['chars_out']:,} | "
        f"{r['tokens_out_est']:,} |", "",
        f"Throughput: {r['throughput']['docs_per_s']:,} docs/s, {r['throughput']['mb_per_s']} MB/s "
        f"({r['throughput']['note']}); {r['units']} units, {r['resumed_units']} resumed.", "",
        "## Steps", "",
        "| step | docs in | docs out | removed | changed | chars in | chars out |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in r["steps"]:
        lines.append(f"| {s['name']} | {s['docs_in']:,} | {s['docs_out']:,} | {s['removed']:,} "
                     f"({pct(s['removed'], s['docs_in'])}) | {s['changed']:,} | {s['chars_in']:,} | "
                     f"{s['chars_out']:,} |")
    for s in r["steps"]:
        if s.get("settings"):
            lines += ["", f"{s['name']}: {s['settings']['summary']}"]
    lines += ["", "![funnel](plots/funnel.png)", "", "## Removal reasons", ""]
    for s in r["steps"]:
        for reason, v in s["reasons"].items():
            lines.append(f"- **{reason}** ({s['name']}): {v['count']:,}")
            for ex in v["examples"]:
                snippet = " ".join(ex.split())[:160].replace("`", "'")
                lines.append(f"  - `{snippet}`")
    if not r["removal_reasons"]:
        lines.append("Nothing was removed.")
    lines += ["", "![reasons](plots/reasons.png)", "", "## Duplicates", ""]
    d = r["dedup"]
    lines.append(f"Exact duplicates removed: {d.get('exact_removed', 0):,}; near duplicates (MinHash) "
                 f"removed: {d.get('minhash_removed', 0):,}.")
    for key, label in (("exact_group_sizes", "exact"), ("minhash_cluster_sizes", "near")):
        if d.get(key):
            sizes = ", ".join(f"{k} docs x {v}" for k, v in d[key].items())
            lines.append(f"- {label} cluster sizes: {sizes}")
    lines += ["", "![clusters](plots/clusters.png)", "", "## PII", ""]
    lines.append(", ".join(f"{k}: {v:,}" for k, v in r["pii"].items()) if r["pii"] else "No PII found "
                 "(or no pii step).")
    bad = r["bad_input"]
    lines += ["", "## Bad input", "", f"{bad['total']:,} items skipped; {bad['ignored_files']:,} files "
              "with other extensions ignored.", ""]
    for kind, n in bad["counts"].items():
        lines.append(f"- {kind}: {n:,} (e.g. {', '.join(bad['examples'].get(kind, []))})")
    lines += ["", "## Strictness trade-off", "",
              "Thresholds of the filters scaled (min_* x m, max_* / m) over a fixed sample:", "",
              "| m | kept | stop-word ratio | alpha ratio | distinct 3-grams |", "|---:|---:|---:|---:|---:|"]
    for p in r["strictness"]:
        lines.append(f"| {p['multiplier']:g} | {100 * p['kept_fraction']:.1f}% | "
                     f"{p['mean_stop_word_ratio']:.3f} | {p['mean_alpha_ratio']:.3f} | "
                     f"{p['distinct_3gram_ratio']:.3f} |")
    t = r["timings"]
    lines += ["", "![strictness](plots/strictness.png)", "", "## Timings", "",
              ", ".join(f"{k}: {v:.2f}s" for k, v in t.items()), ""]
    return "\n".join(lines)
