"""A job's state stays true when its processes die under it or grow too large: the runner of the job
server against real processes (small Python commands standing in for lmforge and torchrun; no torch).

- a launcher killed (the kernel's out-of-memory killer, kill -9) while a worker of the job runs on in a
  session of its own (as torchrun's do): the worker is stopped before the job is marked interrupted;
- a command that ends while a process it started runs on: the launcher stops it;
- a job past its memory bound is stopped and marked failed with the reason, not left to the kernel;
- the queue starts what fits: a user at their share lets others pass, the total keeps FIFO order.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from lmforge.jobserver import procs
from lmforge.jobserver import runner as runner_mod
from lmforge.jobserver.launch import JOB_OOM_SCORE_ADJ
from lmforge.jobserver.limits import GIB, Ask, Limits
from lmforge.jobserver.runner import Runner, proc_start_time
from lmforge.jobserver.store import Job, Store

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")

# The job's command: starts a "worker" in a session of its own (as torchrun does), records its pid, then
# waits (or allocates `MB` megabytes first, or exits at once leaving the worker behind).
COMMAND = """
import os, subprocess, sys, time
mb, wait = int(sys.argv[1]), float(sys.argv[2])
w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
with open("worker.pid.tmp", "w") as f:
    f.write(str(w.pid))
os.replace("worker.pid.tmp", "worker.pid")
hog = bytearray(mb << 20)
for i in range(0, len(hog), 4096):
    hog[i] = 1
time.sleep(wait)
"""


@pytest.fixture
def rig(tmp_path, monkeypatch):
    """(runner, add(job_id, user, mb, wait, ask) -> Job, wait_for(job_id, predicate) -> Job)."""
    ws = tmp_path / "ws"
    (ws / "jobs").mkdir(parents=True)
    store = Store(ws)
    made: list[str] = []

    def argv(job: Job) -> list[str]:
        return [sys.executable, "-c", COMMAND, *job.spec["args"]]

    monkeypatch.setattr(runner_mod, "launch_argv", argv)
    limits = Limits.for_machine(max_memory_gb=0.25, max_memory_gb_total=0.25, max_procs=4,
                                max_procs_per_job=2, max_procs_per_user=2)
    runner = Runner(store, ws, max_running=4, limits=limits)

    def add(job_id: str, user: str = "alice", mb: int = 0, wait: float = 60, ask: Ask | None = None) -> Job:
        ask = ask or Ask(1, 1, GIB // 10)
        (ws / "jobs" / job_id).mkdir()
        job = Job(id=job_id, user=user, kind="train", name=job_id, status="queued", created_at=time.time(),
                  queued_at=time.time(), nproc=ask.procs, spec={"args": [str(mb), str(wait)],
                                                                "ask": ask.to_json()})
        store.add_job(job)
        made.append(job_id)
        return job

    def wait_for(job_id: str, ok, timeout: float = 30.0) -> Job:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            runner._tick()
            job = store.get(job_id)
            if ok(job):
                return job
            time.sleep(0.1)
        raise AssertionError(f"{job_id}: {store.get(job_id)}")

    yield runner, add, wait_for, ws
    for job_id in made:
        procs.kill_all(job_id, wait_s=2)
    for p in runner._procs.values():
        p.kill()
        p.wait()
    store.close()


def worker_of(ws: Path, job_id: str, timeout: float = 20.0) -> int:
    f = ws / "jobs" / job_id / "worker.pid"
    deadline = time.monotonic() + timeout
    while not f.exists():
        assert time.monotonic() < deadline, "the job's command did not start its worker"
        time.sleep(0.05)
    return int(f.read_text())


def test_a_killed_launcher_leaves_no_worker_running_and_the_job_is_marked_after(rig):
    runner, add, wait_for, ws = rig
    add("job-00000000000000a1")
    job = wait_for("job-00000000000000a1", lambda j: j.status == "running" and j.pid)
    worker = worker_of(ws, job.id)
    assert proc_start_time(worker) is not None
    # The out-of-memory killer is pointed at the job's processes first, not at its launcher.
    assert int(Path(f"/proc/{worker}/oom_score_adj").read_text()) >= JOB_OOM_SCORE_ADJ
    assert int(Path(f"/proc/{job.pid}/oom_score_adj").read_text()) < JOB_OOM_SCORE_ADJ
    os.kill(job.pid, signal.SIGKILL)  # as the out-of-memory killer would: the launcher, not its workers
    job = wait_for(job.id, lambda j: j.status != "running")
    assert proc_start_time(worker) is None  # stopped, and only then was the job marked
    assert job.status == "interrupted" and job.exit_code is None
    assert "its launcher was killed by signal 9" in job.error
    assert "its 2 remaining process(es) were stopped" in job.error  # the command and its worker
    assert procs.processes_of(job.id) == []


def test_a_restarted_server_stops_what_is_left_of_a_job_whose_launcher_died(rig):
    runner, add, wait_for, ws = rig
    add("job-00000000000000a2")
    job = wait_for("job-00000000000000a2", lambda j: j.status == "running" and j.pid)
    worker = worker_of(ws, job.id)
    launcher = runner._procs.pop(job.id)  # the server "restarts": it knows nothing of its children
    os.kill(job.pid, signal.SIGKILL)
    launcher.wait()
    runner._gone.clear()
    runner.recover()
    job = wait_for(job.id, lambda j: j.status != "running")
    assert proc_start_time(worker) is None
    assert job.status == "interrupted" and "while the server was down" in job.error


def test_the_launcher_stops_what_its_command_left_behind(rig):
    runner, add, wait_for, ws = rig
    add("job-00000000000000a3", wait=0)  # the command ends at once; its worker would sleep on
    job = wait_for("job-00000000000000a3", lambda j: j.status not in ("queued", "running"))
    worker = int((ws / "jobs" / job.id / "worker.pid").read_text())
    assert job.status == "succeeded" and proc_start_time(worker) is None
    assert json.loads((ws / "jobs" / job.id / "exit.json").read_text())["strays"] == 1


def test_a_job_past_its_memory_bound_is_stopped_with_the_reason(rig):
    runner, add, wait_for, ws = rig
    add("job-00000000000000a4", mb=400)  # its bound (--max-memory-gb) is 0.25 GiB
    job = wait_for("job-00000000000000a4", lambda j: j.status not in ("queued", "running"))
    assert job.status == "failed", job
    assert job.error.startswith("stopped by the server: its processes held"), job.error
    assert "more than the 0.2 GiB one job may use (--max-memory-gb)" in job.error
    assert procs.processes_of(job.id) == []


def test_the_queue_starts_what_fits(rig, monkeypatch):
    runner, add, _, _ = rig
    started: list[str] = []

    def launch(job, ask):
        runner.store.update(job.id, status="running")
        started.append(job.id)
        return True

    monkeypatch.setattr(runner, "_launch", launch)
    two = Ask(2, 1, GIB // 10)
    add("job-00000000000000b1", "alice", ask=two)
    add("job-00000000000000b2", "alice", ask=two)  # alice is at her 2 processes: waits...
    add("job-00000000000000b3", "bob", ask=two)  # ... and bob passes her
    add("job-00000000000000b4", "carol", ask=two)  # the total (4) is reached: waits, and so does
    add("job-00000000000000b5", "dave", ask=Ask(1, 1, GIB // 10))  # the next, though it would fit (FIFO)
    runner._start_queued()
    assert started == ["job-00000000000000b1", "job-00000000000000b3"]
    runner.store.update("job-00000000000000b1", status="succeeded")
    runner._start_queued()
    assert started[2:] == ["job-00000000000000b2"]  # alice's next, first in line again
