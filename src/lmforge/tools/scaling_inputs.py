"""What `lmforge scaling fit` reads: the runs behind its arguments.

An argument is a run dir, a sweep dir (`lmforge sweep --out`: one run dir per point beside their logs and
sweep.json), or a glob of either (the shell's, or one quoted for us to expand). What is not a run (a log,
sweep.json, a dir with no config.yaml) is skipped and named, never fitted and never fatal. A run named
itself must give a point (an unfinished run is an error: leave it out); a run found inside a sweep dir that
gives none (a point that failed or was cut short) is skipped with its reason, so one failed point does not
stop the fit of the rest.
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
