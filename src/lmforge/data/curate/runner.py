"""`lmforge data`: the curation pipeline run in three stages over deterministic work units.

  plan    inputs -> numbered units of `docs_per_shard` record slots (readers.plan_units); the plan and a
          fingerprint of every setting that decides the output are written first.
  map     each unit, in a worker process (or a Ray task), streams its documents through the map steps,
          writing kept documents, removals, exact-dedup keys, MinHash signatures and a sample into
          work/units/NNNNN/, then atomically writes work/completions/NNNNN.json (its stats). A re-run
          skips every unit with a completion marker, so a run killed at any moment resumes without
          processing a unit twice or losing one.
  dedup   one process streams the per-unit files: exact duplicates (first in unit/record order wins),
          then MinHash LSH clusters among the rest (the smallest unit/record key survives).
  write   survivors go to data/part-NNNNN.{jsonl,parquet} (docs_per_shard each), every removal to
          removed.jsonl (unit order), then report.json / report.md (report.py).

Ordering rule: all map steps run first, then exact_dedup, then minhash_dedup; a map step listed after a
dedup step is a config error (dedup needs the whole corpus, so it cannot run in the middle of a unit).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.config.curate import CurateConfig
from lmforge.data.curate import dedup
from lmforge.data.curate.doc import Doc, StepStats
from lmforge.data.curate.readers import HF_PREFIX, BadInput, Piece, Reader, plan_pieces, plan_units
from lmforge.data.curate.step import GLOBAL_STEPS, MapStep, build_map_step
from lmforge.data.curate.writers import AtomicFile, doc_record, dumps, shard_writer
from lmforge.data.sources import BUILTIN_PYTHON, builtin_python_identity, walk_files
from lmforge.errors import ConfigError, DataError
from lmforge.utils.io import atomic_write_json, fsync_dir

FORMAT = 1  # bump when the layout of work/ or the outputs changes
SAMPLE_SIZE = 2000  # documents kept for the strictness sweep (bottom-k by seeded hash of the id)
SAMPLE_CHARS = 2_000_000  # ... cut (in hash order) to this many characters: the sweep runs 5x the steps
SAMPLE_SEED = b"lmforge-curate-sample"
StepBuilder = Callable[[Any], MapStep]


@dataclass
class UnitJob:
    """Everything a worker needs for one unit (picklable; `build_step` must be a module-level function)."""

    index: int
    pieces: list[dict]
    cfg: dict
    work: str
    build_step: StepBuilder = build_map_step
    sample_size: int = SAMPLE_SIZE


@dataclass
class Layout:
    """Paths inside the output dir."""

    root: Path
    work: Path = field(init=False)

    def __post_init__(self) -> None:
        self.work = self.root / "work"

    def unit(self, i: int) -> Path:
        return self.work / "units" / f"{i:05d}"

    def marker(self, i: int) -> Path:
        return self.work / "completions" / f"{i:05d}.json"

    @property
    def dedup(self) -> Path:
        return self.work / "dedup"


def split_steps(steps: list) -> tuple[list, Any, Any]:
    """(map step entries in order, the exact_dedup entry or None, the minhash_dedup entry or None)."""
    map_entries, exact, minhash = [], None, None
    seen_global = None
    for i, entry in enumerate(steps):
        if entry.step in GLOBAL_STEPS:
            if (exact if entry.step == "exact_dedup" else minhash) is not None:
                raise ConfigError(f"curate.steps[{i}]: {entry.step} is listed twice; keep one entry")
            if entry.step == "exact_dedup":
                exact = entry
            else:
                minhash = entry
            seen_global = seen_global or (i, entry.step)
        elif seen_global is not None:
            raise ConfigError(
                f"curate.steps[{i}]: map step {entry.step!r} comes after {seen_global[1]!r} "
                f"(steps[{seen_global[0]}]); deduplication runs after all map steps, so list "
                "exact_dedup / minhash_dedup last")
        else:
            map_entries.append(entry)
    return map_entries, exact, minhash


def step_names(entries: list) -> list[str]:
    """Report names of map steps: the config `step`, with '#2', '#3' for repeats."""
    seen: Counter = Counter()
    names = []
    for e in entries:
        seen[e.step] += 1
        names.append(e.step if seen[e.step] == 1 else f"{e.step}#{seen[e.step]}")
    return names


def sample_hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8", "surrogatepass"), digest_size=8,
                                          key=SAMPLE_SEED).digest(), "big")


# ---- stage 1: one unit --------------------------------------------------------------------------


def run_unit(job: UnitJob) -> dict:
    """Process one unit in this process; returns (and atomically records) its completion stats."""
    t0 = time.perf_counter()
    cfg = CurateConfig.model_validate(job.cfg)
    layout = Layout(Path(job.work).parent)
    entries, exact, minhash = split_steps(cfg.steps)
    steps = [job.build_step(e) for e in entries]
    names = step_names(entries)
    stats = [StepStats(n, max_examples=cfg.examples_per_reason) for n in names]
    bad = BadInput(max_examples=cfg.examples_per_reason)
    reader = Reader(cfg.text_key, cfg.id_key, cfg.on_bad_input, cfg.max_line_chars, bad)
    hasher = dedup.MinHasher(minhash.num_perm, minhash.ngram, minhash.seed) if minhash else None

    final = layout.unit(job.index)
    tmp = final.parent / f".{final.name}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    docs_f = open(tmp / "docs.jsonl", "w", encoding="utf-8")
    ids_f = open(tmp / "ids.jsonl", "w", encoding="utf-8")
    removed_f = open(tmp / "removed.jsonl", "w", encoding="utf-8")
    keys_f = open(tmp / "exact.bin", "wb")
    sigs: list[np.ndarray] = []
    sample: list[tuple[int, str, str]] = []  # max-heap by -hash of the smallest `sample_size` hashes
    docs_read = chars_read = bytes_read = kept = 0
    for doc in reader.read_unit([Piece.from_dict(p) for p in job.pieces]):
        docs_read += 1
        chars_read += len(doc.text)
        bytes_read += len(doc.text.encode("utf-8", "surrogatepass"))
        if job.sample_size:
            item = (-sample_hash(doc.id), doc.id, doc.text)
            if len(sample) < job.sample_size:
                heapq.heappush(sample, item)
            elif item > sample[0]:
                heapq.heapreplace(sample, item)
        out: Doc | None = doc
        for step, st, name in zip(steps, stats, names):
            before = out
            try:
                out, reason = step.apply(before)
            except Exception as e:
                raise RuntimeError(f"curate step {name!r} failed on document {doc.id!r}: {e}") from e
            st.record(before, out, reason)
            if out is None:
                removed_f.write(dumps({"id": doc.id, "step": name, "reason": reason or "dropped"}) + "\n")
                break
        if out is None:
            continue
        kept += 1
        docs_f.write(dumps(doc_record(out)) + "\n")
        ids_f.write(dumps(out.id) + "\n")
        if exact is not None:
            keys_f.write(dedup.exact_key(out.text, exact.normalize))
        if hasher is not None:
            sigs.append(hasher.signature(out.text))
    for step, st in zip(steps, stats):
        st.counts.update(step.take_counts())
    for f in (docs_f, ids_f, removed_f, keys_f):
        f.flush()
        os.fsync(f.fileno())
        f.close()
    if hasher is not None:
        arr = np.stack(sigs) if sigs else np.zeros((0, minhash.num_perm), dtype=np.uint32)
        dedup.write_signature_file(tmp / "minhash.npy", [(job.index, p) for p in range(len(sigs))], arr)
    with open(tmp / "sample.jsonl", "w", encoding="utf-8") as f:
        for h, doc_id, text in sorted(sample, reverse=True):
            f.write(dumps({"h": -h, "id": doc_id, "text": text}) + "\n")
    shutil.rmtree(final, ignore_errors=True)  # a previous attempt that died before its marker
    os.replace(tmp, final)
    fsync_dir(final.parent)
    result = {"unit": job.index, "docs_read": docs_read, "chars_read": chars_read, "bytes_read": bytes_read,
              "kept": kept, "steps": [s.to_dict() for s in stats], "bad_input": bad.to_dict(),
              "seconds": round(time.perf_counter() - t0, 4)}
    atomic_write_json(layout.marker(job.index), result)
    return result


# ---- stage 1: scheduling ------------------------------------------------------------------------


def run_units(jobs: list[UnitJob], cfg: CurateConfig, console: Callable[[str], object]) -> None:
    """Run `jobs` locally (a spawn pool of cfg.workers processes) or as Ray tasks."""
    if not jobs:
        return
    n, done = len(jobs), 0

    def progress(res: dict) -> None:
        nonlocal done
        done += 1
        console(f"  unit {res['unit']:05d} done ({done}/{n}): {res['docs_read']:,} docs read, "
                f"{res['kept']:,} kept")

    if cfg.engine == "ray":
        _run_ray(jobs, cfg, progress)
    elif cfg.workers == 1 or n == 1:
        for job in jobs:
            progress(run_unit(job))
    else:
        import multiprocessing as mp

        # forkserver: workers start clean (no forked locks or threads of this process) and import
        # lmforge once, in the server, instead of once each as with spawn (the fallback elsewhere)
        if "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["lmforge.data.curate.runner"])
        else:
            ctx = mp.get_context("spawn")
        with ctx.Pool(min(cfg.workers, n)) as pool:
            for res in pool.imap_unordered(run_unit, jobs):
                progress(res)


def _run_ray(jobs: list[UnitJob], cfg: CurateConfig, progress: Callable[[dict], None]) -> None:
    try:
        import ray
    except ImportError:
        raise ConfigError("curate.engine=ray needs ray; pip install 'ray' (or the lmforge 'ray' extra), "
                          "or set curate.engine=local") from None
    started = not ray.is_initialized()
    if started:
        address = os.environ.get("RAY_ADDRESS")
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            ray.init(address=address, **kw)
        else:
            ray.init(num_cpus=cfg.workers, **kw)
    try:
        task = ray.remote(num_cpus=1, max_retries=2)(run_unit)
        pending = [task.remote(job) for job in jobs]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            progress(ray.get(ready[0]))
    finally:
        if started:
            ray.shutdown()


# ---- stage 2: global dedup ----------------------------------------------------------------------


def global_dedup(layout: Layout, markers: list[dict], exact: Any, minhash: Any,
                 console: Callable[[str], object]) -> dict:
    """Decide dedup removals over all units; writes work/dedup/NNNNN.jsonl ({pos, step, reason}) and
    work/dedup/summary.json. Reused when present (it is renamed into place only when complete)."""
    if (layout.dedup / "summary.json").is_file():
        return json.loads((layout.dedup / "summary.json").read_text())
    kept = [m["kept"] for m in markers]
    offsets = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    total = int(offsets[-1])
    removed: dict[int, tuple[str, int]] = {}  # global index -> (step, survivor global index)
    exact_groups: Counter = Counter()
    if exact is not None and total:
        seen: dict[bytes, int] = {}
        for u in range(len(markers)):
            data = (layout.unit(u) / "exact.bin").read_bytes()
            if not kept[u]:
                continue
            width = len(data) // kept[u]
            assert width * kept[u] == len(data), f"unit {u}: exact.bin does not match its doc count"
            base = int(offsets[u])
            for p in range(kept[u]):
                key = data[p * width:(p + 1) * width]
                first = seen.setdefault(key, base + p)
                if first != base + p:
                    removed[base + p] = ("exact_dedup", first)
                    exact_groups[first] += 1
    clusters_hist: Counter = Counter()
    if minhash is not None and total:
        paths = [layout.unit(u) / "minhash.npy" for u in range(len(markers))]
        for members in _minhash_clusters(paths, offsets, set(removed), minhash):
            keep = min(members)
            clusters_hist[len(members)] += 1
            for g in members:
                if g != keep:
                    removed[g] = ("minhash_dedup", keep)
    ids = _resolve_ids(layout, offsets, {s for _, s in removed.values()})
    tmp = layout.work / f".dedup.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    by_unit: dict[int, list[int]] = {}
    for g in sorted(removed):
        by_unit.setdefault(int(np.searchsorted(offsets, g, side="right") - 1), []).append(g)
    for u, gs in by_unit.items():
        with open(tmp / f"{u:05d}.jsonl", "w", encoding="utf-8") as f:
            for g in gs:
                step, s = removed[g]
                what = "duplicate_of" if step == "exact_dedup" else "cluster"
                f.write(dumps({"pos": g - int(offsets[u]), "step": step,
                               "reason": f"{step}:{what}:{ids[s]}"}) + "\n")
    summary = {
        "docs_in": total,
        "exact_removed": sum(1 for s, _ in removed.values() if s == "exact_dedup"),
        "minhash_removed": sum(1 for s, _ in removed.values() if s == "minhash_dedup"),
        "exact_group_sizes": {str(k): v for k, v in sorted(Counter(n + 1 for n in exact_groups.values())
                                                            .items())},
        "minhash_cluster_sizes": {str(k): v for k, v in sorted(clusters_hist.items())},
    }
    atomic_write_json(tmp / "summary.json", summary)
    shutil.rmtree(layout.dedup, ignore_errors=True)
    os.replace(tmp, layout.dedup)
    fsync_dir(layout.work)
    console(f"dedup: {summary['exact_removed']:,} exact and {summary['minhash_removed']:,} near "
            f"duplicates of {total:,} documents")
    return summary


def _minhash_clusters(paths: list[Path], offsets: np.ndarray, excluded: set[int],
                      mcfg: Any) -> list[list[int]]:
    """Clusters (global indices, sorted, size >= 2) of near-duplicates among documents not `excluded`.

    Candidate pairs are verified by the signatures' estimated Jaccard, with a margin of two standard
    errors of that estimate (sqrt(J(1-J)/num_perm), 0.075 at J=0.8 with 112 hashes): verifying at the
    threshold itself would reject about half of the true pairs that sit right at it."""
    bands, rows = dedup.lsh_params(mcfg.threshold, mcfg.num_perm, mcfg.bands)
    t = mcfg.threshold
    verify_at = t - 2 * (t * (1 - t) / mcfg.num_perm) ** 0.5
    pairs = dedup.candidate_pairs_from_signature_files([str(p) for p in paths], bands, rows, verify_at)
    glob = ((int(offsets[a[0]]) + a[1], int(offsets[b[0]]) + b[1]) for a, b in pairs)
    return dedup.clusters((a, b) for a, b in glob if a not in excluded and b not in excluded)


def _resolve_ids(layout: Layout, offsets: np.ndarray, wanted: set[int]) -> dict[int, str]:
    out: dict[int, str] = {}
    for u in range(len(offsets) - 1):
        lo, hi = int(offsets[u]), int(offsets[u + 1])
        if not any(lo <= g < hi for g in wanted):
            continue
        with open(layout.unit(u) / "ids.jsonl", encoding="utf-8") as f:
            for p, line in enumerate(f):
                if lo + p in wanted:
                    out[lo + p] = json.loads(line)
    return out


# ---- stage 3: write ---------------------------------------------------------------------------


def write_outputs(layout: Layout, cfg: CurateConfig, n_units: int, exact: Any, minhash: Any) -> dict:
    """Shards of survivors and removed.jsonl; returns the dedup steps' stats and the shard list."""
    data = layout.root / "data"
    data.mkdir(parents=True, exist_ok=True)
    for stale in data.glob(".*.tmp"):
        stale.unlink(missing_ok=True)
    ext = cfg.output_format
    dd_stats = {name: StepStats(name, max_examples=cfg.examples_per_reason)
                for name, e in (("exact_dedup", exact), ("minhash_dedup", minhash)) if e is not None}
    removed_out = AtomicFile(layout.root / "removed.jsonl")
    shards: list[dict] = []
    writer = None
    try:
        for u in range(n_units):
            udir = layout.unit(u)
            with open(udir / "removed.jsonl", "rb") as f:
                shutil.copyfileobj(f, removed_out.f)
            drops: dict[int, dict] = {}
            dfile = layout.dedup / f"{u:05d}.jsonl"
            if dfile.is_file():
                with open(dfile, encoding="utf-8") as f:
                    drops = {r["pos"]: r for r in map(json.loads, f)}
            with open(udir / "docs.jsonl", encoding="utf-8") as f:
                for pos, line in enumerate(f):
                    rec = json.loads(line)
                    doc = Doc(rec["id"], rec["text"])
                    drop = drops.get(pos)
                    for name in dd_stats:
                        if drop is not None and drop["step"] == name:
                            dd_stats[name].record(doc, None, f"{name}:"
                                                  f"{'duplicate' if name == 'exact_dedup' else 'cluster'}")
                            break
                        dd_stats[name].record(doc, doc)
                    if drop is not None:
                        removed_out.write((dumps({"id": rec["id"], "step": drop["step"],
                                                  "reason": drop["reason"]}) + "\n").encode("utf-8"))
                        continue
                    if writer is None:
                        path = data / f"part-{len(shards):05d}.{ext}"
                        writer = shard_writer(path, ext)
                        shards.append({"path": str(path.relative_to(layout.root)), "docs": 0})
                    writer.write(rec)
                    shards[-1]["docs"] += 1
                    if writer.count >= cfg.docs_per_shard:
                        writer.close()
                        writer = None
        if writer is not None:
            writer.close()
            writer = None
        removed_out.commit()
    except BaseException:
        removed_out.abort()
        if writer is not None:
            writer.abort()
        raise
    for old in data.glob(f"part-*.{ext}"):  # parts left by an earlier run with more output
        if not any(old.name == Path(s["path"]).name for s in shards):
            old.unlink()
    return {"dedup_stats": [s.to_dict() for s in dd_stats.values()], "shards": shards}


# ---- fingerprint --------------------------------------------------------------------------------


def settings_of(cfg: CurateConfig) -> dict:
    """Every setting that decides the output (workers, engine and the sweep do not)."""
    return {
        "format": FORMAT,
        "inputs": [_input_identity(s) for s in cfg.inputs],
        "text_key": cfg.text_key, "id_key": cfg.id_key, "output_format": cfg.output_format,
        "docs_per_shard": cfg.docs_per_shard, "on_bad_input": cfg.on_bad_input,
        "max_line_chars": cfg.max_line_chars, "examples_per_reason": cfg.examples_per_reason,
        "steps": [e.model_dump(mode="json") for e in cfg.steps],
    }


def _input_identity(src: str) -> dict:
    """Resolved path + file count + total size + newest mtime: changes when an input's content does."""
    if src == BUILTIN_PYTHON:
        return builtin_python_identity()
    path = Path(src[len(HF_PREFIX):] if src.startswith(HF_PREFIX) else src)
    if not path.exists():
        raise DataError(f"curate input {src!r} does not exist (resolved: {path.resolve()})")
    files = list(walk_files(path)) if path.is_dir() else [path]
    st = [f.stat() for f in files]
    return {"source": src, "path": str(path.resolve()), "files": len(files),
            "bytes": sum(s.st_size for s in st), "mtime_ns": max((s.st_mtime_ns for s in st), default=0)}


OUTPUTS = ("work", "data", "removed.jsonl", "report.json", "report.md", "plots", "fingerprint.json")


def _refuse_deleting_inputs(root: Path, settings: dict) -> None:
    """--overwrite deletes the earlier run's outputs: never one that is, or holds, an input."""
    for src in settings.get("inputs", []):
        if "path" not in src:
            continue
        inp = Path(src["path"])
        for name in OUTPUTS:
            out = (root / name).resolve()
            if inp == out or out in inp.parents:
                raise DataError(f"--overwrite would delete {root / name}, which holds the input "
                                f"{src['source']!r}; copy the input elsewhere or choose another "
                                "curate.output_dir")


def claim_output_dir(root: Path, settings: dict, overwrite: bool) -> bool:
    """Record the fingerprint in `root`; True when resuming an earlier run of the same settings."""
    fp = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    meta_path = root / "fingerprint.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fp and not overwrite:
            return True
        if not overwrite:
            old = meta.get("settings", {})
            differ = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise DataError(f"output dir {root} holds a curate run with different settings "
                            f"({', '.join(differ) or 'format'} differ); choose another curate.output_dir "
                            "or pass --overwrite to replace it")
        _refuse_deleting_inputs(root, settings)
        for name in OUTPUTS:
            p = root / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    elif root.is_dir() and any(root.iterdir()):
        raise DataError(f"output dir {root} is not empty and holds no curate run (no fingerprint.json); "
                        "choose an empty or new curate.output_dir")
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(meta_path, {"fingerprint": fp, "settings": settings, "argv": sys.argv})
    return False


def plan(cfg: CurateConfig, layout: Layout) -> tuple[list[list[dict]], int]:
    """The units (as dicts) and the ignored-file count; stored in work/plan.json and reused from it."""
    path = layout.work / "plan.json"
    if path.is_file():
        p = json.loads(path.read_text())
        return p["units"], p["ignored_files"]
    pieces, ignored = plan_pieces(cfg.inputs, cfg.text_key)
    units = [[p.to_dict() for p in u] for u in plan_units(pieces, cfg.docs_per_shard)]
    atomic_write_json(path, {"units": units, "ignored_files": ignored})
    return units, ignored


def clean_stale(layout: Layout, n_units: int) -> list[int]:
    """Remove temp dirs and units without a completion marker; the indices still to run."""
    units_dir = layout.work / "units"
    if units_dir.is_dir():
        for p in units_dir.iterdir():
            if p.name.startswith("."):
                shutil.rmtree(p, ignore_errors=True)
    for p in layout.work.glob(".dedup.tmp.*"):
        shutil.rmtree(p, ignore_errors=True)
    todo = []
    for i in range(n_units):
        if not layout.marker(i).is_file():
            shutil.rmtree(layout.unit(i), ignore_errors=True)
            todo.append(i)
    return todo


def load_markers(layout: Layout, n_units: int) -> list[dict]:
    return [json.loads(layout.marker(i).read_text()) for i in range(n_units)]


def merge_map_stats(markers: list[dict], names: list[str], max_examples: int) -> tuple[list[StepStats],
                                                                                     BadInput]:
    stats = [StepStats(n, max_examples=max_examples) for n in names]
    bad = BadInput(max_examples=max_examples)
    for m in markers:
        for st, d in zip(stats, m["steps"]):
            st.merge(StepStats.from_dict(d, max_examples))
        bad.merge(BadInput.from_dict(m["bad_input"], max_examples))
    return stats, bad


def load_sample(layout: Layout, n_units: int, k: int = SAMPLE_SIZE) -> list[Doc]:
    """The `k` input documents with the smallest seeded id hashes over all units (a deterministic
    uniform sample, the same however the input was split)."""
    best: list[tuple[int, str, str]] = []
    for u in range(n_units):
        path = layout.unit(u) / "sample.jsonl"
        with open(path, encoding="utf-8") as f:
            for r in map(json.loads, f):
                item = (-r["h"], r["id"], r["text"])
                if len(best) < k:
                    heapq.heappush(best, item)
                elif item > best[0]:
                    heapq.heapreplace(best, item)
    out, chars = [], 0
    for _, i, t in sorted(best, reverse=True):
        if out and chars + len(t) > SAMPLE_CHARS:
            break
        out.append(Doc(i, t))
        chars += len(t)
    return out
