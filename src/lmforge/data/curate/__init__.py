"""Corpus curation (`lmforge data`): normalise, filter, redact, deduplicate, with a readable report.

`curate(cfg)` runs the `curate` section of a config (see `runner.py` for the stages, the work layout
and resumption) and returns the report summary. The cleaned shards are JSONL (or Parquet) records with
`id` and `text`, directly usable as `data.sources` of `lmforge prepare`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["curate"]


def curate(cfg: Any, overwrite: bool = False, console: Callable[[str], object] = print,
           build_step: Callable[[Any], Any] | None = None) -> dict:
    """Run the curation pipeline of `cfg.curate` (a full Config, or a CurateConfig).

    overwrite: replace an output dir that holds a run with different settings (same settings resume).
    build_step: how a map-step config entry becomes a MapStep (default: the `MAP_STEPS` table); must be
    a module-level function so worker processes can import it.
    Returns a summary: docs in/out, removed by step, output shards, report paths.
    """
    from lmforge.config.curate import CurateConfig
    from lmforge.data.curate import report as rep
    from lmforge.data.curate import runner as rn
    from lmforge.data.curate.step import build_map_step

    c: CurateConfig = cfg if isinstance(cfg, CurateConfig) else cfg.curate
    build = build_step or build_map_step
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    entries, exact, minhash = rn.split_steps(c.steps)
    names = rn.step_names(entries)
    settings = {}  # what a step uses beyond its config (the harmful step's lists and their sizes)
    for name, e in zip(names, entries):  # fail on a bad step (missing block-list file, say) before reading
        described = getattr(build(e), "describe", dict)()
        if described:
            settings[name] = described
            console(f"{name}: {described['summary']}")
    root = Path(c.output_dir)
    layout = rn.Layout(root)
    resuming = rn.claim_output_dir(root, rn.settings_of(c), overwrite)
    units, ignored = rn.plan(c, layout)
    todo = rn.clean_stale(layout, len(units))
    timings["plan_s"] = time.perf_counter() - t0
    if resuming and len(todo) < len(units):
        console(f"resuming {root}: {len(units) - len(todo)} of {len(units)} units already done")
    console(f"curate: {len(units)} units of up to {c.docs_per_shard:,} documents, {len(todo)} to run "
            f"({c.engine}, {c.workers} workers)")

    t = time.perf_counter()
    cfg_dict = c.model_dump(mode="json")
    jobs = [rn.UnitJob(i, units[i], cfg_dict, str(layout.work), build) for i in todo]
    rn.run_units(jobs, c, console)
    timings["map_s"] = time.perf_counter() - t
    markers = rn.load_markers(layout, len(units))

    t = time.perf_counter()
    dd = rn.global_dedup(layout, markers, exact, minhash, console)
    timings["dedup_s"] = time.perf_counter() - t
    t = time.perf_counter()
    out = rn.write_outputs(layout, c, len(units), exact, minhash)
    timings["write_s"] = time.perf_counter() - t

    t = time.perf_counter()
    map_stats, bad = rn.merge_map_stats(markers, names, c.examples_per_reason)
    bad.ignored_files += ignored
    sample = rn.load_sample(layout, len(units))
    curve = rep.strictness_curve(entries, sample, c.strictness_sweep, build)
    timings["report_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0
    report = rep.build_report(
        inputs=c.inputs, output_dir=str(root), docs_read=sum(m["docs_read"] for m in markers),
        chars_read=sum(m["chars_read"] for m in markers), bytes_read=sum(m["bytes_read"] for m in markers),
        steps=[s.to_dict() for s in map_stats] + out["dedup_stats"], bad_input=bad.to_dict(), dedup=dd,
        shards=out["shards"], units=len(units), resumed_units=len(units) - len(todo),
        timings={k: round(v, 3) for k, v in timings.items()}, strictness=curve, settings=settings)
    rep.write_report(root, report)
    return {
        "output_dir": str(root), "docs_in": report["docs_in"], "docs_out": report["docs_out"],
        "removed": {s["name"]: s["removed"] for s in report["steps"]},
        "bad_input": bad.total, "shards": [str(root / s["path"]) for s in out["shards"]],
        "removed_file": str(root / "removed.jsonl"),
        "report": str(root / "report.md"), "report_json": str(root / "report.json"),
        "docs_per_s": report["throughput"]["docs_per_s"], "seconds": round(timings["total_s"], 3),
    }
