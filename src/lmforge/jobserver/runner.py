"""Jobs as processes: a FIFO queue, at most `max_running` at once, and re-attachment after a restart.

Each job runs under `python -m lmforge.jobserver.launch` (see launch.py) as the leader of a new process
group: cancel is SIGTERM to that group (the trainer saves a checkpoint at the next step boundary and
exits), a Ctrl-C at the server's terminal does not reach it, and the server can die without taking its
jobs along. The group stays in the server's session on purpose: Linux's autogroup scheduling shares
the CPU fairly between sessions, so a job in a session of its own would compete with the API as an
equal; in the same session the API's lowered priority (app.py, API_NICE) lets the job go first. The
launcher's pid and its start time from /proc are stored with the job; a restarted server re-attaches a
job whose launcher still runs with that start time (a recycled pid has another), reads exit.json for one
that ended while the server was down, and marks the rest interrupted (resumable). Children the server
started are reaped by `Popen.poll`; re-attached ones are no longer its children (init reaps them).

A job's state stays true when processes die under it: a job is settled only once none of its processes
is left (every one carries the job's mark, procs.py: torchrun's workers, in sessions of their own,
outlive a killed launcher or agent otherwise, and are stopped). Jobs start only while they fit the
server's limits (limits.py: processes and memory, in total and per user), and the memory they really
hold is measured every WATCH_S: a job past its bound is stopped (failed, with the reason) before the
kernel's out-of-memory killer strikes at random.

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

from lmforge.jobserver import procs
from lmforge.jobserver.launch import EXIT, LAUNCH, STDERR
from lmforge.jobserver.limits import GIB, Ask, Limits, OverAsk
from lmforge.jobserver.store import Job, Store
from lmforge.utils.io import atomic_write_json

POLL_S = 0.2
WATCH_S = 1.0  # how often the memory of running jobs is measured
STOPPED = "stopped.json"  # why the server stopped a job itself (its memory), read when it is settled


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
    from lmforge.jobserver.progress import tail_lines

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
                 backend: Backend | None = None, limits: Limits | None = None) -> None:
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running={max_running!r}: give a whole number >= 1")
        self.store, self.workspace, self.max_running = store, workspace, max_running
        self.backend = backend
        self.limits = limits or Limits.for_machine(max_running=max_running)
        # the app's path rules, checked again when a train job starts: a dir it names may have become
        # (or gained) a link into another user's area while it queued
        self.confiner = None
        self._procs: dict[str, subprocess.Popen] = {}
        # Jobs whose launcher is gone (its exit code, None if unknown and why), and how many of their
        # processes were found still running: a job is settled once none is left.
        self._gone: dict[str, tuple[int | None, str]] = {}
        self._strays: dict[str, int] = {}
        self._watched = 0.0
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
        """After a (re)start: re-attach live jobs, settle those that ended or died while we were away (once
        none of their processes is left: a torchrun worker can outlive its launcher)."""
        for job in self.store.list(status="running"):
            if alive(job.pid, job.pid_start) or self._remote(job):
                continue  # re-attached: _tick watches it through /proc (or asks the backend)
            self._gone[job.id] = (None, "its process died while the server was down")
            self._launcher_gone(job)

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
                print(f"lmforge jobs: runner error: {e!r}", file=sys.stderr)
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
                self._gone[job.id] = (proc.returncode, "its launcher was killed")
            elif self._remote(job):
                ended = self.backend.poll(job)
                if ended is not None:
                    self._settle(job, None, ended)
                continue
            elif job.id not in self._gone:
                if alive(job.pid, job.pid_start):
                    continue
                self._gone[job.id] = (None, "its launcher died")
            self._launcher_gone(job)
        if time.monotonic() - self._watched >= WATCH_S:
            self._watched = time.monotonic()
            self._watch([j for j in running if not self._remote(j) and j.id not in self._gone])
        self._start_queued()

    def _start_queued(self) -> None:
        """Start queued jobs, first in first out, while they fit: at most max_running, and the limits'
        processes and memory in total and per user. A job its user's share keeps waiting lets other
        users' jobs pass; one the total keeps waiting stops the queue (a large job is not starved)."""
        asks = [(j.user, Ask.of(j.spec, j.nproc)) for j in self.store.list(status="running")]
        for job in self.store.queued():
            if len(asks) >= self.max_running or self._stop.is_set():
                break
            ask = Ask.of(job.spec, job.nproc)
            try:
                self.limits.check(ask)  # the server may have restarted with lower limits
            except OverAsk as e:
                self.store.update(job.id, expect="queued", status="failed", finished_at=time.time(),
                                  error=f"cannot start on this server: {e}")
                continue
            why = self.limits.wait_reason(ask, job.user, asks)
            if why == "user":
                continue
            if why == "total":
                break
            if self._launch(job, ask):
                asks.append((job.user, ask))

    def _launcher_gone(self, job: Job) -> None:
        """The job's launcher has ended: stop what is left of the job (torchrun workers live in sessions of
        their own), and settle it once nothing is."""
        left = procs.processes_of(job.id)
        if left:
            for p in left:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self._strays[job.id] = max(self._strays.get(job.id, 0), len(left))
            return  # settled on a later tick, when they are gone
        code, why = self._gone.pop(job.id, (None, "its launcher died"))
        self._settle(job, code, why=why, strays=self._strays.pop(job.id, 0))

    def _watch(self, jobs: list[Job]) -> None:
        """Stop a job whose processes hold more memory than one job may, or, when the running jobs together
        hold more than all may, the one furthest beyond what it asked: before the kernel's out-of-memory
        killer takes processes of any job (or of the server) at random."""
        if not jobs:
            return
        by_id = {j.id: j for j in jobs}
        used = {jid: sum(p.memory for p in ps) for jid, ps in procs.scan(set(by_id)).items()}
        lim = self.limits
        for jid, n in used.items():
            if n > lim.max_memory_per_job:
                return self._stop_job(by_id[jid], f"its processes held {n / GIB:.1f} GiB of memory, more "
                                      f"than the {lim.max_memory_per_job / GIB:.1f} GiB one job may use "
                                      "(--max-memory-gb)")
        total = sum(used.values())
        if total > lim.max_memory:
            jid = max(used, key=lambda j: used[j] - Ask.of(by_id[j].spec, by_id[j].nproc).memory)
            self._stop_job(by_id[jid], f"the running jobs together held {total / GIB:.1f} GiB of memory, "
                           f"more than the server's {lim.max_memory / GIB:.1f} GiB (--max-memory-gb-total), "
                           f"and this one ({used[jid] / GIB:.1f} GiB) the most beyond what it asked")

    def _stop_job(self, job: Job, reason: str) -> None:
        atomic_write_json(self.job_dir(job.id) / STOPPED, {
            "error": f"stopped by the server: {reason}; resume it with a smaller model or batch, or ask the "
            "operator for more"})
        for p in procs.processes_of(job.id):  # the launcher too: the job is settled from stopped.json
            try:
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        print(f"lmforge jobs: stopped job {job.id}: {reason}", file=sys.stderr, flush=True)

    # -- one job --------------------------------------------------------------------------------------
    def _refused_now(self, job: Job) -> str | None:
        """Why the job's saved config breaks the path rules now (None: it does not, or it is no train job)."""
        if self.confiner is None or job.kind != "train":
            return None
        from lmforge.config import load_config
        from lmforge.errors import ConfigError
        from lmforge.jobserver.confine import ConfinementError

        own = lambda other: (j := self.store.get(other)) is not None and j.user == job.user  # noqa: E731
        try:
            self.confiner.confine(load_config(self.job_dir(job.id) / "config.yaml"), job.id, own)
        except (ConfinementError, ConfigError, OSError) as e:
            return f"refused when it was to start: {e}"
        return None

    def _launch(self, job: Job, ask: Ask) -> bool:
        d = self.job_dir(job.id)
        refused = self._refused_now(job)
        if refused is not None:
            self.store.update(job.id, expect="queued", status="failed", finished_at=time.time(),
                              error=refused)
            return False
        try:
            (d / EXIT).unlink(missing_ok=True)
            (d / STOPPED).unlink(missing_ok=True)
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
                # The mark finds every process of the job later (procs.py); the thread count is its share.
                env = {**os.environ, procs.JOB_ENV: job.id, "OMP_NUM_THREADS": str(ask.threads)}
                proc = subprocess.Popen([sys.executable, "-m", "lmforge.jobserver.launch", str(d)], cwd=d,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, process_group=0, env=env)
                self._procs[job.id] = proc
                self.store.update(job.id, pid=proc.pid, pid_start=proc_start_time(proc.pid))
        except OSError as e:
            self.store.update(job.id, status="failed", finished_at=time.time(), error=f"cannot start: {e}")
            return False
        return True

    def _settle(self, job: Job, launcher_code: int | None, ended: tuple[str, str | None] | None = None,
                why: str = "its launcher was killed", strays: int = 0) -> None:
        """The outcome of a job whose launcher has gone (and none of its processes is left), from exit.json,
        else from the server's own stop (stopped.json), else the backend's `ended`."""
        d = self.job_dir(job.id)
        try:
            info = json.loads((d / EXIT).read_text(encoding="utf-8"))
            code = int(info["code"])
        except (OSError, ValueError, KeyError, TypeError):
            code = None
        try:
            stopped = str(json.loads((d / STOPPED).read_text(encoding="utf-8"))["error"])
        except (OSError, ValueError, KeyError, TypeError):
            stopped = None
        job = self.store.get(job.id) or job  # the cancel flag may have been set since the list
        fields: dict = {"finished_at": time.time(), "exit_code": code, "pid": None, "pid_start": None}
        left = f"; its {strays} remaining process(es) were stopped" if strays else ""
        if code == 0:
            fields.update(status="succeeded", error=None)
        elif stopped is not None:
            fields.update(status="failed", error=stopped)
        elif job.cancel_requested:
            fields.update(status="cancelled", error=None)
        elif code is None and ended is not None:
            fields.update(status=ended[0], error=ended[1])
        elif code is None:
            if launcher_code is not None and launcher_code < 0:
                why += f" by signal {-launcher_code}" + (" (SIGKILL: the kernel's out-of-memory killer sends "
                                                         "it)" if launcher_code == -signal.SIGKILL else "")
            fields.update(status="interrupted", error=f"the job stopped without an exit status "
                          f"({why}{left}); resume it to continue from its last checkpoint")
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
