"""The run directory's life cycle: new, resumed, or refused because it holds another run."""

from __future__ import annotations

import shutil
from pathlib import Path

from lmforge.errors import LmforgeError

# What a run writes; `data/` (prepared shards) is deliberately not in the list: replacing a run
# should not throw away its prepared corpus.
RUN_ARTIFACTS = ("config.yaml", "metrics.jsonl", "curves.png", "checkpoints", "tensorboard")


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_ARTIFACTS)


def open_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, say=print) -> bool:
    """Make `run_dir` ready. Returns True when an earlier run in it is to be resumed.

    A dir that already holds a run is refused unless resuming or overwriting, so that a typo in a
    command never destroys a week of training.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise LmforgeError(f"run.dir {run_dir} exists and is not a directory; choose another run.dir")
    existing = holds_run(run_dir)
    if resume:
        if not existing:
            say(f"[yellow]nothing to resume in {run_dir}: starting a new run[/yellow]")
        run_dir.mkdir(parents=True, exist_ok=True)
        return existing
    if existing:
        if not overwrite:
            found = ", ".join(n for n in RUN_ARTIFACTS if (run_dir / n).exists())
            raise LmforgeError(
                f"run.dir {run_dir} already holds a run ({found}); pass --resume to continue it, "
                "--set run.overwrite=true to replace it, or choose another run.dir"
            )
        say(f"[yellow]run.overwrite: replacing the run in {run_dir}[/yellow]")
        for name in RUN_ARTIFACTS:
            target = run_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    return False
