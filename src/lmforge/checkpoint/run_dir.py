"""The run directory's life cycle: new, resumed, or refused because it holds another run or another
process trains in it."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

from lmforge.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

# What a run writes; `data/` (prepared shards) is deliberately not in the list: replacing a run
# should not throw away its prepared corpus.
RUN_ARTIFACTS = ("config.yaml", "metrics.jsonl", "curves.png", "checkpoints", "tensorboard")


JOB_MARKER = ".torchrun_job"
LOCK_FILE = ".lock"


class RunLock:
    """An exclusive lock on a run dir for the life of the process that trains in it.

    `fcntl.flock` on <run.dir>/.lock: the kernel drops it when the holder exits, however it exits
    (kill -9 included), so there are no stale locks; the file itself only tells who holds it.
    """

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): unlocked, as before
            return cls(None)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise LmforgeError(f"run.dir {run_dir} is in use: {holder} trains in it; wait for it to finish "
                               "(or stop it), or choose another run.dir") from None
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} (since {stamp})\n".encode(), 0)
        return cls(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a free run dir names no holder
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


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


def open_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, say=print,
                 inputs: tuple[Path, ...] = ()) -> tuple[bool, RunLock]:
    """Make `run_dir` ready and lock it. Returns (an earlier run in it is to be resumed, the lock).

    A dir that already holds a run is refused unless resuming or overwriting, so that a typo in a
    command never destroys a week of training. Everything is checked before anything is written:
    overwriting refuses to delete an artifact that is, or holds, one of the run's `inputs` (data
    sources, weights to start from, a tokenizer), and happens only once this process holds the lock.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise LmforgeError(f"run.dir {run_dir} exists and is not a directory; choose another run.dir")
    existing = holds_run(run_dir)
    if existing and not resume and not overwrite:
        found = ", ".join(n for n in RUN_ARTIFACTS if (run_dir / n).exists())
        raise LmforgeError(
            f"run.dir {run_dir} already holds a run ({found}); pass --resume to continue it, "
            "--set run.overwrite=true to replace it, or choose another run.dir"
        )
    replace = existing and not resume
    if replace:
        for name in RUN_ARTIFACTS:
            target = (run_dir / name).resolve()
            for inp in inputs:
                inp = inp.resolve()
                if inp == target or target in inp.parents or inp in target.parents:
                    raise LmforgeError(f"run.overwrite would delete {run_dir / name}, which is part of "
                                       f"{inp}, an input of this run; copy it elsewhere or choose another "
                                       "run.dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(run_dir)
    if resume and not existing:
        say(f"[yellow]nothing to resume in {run_dir}: starting a new run[/yellow]")
    if replace:
        say(f"[yellow]run.overwrite: replacing the run in {run_dir}[/yellow]")
        for name in RUN_ARTIFACTS:
            target = run_dir / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    return existing and resume, lock
