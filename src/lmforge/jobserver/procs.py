"""The processes of a job, wherever they went: each carries LMFORGE_JOB=<job id> in its environment.

A job's launcher leads its own process group, but torchrun starts each worker in a session of its own,
so neither the group nor the parent links find them all once the launcher or torchrun is gone (the
kernel's out-of-memory killer takes whichever it likes). The mark in the environment is inherited by
every process the job starts and cannot be recycled as a pid can: the runner and the launcher find a
job's processes by it (Linux /proc; elsewhere nothing is found and nothing is killed).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

JOB_ENV = "LMFORGE_JOB"
_MARK = JOB_ENV.encode() + b"="


@dataclass
class Proc:
    pid: int
    memory: int  # bytes it holds that the kernel cannot drop: anonymous and shared (RssAnon + RssShmem)


def _job_of(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:  # gone, or another user's
        return None
    i = env.find(b"\0" + _MARK)
    if i < 0:
        if not env.startswith(_MARK):
            return None
        i = -1
    start = i + 1 + len(_MARK)
    end = env.find(b"\0", start)
    return env[start:end if end >= 0 else None].decode("ascii", "replace")


def _memory(pid: str) -> int:
    total = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith((b"RssAnon:", b"RssShmem:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total


def scan(jobs: set[str] | None = None) -> dict[str, list[Proc]]:
    """job id -> its live processes (of `jobs` only, when given), with the memory each holds."""
    found: dict[str, list[Proc]] = {}
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    me = str(os.getpid())
    for pid in pids:
        if pid == me:
            continue
        job = _job_of(pid)
        if job is None or (jobs is not None and job not in jobs):
            continue
        found.setdefault(job, []).append(Proc(int(pid), _memory(pid)))
    return found


def processes_of(job_id: str) -> list[Proc]:
    return scan({job_id}).get(job_id, [])


def kill_all(job_id: str, sig: int = signal.SIGKILL, wait_s: float = 5.0) -> int:
    """Send `sig` to every process of the job (this one aside) until none is left or `wait_s` passes;
    the number of processes it found at first. Processes the caller started are reaped by the caller."""
    procs = processes_of(job_id)
    deadline = time.monotonic() + wait_s
    left = procs
    while left:
        for p in left:
            try:
                os.kill(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
        left = processes_of(job_id)
    return len(procs)
