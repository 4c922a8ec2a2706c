"""The run directory's life cycle: new, resumed, or refused because it holds another run or another
process trains in it."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

from lmforge.errors import LmforgeError
from lmforge.utils.io import atomic_write_text
from lmforge.utils.pidlock import PidLock

# What a run writes; `data/` (prepared shards) is deliberately not in the list: replacing a run
# should not throw away its prepared corpus.
RUN_ARTIFACTS = ("config.yaml", "metrics.jsonl", "curves.png", "checkpoints", "tensorboard",
                 "labels.json")  # labels.json: a classifier's label map (assembly/methods/classify.py)


JOB_MARKER = ".torchrun_job"
LOCK_FILE = ".lock"


class RunLock:
    """An exclusive lock on a run dir for the life of the process that trains in it: a `PidLock` on
    <run.dir>/.lock, plus what opening the run dir made (the dirs it created, the entries that were
    there before), so that a run refused before it trained can leave the place as it found it."""

    def __init__(self, lock: PidLock | None, run_dir: Path | None = None, made: tuple[Path, ...] = (),
                 before: frozenset[str] = frozenset()) -> None:
        self._lock, self.run_dir, self.made, self.before = lock, run_dir, made, before

    @classmethod
    def acquire(cls, run_dir: Path, made: tuple[Path, ...] = ()) -> RunLock:
        before = frozenset(os.listdir(run_dir))
        lock = PidLock.acquire(run_dir / LOCK_FILE, lambda holder: LmforgeError(
            f"run.dir {run_dir} is in use: {holder} trains in it; wait for it to finish (or stop it), or "
            "choose another run.dir"))
        return cls(lock, run_dir, made, before)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def discard(self) -> None:
        """The run was refused before it trained: remove what it made in the run dir (entries that were not
        there when it was opened, the lock file if it made it, the dirs it created), then unlock."""
        if self._lock is None or not self._lock.held or self.run_dir is None:
            return self.release()
        try:
            for name in sorted(set(os.listdir(self.run_dir)) - self.before - {LOCK_FILE}):
                target = self.run_dir / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    target.unlink(missing_ok=True)
        except OSError:  # a refusal must still reach the user; what could not go is left
            pass
        self._lock.release(remove=self._lock.created)
        self._lock = None
        for d in reversed(self.made):  # deepest first; each only if now empty
            try:
                d.rmdir()
            except OSError:
                break

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


def _overlap(run_dir: Path, inputs: Sequence[tuple[str, Path]], replace: bool) -> None:
    """Refuse a run that would write into, or delete, one of its own inputs: an input that is the run dir
    or lies inside what the run writes there (its checkpoints: a resumed run rotates them away), and, when
    run.overwrite replaces the old run, one that holds any of it."""
    run_real = run_dir.resolve()
    for key, inp in inputs:
        src = inp.resolve()
        if src == run_real:
            raise LmforgeError(f"{key}={inp}, an input of this run, is run.dir {run_dir} itself: a run may "
                               "not write where it reads; choose another run.dir")
        for name in RUN_ARTIFACTS:
            target = run_real / name
            if src == target or target in src.parents:
                raise LmforgeError(f"{key}={inp}, an input of this run, lies inside {run_dir / name}, which "
                                   "this run writes (and rotates or replaces); copy it elsewhere or choose "
                                   "another run.dir")
            if replace and src in target.parents:
                raise LmforgeError(f"run.overwrite would delete {run_dir / name}, which is part of {inp} "
                                   f"({key}), an input of this run; copy it elsewhere or choose another "
                                   "run.dir")


def open_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, say=print,
                 inputs: Sequence[tuple[str, Path]] = ()) -> tuple[bool, RunLock]:
    """Make `run_dir` ready and lock it. Returns (an earlier run in it is to be resumed, the lock).

    A dir that already holds a run is refused unless resuming or overwriting, so that a typo in a
    command never destroys a week of training. Everything is checked before anything is written: the
    run's `inputs` ((config key, path) of every file it reads: config/paths.py classifies them) may not
    be the run dir or lie in what it writes, overwriting refuses to delete an artifact that holds one, and
    happens only once this process holds the lock. A run refused later calls `RunLock.discard`.
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
    _overlap(run_dir, inputs, replace)
    made = []
    for d in [run_dir, *run_dir.parents]:  # the dirs this run creates (removed again if it is refused)
        if d.exists():
            break
        made.append(d)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = RunLock.acquire(run_dir, tuple(reversed(made)))
    except BaseException:
        for d in made:
            try:
                d.rmdir()
            except OSError:
                break
        raise
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
        lock.before = lock.before - set(RUN_ARTIFACTS)  # what replaces them is this run's own
    return existing and resume, lock
