"""`lmforge jobs --backend ray` against a real one-node Ray cluster (`ray start --head` on localhost): the
tiny recipe runs as a Ray job and succeeds with its metrics; a cancelled one is stopped by Ray with SIGTERM,
saves a checkpoint, and, resumed as a new submission, ends with the losses of an uninterrupted run, even
though the server is SIGKILLed and restarted meanwhile (it re-attaches by submission id).

The cluster is `ray start --head --block` in its own process group, stopped by signalling that process
(it takes down what it started): `ray stop` would stop every Ray on the machine, other users' too."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import CORPUS, TINY
from lmforge.config import load_config
from lmforge.data import prepare
from lmforge.jobserver.ray_backend import connect, ended_state, submission_id
from lmforge.jobserver.store import Job, Store
from lmforge.metrics.loggers import read_metrics

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from lmforge.jobserver.server import free_port, server_process  # noqa: E402

RAY = Path(sys.executable).with_name("ray")


def test_ray_states_map_onto_job_statuses():
    """Pure mapping, no cluster: running states hold the job; an end without exit.json settles it."""
    assert ended_state("PENDING", None, False) is None and ended_state("RUNNING", "x", True) is None
    assert ended_state("STOPPED", "stopped", True) == ("cancelled", None)
    status, err = ended_state("STOPPED", "node died", False)
    assert status == "interrupted" and "node died" in err and "resume" in err
    assert ended_state("FAILED", "runtime_env setup failed", False) == (
        "failed", "Ray job FAILED: runtime_env setup failed")
    status, err = ended_state("SUCCEEDED", None, False)
    assert status == "failed" and "share" in err  # the launcher ran, but not on our workspace
    job = Job(id="job-0123456789abcdef", user="u", kind="train", name="n", status="running", created_at=0,
              queued_at=0, attempts=2)
    assert submission_id(job) == "lmforge-job-0123456789abcdef-2"


def test_unreachable_cluster_is_a_user_error(tmp_path):
    pytest.importorskip("ray.job_submission")
    cmd = [sys.executable, "-m", "lmforge", "jobs", "--workspace", str(tmp_path), "--backend", "ray",
           "--ray-address", f"http://127.0.0.1:{free_port()}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "cannot reach Ray's job server" in out.stderr and "ray start --head" in out.stderr


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster with 2 CPUs; yields its dashboard URL (the Jobs API)."""
    pytest.importorskip("ray.job_submission")
    if not RAY.exists():
        pytest.skip("the `ray` command is not installed beside this Python")
    tmp = tempfile.mkdtemp(prefix="lmfray", dir="/tmp")  # short: Ray's unix socket paths must fit 107 chars
    dash = free_port()
    ports = {"--port": free_port(), "--dashboard-port": dash, "--ray-client-server-port": free_port(),
             "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
             "--runtime-env-agent-port": free_port(), "--metrics-export-port": free_port(),
             "--node-manager-port": free_port(), "--object-manager-port": free_port()}
    cmd = [str(RAY), "start", "--head", "--block", "--num-cpus", "2", "--dashboard-host", "127.0.0.1",
           "--include-dashboard", "true", "--disable-usage-stats", "--temp-dir", tmp,
           *[x for k, v in ports.items() for x in (k, str(v))]]
    log = open(Path(tmp) / "ray_start.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, process_group=0,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (Path(tmp) / "ray_start.log").read_text()[-3000:]
            try:
                connect(url).list_jobs()
                break
            except Exception:  # noqa: BLE001 - not up yet (connection refused, 5xx while modules load)
                assert time.monotonic() < deadline, "Ray's job server did not come up in 120 s"
                time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("ray_ws")
    prepare(load_config(TINY, [f"run.dir={ws / 'prep'}", f"data.dir={ws / 'data'}",
                               f"data.sources=[{CORPUS}]", "data.max_chars=null", "logging.progress=none"]),
            console=lambda m: None)
    return ws


def tiny_yaml(ws: Path, **train) -> str:
    cfg = yaml.safe_load(TINY.read_text())
    cfg["data"].update({"sources": [str(CORPUS)], "dir": str(ws / "data"), "max_chars": None})
    cfg["logging"]["progress"] = "none"
    cfg["train"].update(train)
    return yaml.safe_dump(cfg)


def token(ws: Path) -> dict[str, str]:
    cmd = [sys.executable, "-m", "lmforge", "jobs", "token", "create", "--workspace", str(ws),
           "--user", "ann"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {"Authorization": f"Bearer {out.stdout.strip()}"}


def wait_for(client, job_id: str, pred, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if pred(job):
            return job
        assert time.monotonic() < deadline, f"timed out; job is {job}"
        time.sleep(0.1)


def ended(job: dict) -> bool:
    return job["status"] in ("succeeded", "failed", "cancelled", "interrupted")


def losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(path) if "loss" in r]


def ray_status(url: str, sid: str) -> str:
    return str(connect(url).get_job_status(sid))


def serve(ws: Path, url: str):
    return server_process(ws, "--backend", "ray", "--ray-address", url, "--max-running", "2",
                          "--allow-root", str(CORPUS.parent))


@pytest.mark.slow
def test_train_job_runs_on_ray(cluster, ws):
    headers = token(ws)
    with serve(ws, cluster) as srv:
        c = httpx.Client(base_url=srv.url, headers=headers, timeout=60)
        r = c.post("/v1/jobs", json={"config": tiny_yaml(ws, max_steps=20)})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        job = wait_for(c, job_id, ended)
        assert job["status"] == "succeeded" and job["step"] == 20 and job["exit_code"] == 0, (
            job, c.get(f"/v1/jobs/{job_id}/logs").json())
        run = ws / "jobs" / job_id / "run"
        got = losses(run / "metrics.jsonl")
        assert [s for s, _ in got] == list(range(1, 21)) and job["metrics"]["loss"] == got[-1][1]
        assert ray_status(cluster, f"lmforge-{job_id}-1") == "SUCCEEDED"  # it ran as a Ray job
        store = Store(ws)
        assert store.get(job_id).pid is None  # no process of this machine's server: Ray's
        store.close()
        assert (ws / "jobs" / job_id / "stdout.log").is_file()  # the launcher's logs, served as locally
        assert c.get(f"/v1/jobs/{job_id}/logs").status_code == 200


@pytest.mark.slow
def test_cancel_resume_and_reattach_on_ray(cluster, ws):
    """Cancel (Ray's stop_job -> SIGTERM -> checkpoint), resume (a new submission), SIGKILL the server while
    the resumed job runs, restart it: the job is re-attached by its submission id and ends as an
    uninterrupted run does."""
    headers = token(ws)
    steps = dict(max_steps=60, eval_every=0)
    with serve(ws, cluster) as srv:
        c = httpx.Client(base_url=srv.url, headers=headers, timeout=60)
        straight = c.post("/v1/jobs", json={"config": tiny_yaml(ws, **steps)}).json()["id"]
        cut = c.post("/v1/jobs", json={"config": tiny_yaml(ws, **steps)}).json()["id"]
        wait_for(c, cut, lambda j: (j["step"] or 0) >= 5 or ended(j))
        assert c.post(f"/v1/jobs/{cut}/cancel").status_code == 200
        job = wait_for(c, cut, ended)
        assert job["status"] == "cancelled" and job["resumable"], job
        assert ray_status(cluster, f"lmforge-{cut}-1") == "STOPPED"
        d = ws / "jobs" / cut
        info = json.loads((d / "exit.json").read_text())
        assert info["signals"] == [signal.SIGTERM]  # Ray's SIGTERM reached the launcher, not a SIGKILL
        stopped = int(sorted(p.name for p in (d / "run" / "checkpoints").iterdir())[-1].split("_")[1])
        assert 5 <= stopped < 60 and job["step"] == stopped  # saved where it stopped
        assert c.post(f"/v1/jobs/{cut}/resume").status_code == 200
        wait_for(c, cut, lambda j: j["status"] == "running" and (j["step"] or 0) > stopped)
        srv.proc.kill()
        srv.proc.wait()
    assert ray_status(cluster, f"lmforge-{cut}-2") in ("RUNNING", "SUCCEEDED")  # the job outlived the server
    with serve(ws, cluster) as srv:
        c = httpx.Client(base_url=srv.url, headers=headers, timeout=60)
        for j in (cut, straight):
            job = wait_for(c, j, ended)
            assert job["status"] == "succeeded" and job["step"] == 60, job
        assert c.get(f"/v1/jobs/{cut}").json()["attempts"] == 2
        assert ray_status(cluster, f"lmforge-{cut}-2") == "SUCCEEDED"
    a = losses(ws / "jobs" / cut / "run" / "metrics.jsonl")
    assert [s for s, _ in a] == list(range(1, 61)) and a == losses(ws / "jobs" / straight / "run" /
                                                                    "metrics.jsonl")
