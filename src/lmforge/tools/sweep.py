"""`lmforge sweep`: one `lmforge train` per point of a grid (or a random sample of it), each in its own run
dir under the sweep's dir, with a sweep.json summary that a re-run resumes from.

Every point is validated against the config schema before anything starts (a key that does not exist
fails at once, naming it). Points run as subprocesses, `parallel` at a time (locally; or as Ray tasks with
`backend="ray"`); each subprocess gets an equal share of the CPU threads so that P runs on a few cores do
not oversubscribe them. Prepared data is shared: when the base config sets no data.dir, every point uses
<out>/data, prepared once before the runs start.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError
from lmforge.utils.bounds import SEED, whole
from lmforge.utils.safe_yaml import load_yaml

SUMMARY = "sweep.json"
# Points of one sweep (a grid's product or --random K): each is a training run, validated before anything
# starts and listed in sweep.json. Ten thousand is past any search run by hand; more is a typo (or 10^8
# points, which used to be materialised before anything else happened).
MAX_SWEEP_POINTS = 10_000
PARALLEL = whole(1, 1024)
_NAME_OK = re.compile(r"[^A-Za-z0-9._=-]+")


@dataclass
class Axis:
    key: str
    values: list[Any] | None = None  # a list to choose from
    low: float | None = None  # or a range low..high (random search only)
    high: float | None = None

    @property
    def log(self) -> bool:
        """Learning rates are drawn log-uniformly (their useful range spans decades)."""
        last = self.key.rsplit(".", 1)[-1]
        return last == "lr" or last.endswith("_lr")

    def sample(self, rng: random.Random) -> Any:
        if self.values is not None:
            return rng.choice(self.values)
        assert self.low is not None and self.high is not None
        if isinstance(self.low, int) and isinstance(self.high, int):
            return rng.randint(self.low, self.high)
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)


def _value(raw: str) -> Any:
    """A grid value: a number where it reads as one (YAML would keep '1e-4' a string), else YAML."""
    raw = raw.strip()
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return load_yaml(raw, f"--grid value {raw[:40]!r}") if raw else None


def parse_axis(spec: str) -> Axis:
    """'model.d_model=64,128' (values, each parsed as YAML) or 'optim.lr=1e-4..1e-2' (a range)."""
    key, sep, raw = spec.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise LmforgeError(f"--grid {spec!r}: expected KEY=V1,V2,... or KEY=LOW..HIGH, e.g. "
                           "--grid model.d_model=64,128")
    if ".." in raw and "," not in raw:
        lo, hi = (_value(x) for x in raw.split("..", 1))
        finite = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                     for x in (lo, hi))
        if not finite or lo >= hi:
            raise LmforgeError(f"--grid {spec!r}: a range needs finite numbers LOW < HIGH")
        if Axis(key).log and lo <= 0:
            raise LmforgeError(f"--grid {spec!r}: {key} is drawn log-uniformly; LOW must be positive")
        return Axis(key, low=lo, high=hi)
    values = [_value(v) for v in raw.split(",")]
    return Axis(key, values=values)


def grid_points(axes: Sequence[Axis], random_k: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Every combination of the axes' values (a grid), or `random_k` points drawn from them (random search;
    ranges allowed). Duplicate draws are kept once."""
    if random_k is None:
        ranged = [a.key for a in axes if a.values is None]
        if ranged:
            raise LmforgeError(f"--grid {ranged[0]}=LOW..HIGH is a range: it needs --random K")
        size = math.prod(len(a.values or []) for a in axes)  # counted before a single point is built
        if size > MAX_SWEEP_POINTS:
            sizes = " x ".join(f"{len(a.values or []):,}" for a in axes)
            raise LmforgeError(f"--grid: {sizes} = {size:,} points; a sweep runs at most "
                               f"{MAX_SWEEP_POINTS:,}: give fewer values (or --random K for a sample)")
        points: list[dict[str, Any]] = [{}]
        for a in axes:
            points = [{**p, a.key: v} for p in points for v in a.values or []]
        return points
    whole(1, MAX_SWEEP_POINTS).check(random_k, "--random")
    SEED.check(seed, "--seed")
    rng = random.Random(seed)
    out, seen = [], set()
    for _ in range(random_k):
        p = {a.key: a.sample(rng) for a in axes}
        sig = json.dumps(p, sort_keys=True)
        if sig not in seen:
            seen.add(sig)
            out.append(p)
    return out


def point_name(point: dict[str, Any]) -> str:
    """A dir name from the point: 'd_model=64_max_steps=100'; anything but letters, digits and ._=- is
    replaced, so no name can leave the sweep dir; long names end in a hash."""
    parts = []
    for k, v in point.items():
        text = f"{v:.3g}" if isinstance(v, float) else json.dumps(v) if not isinstance(v, str) else v
        parts.append(f"{k.rsplit('.', 1)[-1]}={text}")
    name = _NAME_OK.sub("-", "_".join(parts)).strip(".-") or "point"
    if len(name) > 80:
        name = name[:70] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def _overrides(point: dict[str, Any]) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in point.items()]


def _final_loss(run_dir: Path) -> float | None:
    from lmforge.metrics.loggers import read_metrics

    vals = [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    return float(vals[-1]) if vals else None


@dataclass
class Job:
    name: str
    point: dict[str, Any]
    run_dir: Path
    overrides: list[str]
    resume: bool = False


def _command(config: str | None, job: Job) -> list[str]:
    cmd = [sys.executable, "-m", "lmforge", "train"]
    if config:
        cmd += ["-c", config]
    for o in job.overrides:
        cmd += ["--set", o]
    return cmd + (["--resume"] if job.resume else [])


def _run_job(cmd: list[str], log: str, threads: int) -> int:
    """One training subprocess, its output to `log`; returns its exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(log, "w", encoding="utf-8") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False).returncode


def sweep(config: str | None, overrides: Sequence[str], grid: Sequence[str], out: str | os.PathLike, *,
          random_k: int | None = None, seed: int = 0, parallel: int = 1, backend: str = "local",
          say: Callable[[str], object] = print) -> dict[str, Any]:
    """Run (or resume) the sweep; returns the summary written to <out>/sweep.json."""
    from lmforge.config.load import config_to_dict, load_config
    from lmforge.utils.io import atomic_write_json, read_json_object

    if backend not in ("local", "ray"):
        raise LmforgeError(f"--backend {backend!r}: valid backends: local, ray")
    PARALLEL.check(parallel, "--parallel")
    points = grid_points(_axes(grid), random_k, seed)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise LmforgeError(f"--out {out}: exists and is not a directory")
    summary_path = out / SUMMARY
    if out.is_dir() and any(out.iterdir()) and not summary_path.is_file():
        raise LmforgeError(f"--out {out}: a non-empty dir that holds no {SUMMARY}, so not a sweep; give a "
                           "new or empty dir (or the dir of the sweep to resume)")
    base = load_config(config, list(overrides))  # a bad base config fails here
    shared_data = base.data.dir is None
    # what the base resolves to (comments and key order of its file do not matter), and the overrides
    resolved = json.dumps(config_to_dict(base), sort_keys=True)
    identity = {"config": config, "overrides": list(overrides),
                "base_sha256": hashlib.sha256(resolved.encode()).hexdigest()}
    previous: dict[str, Any] = {}
    if summary_path.is_file():
        previous = read_json_object(summary_path, "sweep summary")
        old_id = previous.get("identity")
        if not isinstance(old_id, dict) or {k: old_id.get(k) for k in ("overrides", "base_sha256")} != {
                k: identity[k] for k in ("overrides", "base_sha256")}:
            raise LmforgeError(f"--out {out}: holds a sweep of another base config or --set overrides "
                               f"({previous.get('identity')}); give a new dir to sweep this one")
    root = out.resolve()
    jobs = _jobs(config, overrides, points, root, shared_data)
    out.mkdir(parents=True, exist_ok=True)  # every point is valid: only now is anything written
    entries, todo = _pending(jobs, previous, say)

    def save() -> dict[str, Any]:
        summary = {"identity": identity, "grid": list(grid), "random": random_k, "seed": seed,
                   "runs": [entries[j.name] for j in jobs]}
        atomic_write_json(summary_path, summary)
        return summary

    save()
    if todo:
        _prepare_data(config, [todo[0].overrides] if shared_data else [j.overrides for j in todo], say)
    threads = max(1, (os.cpu_count() or 1) // min(parallel, max(1, len(todo))))

    def finished(job: Job, code: int, seconds: float) -> None:
        loss = _final_loss(job.run_dir) if code == 0 else None
        entries[job.name].update(status="done" if code == 0 and loss is not None else "failed",
                                 returncode=code, final_loss=loss, seconds=round(seconds, 1),
                                 log=str(out / f"{job.name}.log"))
        save()
        what = f"final val loss {loss:.4f}" if loss is not None else f"exit {code}, see {out / job.name}.log"
        say(f"{entries[job.name]['status']:6s} {job.name}: {what} ({seconds:.0f}s)")

    runner = _run_ray if backend == "ray" else _run_local
    runner([(job, _command(config, job), str(out / f"{job.name}.log")) for job in todo], parallel, threads,
           finished)
    return save()


def _axes(grid: Sequence[str]) -> list[Axis]:
    """The --grid axes, each key once and none of run.* (the sweep sets those per point)."""
    if not grid:
        raise LmforgeError("give at least one --grid KEY=V1,V2,...")
    axes = [parse_axis(g) for g in grid]
    keys = [a.key for a in axes]
    if len(set(keys)) != len(keys):
        raise LmforgeError(f"--grid: a key is given twice ({', '.join(keys)}); give each key once")
    clash = [k for k in keys if k.split(".")[0] == "run"]
    if clash:
        raise LmforgeError(f"--grid {clash[0]}: the sweep sets run.* itself (each point's run dir is under "
                           "--out); sweep other keys")
    return axes


def _jobs(config: str | None, overrides: Sequence[str], points: list[dict[str, Any]], root: Path,
          shared_data: bool) -> list[Job]:
    """One job per point, named after it, its run dir a child of `root`; each point's config is loaded
    here, so a bad key or value is named before any run starts."""
    from lmforge.config.load import load_config

    jobs, names = [], set()
    for i, point in enumerate(points):
        name = point_name(point)
        if name in names:
            name = f"{name}-{i}"
        names.add(name)
        run_dir = (root / name).resolve()
        assert run_dir.parent == root, name  # point_name keeps every name a plain child of the sweep dir
        extra = [f"run.dir={json.dumps(str(run_dir))}", f"run.name={json.dumps(name)}"]
        if shared_data:
            extra.append(f"data.dir={json.dumps(str(root / 'data'))}")
        ovr = [*overrides, *_overrides(point), *extra]
        load_config(config, ovr)  # names a bad key or value before any run starts
        jobs.append(Job(name, point, run_dir, ovr))
    return jobs


def _pending(jobs: list[Job], previous: dict[str, Any], say: Callable[[str], object]
             ) -> tuple[dict[str, dict], list[Job]]:
    """(the summary's entries by name, the jobs still to run): a point a previous summary marks done
    and whose run finished is skipped; an interrupted one resumes from its checkpoint."""
    from lmforge.checkpoint.run_dir import holds_run

    old_runs = previous.get("runs")
    # only the names and statuses of a previous summary are read; run dirs are always derived again
    entries = {e["name"]: e for e in (old_runs if isinstance(old_runs, list) else [])
               if isinstance(e, dict) and isinstance(e.get("name"), str)}
    todo = []
    for job in jobs:
        old = entries.get(job.name)
        if old and old.get("status") == "done" and _final_loss(job.run_dir) is not None:
            say(f"skip {job.name}: finished (final loss {old.get('final_loss')})")
            continue
        # an interrupted point continues from its checkpoint; one with none (or a failed one) starts over
        # in its own dir, which only this sweep writes (its name comes from the point)
        ckpts = job.run_dir / "checkpoints"
        job.resume = ckpts.is_dir() and any(ckpts.iterdir())
        if not job.resume and holds_run(job.run_dir):
            job.overrides.append("run.overwrite=true")
        todo.append(job)
        entries[job.name] = {"name": job.name, "point": job.point, "run_dir": str(job.run_dir),
                             "status": "pending", "final_loss": None}
    return entries, todo


def _prepare_data(config: str | None, overrides: list[list[str]], say: Callable[[str], object]) -> None:
    """Prepare each distinct data dir once, before the runs (which would otherwise race to build it)."""
    from lmforge.config.load import load_config
    from lmforge.data import data_dir, prepare

    done = set()
    for ovr in overrides:
        cfg = load_config(config, ovr)
        key = str(data_dir(cfg))
        if key not in done:
            done.add(key)
            prepare(cfg, console=say)


def _run_local(work: list[tuple[Job, list[str], str]], parallel: int, threads: int,
               finished: Callable[[Job, int, float], None]) -> None:
    """Subprocesses, `parallel` at a time; results are recorded as each one ends."""
    pending = list(work)
    running: list[tuple[Job, subprocess.Popen, Any, float]] = []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                job, cmd, log = pending.pop(0)
                f = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed when the process ends
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
                running.append((job, proc, f, time.perf_counter()))
            time.sleep(0.2)
            for item in list(running):
                job, proc, f, t0 = item
                if proc.poll() is not None:
                    f.close()
                    running.remove(item)
                    finished(job, proc.returncode, time.perf_counter() - t0)
    finally:
        for _job, proc, f, _ in running:  # interrupted: stop what this sweep started (they can --resume)
            proc.terminate()
            proc.wait()
            f.close()


def _run_ray(work: list[tuple[Job, list[str], str]], parallel: int, threads: int,
             finished: Callable[[Job, int, float], None]) -> None:
    """Each point a Ray task (one CPU slot each, `parallel` slots) running the same subprocess."""
    try:
        import ray
    except ImportError:
        raise LmforgeError("--backend ray needs the ray package: pip install 'lmforge[ray]' (or use "
                           "--backend local)") from None
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=parallel, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(_timed_job)
        refs = {task.remote(cmd, log, threads): job for job, cmd, log in work}
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1)
            code, seconds = ray.get(ready[0])
            finished(refs.pop(ready[0]), code, seconds)
    finally:
        if started:
            ray.shutdown()


def _timed_job(cmd: list[str], log: str, threads: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    return _run_job(cmd, log, threads), time.perf_counter() - t0
