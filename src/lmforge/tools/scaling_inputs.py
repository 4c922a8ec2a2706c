"""What `lmforge scaling fit` reads: the runs behind its arguments, and the (N, D, loss) points of each.

An argument is a run dir, a sweep dir (`lmforge sweep --out`: one run dir per point beside their logs and
sweep.json), or a glob of either (the shell's, or one quoted for us to expand). What is not a run (a log,
sweep.json, a dir with no config.yaml) is skipped and named, never fitted and never fatal. A run named
itself must give a point (an unfinished run is an error: leave it out); a run found inside a sweep dir that
gives none (a point that failed or was cut short) is skipped with its reason, so one failed point does not
stop the fit of the rest.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError

_GLOB_CHARS = frozenset("*?[")


@dataclass
class FitInputs:
    named: list[Path] = field(default_factory=list)  # runs given directly: each must give a point
    found: list[Path] = field(default_factory=list)  # runs inside a sweep dir: skipped when they give none
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why it is not fitted)

    def skip_lines(self, limit: int = 8) -> list[str]:
        """The skipped paths as a few lines of text (the rest counted)."""
        lines = [f"  skipped {path}: {why}" for path, why in self.skipped[:limit]]
        if len(self.skipped) > limit:
            lines.append(f"  ... and {len(self.skipped) - limit} more")
        return lines


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.yaml").is_file()


def gather_runs(args: Sequence[str]) -> FitInputs:
    """The runs behind `scaling fit`'s arguments (see the module docstring), each once, in order."""
    out, seen = FitInputs(), set()

    def add(path: Path, named: bool) -> None:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            (out.named if named else out.found).append(path)

    for arg in args:
        paths = [Path(arg)]
        if not Path(arg).exists() and _GLOB_CHARS & set(arg):
            paths = [Path(p) for p in sorted(glob.glob(arg))]
            if not paths:
                raise LmforgeError(f"{arg}: no path matches this pattern; give run dirs or a sweep dir")
        for path in paths:
            if not path.exists():
                raise LmforgeError(f"{path}: no such run dir or sweep dir")
            if is_run_dir(path):
                add(path, named=True)
            elif not path.is_dir():
                out.skipped.append((str(path), "not a run dir (a file)"))
            else:
                children = sorted(p for p in path.iterdir() if not p.name.startswith("."))
                runs = [p for p in children if is_run_dir(p)]
                if not runs:
                    out.skipped.append((str(path), "not a run dir (no config.yaml) and holds no run dirs"))
                    continue
                for child in children:
                    if is_run_dir(child):
                        add(child, named=False)
                    else:
                        out.skipped.append((str(child), "not a run dir"))
    return out


def param_count(model, count: str = "total") -> int:
    """N of a ModelConfig as a law counts it. "total": every parameter, a tied table once (Chinchilla).
    "non-embedding": without any vocabulary or position table, the output projection included, tied or
    not (Kaplan et al. 2020's N, ~12 n_layers d_model^2; flops.py's exclude_embeddings keeps the output
    projection, which for FLOPs is right)."""
    from lmforge.models.flops import count_params

    if count == "total":
        return count_params(model)
    return count_params(model, exclude_embeddings=True) - model.vocab_size * model.d_model


# -- points from runs ---------------------------------------------------------------------------------
@dataclass
class Point:
    run: str
    step: int
    n: int
    d: int
    loss: float
    final: bool = True


def run_points(run_dir: str | os.PathLike, count: str = "total", all_evals: bool = False) -> list[Point]:
    """(N, D, validation loss) of a trained run: its final evaluation, and with `all_evals` every earlier
    one as well. N is counted from the run's resolved config.yaml, D is tokens_seen at the evaluated step
    (from metrics.jsonl). Earlier evaluations sit above the loss a run of that length would reach (the lr
    had not decayed yet), so they bias a fit; they are off by default."""
    from lmforge.config.load import load_config
    from lmforge.metrics.loggers import read_metrics

    path = Path(run_dir)
    if not (path / "config.yaml").is_file():
        raise LmforgeError(f"{path} is not a run dir (no config.yaml); give the dirs of trained runs")
    cfg = load_config(path / "config.yaml")
    if cfg.model.vocab_size is None:
        raise LmforgeError(f"{path}/config.yaml has no model.vocab_size: the run was not trained by lmforge")
    n = param_count(cfg.model, count)
    records = read_metrics(path / "metrics.jsonl")
    seen = {r["step"]: r["tokens_seen"] for r in records if _numbers(r, "step", "tokens_seen")}
    evals = {r["step"]: r["val_loss"] for r in records if _numbers(r, "step", "val_loss")}
    if not evals or not seen:
        raise LmforgeError(f"{path}/metrics.jsonl has no validation loss or no tokens_seen: train the run "
                           "to its end (lmforge train), with validation data")
    last = max(evals)
    if last < max(seen):
        raise LmforgeError(f"{path}: the last validation (step {last}) is before the last step "
                           f"({max(seen)}); the run did not finish")
    points = []
    for step in sorted(evals) if all_evals else [last]:
        tokens = _tokens_at(seen, step)
        if tokens is None or tokens <= 0 or not math.isfinite(evals[step]) or evals[step] <= 0:
            continue
        points.append(Point(str(path), step, n, tokens, float(evals[step]), final=step == last))
    return points


def _numbers(record: Any, *keys: str) -> bool:
    """The metrics record has finite numbers under `keys` (a hand-edited or damaged file may not)."""
    return isinstance(record, dict) and all(
        isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)
        and math.isfinite(record[k]) for k in keys)


def _tokens_at(seen: dict[int, int], step: int) -> int | None:
    """tokens_seen at `step`: logged there, else interpolated between the logged steps around it."""
    if step in seen:
        return int(seen[step])
    below = [s for s in seen if s < step]
    above = [s for s in seen if s > step]
    if not above:
        return None
    s0, t0 = (max(below), seen[max(below)]) if below else (0, 0)
    s1 = min(above)
    return int(round(t0 + (seen[s1] - t0) * (step - s0) / (s1 - s0)))


def fit_points(args: Sequence[str], count: str = "total", all_evals: bool = False
               ) -> tuple[list[Point], int, FitInputs]:
    """The points of the runs behind `scaling fit`'s arguments (`gather_runs`), the number of
    runs they came from, and what was skipped (with its reason)."""
    inputs = gather_runs(args)
    points: list[Point] = []
    for run in inputs.named:
        points += run_points(run, count, all_evals)
    used = len(inputs.named)
    for run in inputs.found:
        try:
            got = run_points(run, count, all_evals)
        except LmforgeError as e:
            inputs.skipped.append((str(run), str(e).removeprefix(f"{run}: ").removeprefix(f"{run}/")))
            continue
        points += got
        used += 1
    if not used:
        raise LmforgeError("no trained run to fit in " + ", ".join(args) + ": "
                           + "; ".join(f"{p} ({why})" for p, why in inputs.skipped[:5])
                           + ("; ..." if len(inputs.skipped) > 5 else "")
                           + "; give the dirs of runs trained to the end with validation, or a sweep dir")
    return points, used, inputs
