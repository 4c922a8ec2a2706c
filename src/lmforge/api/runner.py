"""Jobs as processes: a FIFO queue, at most `max_running` at once, and re-attachment after a restart.

Each job runs under `python -m lmforge.api.launch` (see launch.py) as the leader of a new process
group: cancel is SIGTERM to that group (the trainer saves a checkpoint at the next step boundary and
exits), a Ctrl-C at the server's terminal does not reach it, and the server can die without taking its
jobs along. The group stays in the server's session on purpose: Linux's autogroup scheduling shares
the CPU fairly between sessions, so a job in a session of its own would compete with the API as an
equal; in the same session the API's lowered priority (app.py, API_NICE) lets the job go first. The launcher's
pid and its start time from /proc are stored with the job; a restarted server re-attaches a job whose
launcher still runs with that start time (a recycled pid has another), reads exit.json for one that
ended while the server was down, and marks the rest interrupted (resumable). Children the server
started are reaped by `Popen.poll`; re-attached ones are no longer its children (init reaps them).

On server shutdown the running jobs keep running (they are re-attached on the next start); an operator
who wants them stopped cancels them through the API first.

With a `Backend` (ray_backend.py) the same launcher runs elsewhere: the runner keeps the queue and the
store, and asks the backend to submit, poll and stop the jobs it started (those have no pid here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from lmforge.api.launch import EXIT, LAUNCH, STDERR
from lmforge.api.store import Job, Store
from lmforge.utils.io import atomic_write_json

POLL_S = 0.2


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), None if no such live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    if fields[0] in ("Z", "X"):  # a zombie has exited
        return None
    return int(fields[19])


def alive(pid: int | None, start: int | None) -> bool:
    return pid is not None and start is not None and proc_start_time(pid) == start


def launch_argv(job: Job) -> list[str]:
    """The job's command: `lmforge <verb> ...`, under torchrun when it needs several processes."""
    args = list(job.spec["args"]) + (["--resume"] if job.resume and job.kind == "train" else [])
    if job.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={job.nproc}", "-m", "lmforge", *args]
    return [sys.executable, "-m", "lmforge", *args]


def last_error(job_dir: Path) -> str | None:
    """The job's own error line (`lmforge <verb>: error: ...`) from its stderr, else its last line."""
    from lmforge.api.progress import tail_lines

    lines = [ln for ln in tail_lines(job_dir / STDERR, 200) if ln.strip()]
    for ln in reversed(lines):
        if ": error: " in ln:
            return ln.strip()[:2000]
    return lines[-1].strip()[:2000] if lines else None


class Backend(Protocol):
    """Where jobs run when not as processes of this machine. `poll` answers None while the job runs, else
    (status, error) to settle it with when it left no exit.json."""

    name: str

    def submit(self, job: Job, job_dir: Path) -> None: ...

    def poll(self, job: Job) -> tuple[str, str | None] | None: ...

    def stop(self, job: Job) -> None: ...


class Runner:
    """Starts queued jobs, watches running ones, and settles their outcome in the store."""

    def __init__(self, store: Store, workspace: Path, max_running: int = 1,
                 backend: Backend | None = None) -> None:
        self.store, self.workspace, self.max_running = store, workspace, max(1, max_running)
        self.backend = backend
        self._procs: dict[str, subprocess.Popen] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def job_dir(self, job_id: str) -> Path:
        return self.workspace / "jobs" / job_id

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.recover()
        self._thread = threading.Thread(target=self._loop, name="lmforge-jobs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; the jobs' processes go on (a restarted server re-attaches them)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def recover(self) -> None:
        """After a (re)start: re-attach live jobs, settle those that ended or died while we were away."""
        for job in self.store.list(status="running"):
            if alive(job.pid, job.pid_start) or self._remote(job):
                continue  # re-attached: _tick watches it through /proc (or asks the backend)
            self._settle(job, None)

    def wake(self) -> None:
        self._wake.set()

    def _remote(self, job: Job) -> bool:
        """A job the backend started: it has no process here (a local one always has a pid)."""
        return self.backend is not None and job.pid is None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - the runner must outlive one bad tick (a full disk)
                print(f"lmforge server: runner error: {e!r}", file=sys.stderr)
            self._wake.wait(POLL_S)
            self._wake.clear()

    def _tick(self) -> None:
        running = self.store.list(status="running")
        for job in running:
            proc = self._procs.get(job.id)
            if proc is not None:
                if proc.poll() is None:
                    continue
                del self._procs[job.id]
                self._settle(job, proc.returncode)
            elif self._remote(job):
                ended = self.backend.poll(job)
                if ended is not None:
                    self._settle(job, None, ended)
            elif not alive(job.pid, job.pid_start):
                self._settle(job, None)
        n = len(self.store.list(status="running"))
        for job in self.store.queued():
            if n >= self.max_running or self._stop.is_set():
                break
            if self._launch(job):
                n += 1

    # -- one job --------------------------------------------------------------------------------------
    def _launch(self, job: Job) -> bool:
        d = self.job_dir(job.id)
        try:
            (d / EXIT).unlink(missing_ok=True)
            spec = {"argv": launch_argv(job), "archive": job.spec.get("archive")}
            atomic_write_json(d / LAUNCH, spec)
            with self._lock:
                # Claim it first: a cancel that raced us wins and nothing starts.
                if not self.store.update(job.id, expect="queued", status="running", started_at=time.time(),
                                         attempts=job.attempts + 1, error=None, exit_code=None,
                                         finished_at=None):
                    return False
                if self.backend is not None:
                    self.backend.submit(self.store.get(job.id) or job, d)
                    return True
                proc = subprocess.Popen([sys.executable, "-m", "lmforge.api.launch", str(d)], cwd=d,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, process_group=0)
                self._procs[job.id] = proc
                self.store.update(job.id, pid=proc.pid, pid_start=proc_start_time(proc.pid))
        except OSError as e:
            self.store.update(job.id, status="failed", finished_at=time.time(), error=f"cannot start: {e}")
            return False
        return True

    def _settle(self, job: Job, launcher_code: int | None,
                ended: tuple[str, str | None] | None = None) -> None:
        """The outcome of a job whose launcher has gone, from exit.json (else the backend's `ended`)."""
        d = self.job_dir(job.id)
        try:
            info = json.loads((d / EXIT).read_text(encoding="utf-8"))
            code = int(info["code"])
        except (OSError, ValueError, KeyError, TypeError):
            code = None
        job = self.store.get(job.id) or job  # the cancel flag may have been set since the list
        fields: dict = {"finished_at": time.time(), "exit_code": code, "pid": None, "pid_start": None}
        if code == 0:
            fields.update(status="succeeded", error=None)
        elif job.cancel_requested:
            fields.update(status="cancelled", error=None)
        elif code is None and ended is not None:
            fields.update(status=ended[0], error=ended[1])
        elif code is None:
            what = "its launcher was killed" if launcher_code is not None else "its process died while the " \
                "server was down"
            fields.update(status="interrupted", error=f"the job stopped without an exit status ({what}); "
                          "resume it to continue from its last checkpoint")
        elif code in (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT,
                      -signal.SIGKILL):
            fields.update(status="interrupted", error=last_error(d) or f"stopped by a signal (exit {code})")
        else:
            fields.update(status="failed", error=last_error(d) or f"exit status {code}")
        self.store.update(job.id, expect="running", **fields)

    def cancel(self, job: Job) -> str:
        """Cancel a queued job at once, or SIGTERM a running one's process group; its new status."""
        with self._lock:
            if self.store.update(job.id, expect="queued", status="cancelled", finished_at=time.time(),
                                 cancel_requested=True):
                return "cancelled"
            job = self.store.get(job.id) or job
            if job.status != "running":
                return job.status
            self.store.update(job.id, cancel_requested=True)
            if self._remote(job):
                self.backend.stop(job)
            elif alive(job.pid, job.pid_start):
                try:
                    os.killpg(job.pid, signal.SIGTERM)  # the launcher leads the job's group
                except ProcessLookupError:
                    pass
        self.wake()
        return "running"
