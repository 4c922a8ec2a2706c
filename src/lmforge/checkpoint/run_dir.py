"""The run directory's life cycle: new, resumed, or refused because it holds another run."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from lmforge.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

# What a run writes; `data/` (prepared shards) is deliberately not in the list: replacing a run
# should not throw away its prepared corpus.
RUN_ARTIFACTS = ("config.yaml", "metrics.jsonl", "curves.png", "checkpoints", "tensorboard")


JOB_MARKER = ".torchrun_job"


def _job_id() -> str | None:
    """This torchrun job: its rendezvous id plus the agent process (the parent of the workers,
    which stays the same across restarts), as the rendezvous id alone defaults to 'none'."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return f"{os.environ['TORCHELASTIC_RUN_ID']}@{socket.gethostname()}:{os.getppid()}"


def restarted_job_owns(run_dir: Path) -> bool:
    """Under `torchrun --max-restarts`, True in a restarted attempt whose own first attempt opened
    `run_dir` (so it resumes what it started, never a run it was refused to touch)."""
    job = _job_id()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 or job is None:
        return False
    try:
        return (run_dir / JOB_MARKER).read_text() == job
    except OSError:
        return False


def mark_job(run_dir: Path) -> None:
    """Record which torchrun job opened `run_dir` (see restarted_job_owns)."""
    job = _job_id()
    if job is not None:
        atomic_write_text(run_dir / JOB_MARKER, job)


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
