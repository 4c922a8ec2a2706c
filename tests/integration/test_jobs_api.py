"""`lmforge jobs` on localhost through httpx: the tiny recipe submitted as a job runs, streams its
metrics over SSE and succeeds; a cancelled job saves a checkpoint and, resumed, ends with the losses
of an uninterrupted run; eval / generate / export jobs on it; tokens and ownership (401 / 404); and a
server SIGKILLed mid-run loses no job (a live one is re-attached, a dead one is interrupted and
resumable, a queued one starts)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import CORPUS, TINY
from lmforge.config import load_config
from lmforge.data import prepare
from lmforge.metrics.loggers import read_metrics

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from lmforge.jobserver.runner import proc_start_time  # noqa: E402
from lmforge.jobserver.server import server_process  # noqa: E402
from lmforge.jobserver.store import Store  # noqa: E402


def make_token(ws: Path, user: str) -> str:
    cmd = [sys.executable, "-m", "lmforge", "jobs", "token", "create", "--workspace", str(ws),
           "--user", user]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A workspace with the tiny corpus prepared once in ws/data (jobs share it; the corpus itself stays
    in the repo, reachable through --allow-root)."""
    ws = tmp_path_factory.mktemp("jobs_ws")
    prepare(load_config(TINY, [f"run.dir={ws / 'prep'}", f"data.dir={ws / 'data'}",
                               f"data.sources=[{CORPUS}]", "data.max_chars=null", "logging.progress=none"]),
            console=lambda m: None)
    return ws


def tiny_yaml(ws: Path, **train) -> str:
    """configs/debug/tiny.yaml pointed at the prepared data, as YAML text (what a user would post)."""
    cfg = yaml.safe_load(TINY.read_text())
    cfg["data"].update({"sources": [str(CORPUS)], "dir": str(ws / "data"), "max_chars": None})
    cfg["logging"]["progress"] = "none"
    cfg["train"].update(train)
    return yaml.safe_dump(cfg)


@pytest.fixture(scope="module")
def server(ws):
    with server_process(ws, "--max-running", "2", "--allow-root", str(CORPUS.parent)) as srv:
        yield srv


@pytest.fixture(scope="module")
def alice(ws, server):
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {make_token(ws, 'alice')}"},
                        timeout=60)


def wait_for(client, job_id: str, pred, timeout: float = 90.0, every: float = 0.05) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if pred(job):
            return job
        assert time.monotonic() < deadline, f"timed out; job is {job}"
        time.sleep(every)


def ended(job: dict) -> bool:
    return job["status"] in ("succeeded", "failed", "cancelled", "interrupted")


def losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(path) if "loss" in r]


def sse(client, job_id: str) -> list[tuple[str, dict]]:
    """Every event of a job's stream until its `end`."""
    out, event = [], None
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                out.append((event, json.loads(line[6:])))
                if event == "end":
                    break
    return out


@pytest.fixture(scope="module")
def finished(ws, alice):
    """One train job run to the end (20 steps), with the events it streamed."""
    r = alice.post("/v1/jobs", json={"config": tiny_yaml(ws, max_steps=20), "name": "tiny"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] in ("queued", "running") and job["max_steps"] == 20
    assert job["object"] == "lmforge.job"
    return job["id"], sse(alice, job["id"])


def test_train_job_streams_metrics_and_succeeds(ws, alice, finished):
    job_id, events = finished
    statuses = [d["status"] for e, d in events if e == "status"]
    assert statuses[0] in ("queued", "running") and "running" in statuses and statuses[-1] == "succeeded"
    assert events[-1] == ("end", {"id": job_id, "status": "succeeded"})
    streamed = [(d["step"], d["loss"]) for e, d in events if e == "metrics" and "loss" in d]
    run = ws / "jobs" / job_id / "run"
    assert streamed == losses(run / "metrics.jsonl") and [s for s, _ in streamed] == list(range(1, 21))
    job = alice.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["step"] == 20 and job["progress"] == 1.0
    assert job["metrics"]["loss"] == streamed[-1][1] and job["exit_code"] == 0 and job["error"] is None
    assert job["finished_at"] >= job["started_at"] >= job["created_at"]
    # Artifacts: the run's files, downloadable; the resolved config runs in the job's own dir.
    names = {a["name"] for a in alice.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]}
    assert {"metrics.jsonl", "curves.png", "config.yaml", "stdout.log", "stderr.log"} <= names
    assert not any(n.startswith("checkpoints") for n in names)
    body = alice.get(f"/v1/jobs/{job_id}/artifacts/metrics.jsonl")
    assert body.status_code == 200 and body.content == (run / "metrics.jsonl").read_bytes()
    cfg = yaml.safe_load(alice.get(f"/v1/jobs/{job_id}/artifacts/config.yaml").text)
    assert cfg["run"]["dir"] == str((ws / "jobs" / job_id / "run").resolve())
    assert alice.get(f"/v1/jobs/{job_id}/artifacts/curves.png").content[:4] == b"\x89PNG"
    page = alice.get("/v1/jobs", params={"status": "succeeded"}).json()
    assert page["object"] == "list" and job_id in [j["id"] for j in page["data"]]


@pytest.mark.slow  # 22 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_cancel_then_resume_equals_uninterrupted(ws, alice):
    steps = dict(max_steps=80, eval_every=40)
    straight = alice.post("/v1/jobs", json={"config": tiny_yaml(ws, **steps)}).json()["id"]
    cut = alice.post("/v1/jobs", json={"config": tiny_yaml(ws, **steps)}).json()["id"]
    job = wait_for(alice, cut, lambda j: (j["step"] or 0) >= 5 or ended(j))
    assert job["status"] == "running" and job["eta_seconds"] > 0 and job["tokens_per_s"] > 0, job
    assert job["progress"] == job["step"] / 80
    r = alice.post(f"/v1/jobs/{cut}/cancel")
    assert r.status_code == 200, r.text
    job = wait_for(alice, cut, ended)
    assert job["status"] == "cancelled" and job["resumable"], job
    ckpts = sorted(p.name for p in (ws / "jobs" / cut / "run" / "checkpoints").iterdir())
    stopped = int(ckpts[-1].split("_")[1])
    assert 5 <= stopped < 80 and job["step"] == stopped  # saved at the step boundary where it stopped
    assert alice.post(f"/v1/jobs/{cut}/cancel").status_code == 409  # already ended
    r = alice.post(f"/v1/jobs/{cut}/resume")
    assert r.status_code == 200 and r.json()["status"] in ("queued", "running"), r.text
    assert wait_for(alice, cut, ended)["status"] == "succeeded"
    assert wait_for(alice, straight, ended)["status"] == "succeeded"
    assert alice.get(f"/v1/jobs/{cut}").json()["attempts"] == 2
    a = losses(ws / "jobs" / cut / "run" / "metrics.jsonl")
    b = losses(ws / "jobs" / straight / "run" / "metrics.jsonl")
    assert [s for s, _ in a] == list(range(1, 81)) and a == b


def test_eval_generate_export_jobs_on_a_finished_run(ws, alice, finished):
    job_id, _ = finished
    ids = {}
    gen = {"prompt": "def main():", "set": ["generate.max_new_tokens=8", "generate.temperature=0"]}
    for kind, extra in (("export", {}), ("generate", gen), ("eval", {"set": ["eval.max_batches=2"]})):
        r = alice.post("/v1/jobs", json={"kind": kind, "source": job_id, **extra})
        assert r.status_code == 201, r.text
        ids[kind] = r.json()["id"]
    for kind, i in ids.items():
        job = wait_for(alice, i, ended, timeout=120)
        assert job["status"] == "succeeded" and job["source"] == job_id, (kind, job, alice.get(
            f"/v1/jobs/{i}/logs").json())
    z = zipfile.ZipFile(io.BytesIO(alice.get(f"/v1/jobs/{ids['export']}/artifacts/export.zip").content))
    assert {"export/config.json", "export/model.safetensors"} <= set(z.namelist())
    out = alice.get(f"/v1/jobs/{ids['generate']}/logs", params={"stream": "stdout"}).json()["stdout"]
    assert "def main():" in "\n".join(out)
    names = {a["name"] for a in alice.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]}
    assert any(n.startswith("eval_val_step_00000020") for n in names)  # the eval report lands in the run
    # Overrides of eval / generate jobs stay in their sections; a source must be a train job of yours.
    bad = alice.post("/v1/jobs", json={"kind": "eval", "source": job_id, "set": ["data.dir=/tmp"]})
    assert bad.status_code == 422 and "eval.* and generate.*" in bad.json()["error"]["message"]


def test_tokens_and_ownership(ws, server, alice, finished):
    job_id, _ = finished
    anon = httpx.Client(base_url=server.url, timeout=30)
    assert anon.get("/health").json() == {"status": "ok"}
    for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", f"/v1/jobs/{job_id}"),
                         ("GET", f"/v1/jobs/{job_id}/events"), ("POST", f"/v1/jobs/{job_id}/cancel"),
                         ("GET", f"/v1/jobs/{job_id}/artifacts/metrics.jsonl")):
        r = anon.request(method, path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.text)
        bad = anon.request(method, path, headers={"Authorization": "Bearer lmf_000000000000_" + "x" * 43})
        assert bad.status_code == 401
    bob = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {make_token(ws, 'bob')}"},
                       timeout=30)
    for method, path in (("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/events"),
                         ("POST", f"/v1/jobs/{job_id}/cancel"), ("POST", f"/v1/jobs/{job_id}/resume"),
                         ("DELETE", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/artifacts"),
                         ("GET", f"/v1/jobs/{job_id}/artifacts/metrics.jsonl"),
                         ("GET", f"/v1/jobs/{job_id}/logs")):
        r = bob.request(method, path)
        missing = bob.request(method, path.replace(job_id, "job-0123456789abcdef"))
        assert r.status_code == 404 and r.json()["error"]["message"] == missing.json()["error"][
            "message"].replace("job-0123456789abcdef", job_id), (path, r.text)
    assert bob.get("/v1/jobs").json()["data"] == []
    r = bob.post("/v1/jobs", json={"kind": "export", "source": job_id})
    assert r.status_code == 404  # alice's run is not bob's source either
    # A revoked token stops working at once.
    tok = make_token(ws, "carol")
    carol = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok}"}, timeout=30)
    assert carol.get("/v1/jobs").status_code == 200
    subprocess.run([sys.executable, "-m", "lmforge", "jobs", "token", "revoke", "--workspace", str(ws),
                    tok.split("_")[1]], check=True, capture_output=True)
    assert carol.get("/v1/jobs").status_code == 401


def test_config_errors_are_422_with_key_and_line(ws, alice):
    text = tiny_yaml(ws, max_steps=20).replace("max_steps: 20", "max_steps: -3")
    line = text.splitlines().index("  max_steps: -3") + 1
    r = alice.post("/v1/jobs", json={"config": text})
    err = r.json()["error"]
    assert r.status_code == 422 and err["param"] == "train.max_steps" and err["code"] == "invalid_config"
    assert f"config:{line}: key 'train.max_steps': bad value -3" in err["message"]
    r = alice.post("/v1/jobs", content=text.replace("max_steps: -3", "max_stepz: 3"),
                   headers={"Content-Type": "application/yaml"})
    assert r.status_code == 422
    assert f"config:{line}: unknown key 'train.max_stepz'" in r.json()["error"]["message"]
    assert "did you mean 'max_steps'" in r.json()["error"]["message"]
    r = alice.post("/v1/jobs", json={"config": tiny_yaml(ws), "set": ["optim.lr=fast"]})
    assert r.status_code == 422 and "--set optim.lr" in r.json()["error"]["message"]


@pytest.mark.slow  # 25 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_server_sigkill_loses_no_job(ws, tmp_path):
    """SIGKILL the server with one job running, one whose process then dies too, and one queued: the
    restarted server re-attaches the first (and can cancel it), marks the second interrupted (resumable;
    resumed, it ends as an uninterrupted run does) and starts the third."""
    w = tmp_path / "ws"
    w.mkdir()
    os.symlink(ws / "data", w / "data")
    tok = make_token(w, "alice")
    headers = {"Authorization": f"Bearer {tok}"}
    endless, short = tiny_yaml(w, max_steps=100_000, eval_every=0), tiny_yaml(w, max_steps=40, eval_every=0)
    root = ("--allow-root", str(CORPUS.parent), "--allow-root", str(ws / "data"))
    with server_process(w, "--max-running", "2", *root) as srv:
        c = httpx.Client(base_url=srv.url, headers=headers, timeout=30)
        live, dies, queued = (c.post("/v1/jobs", json={"config": t}).json()["id"]
                              for t in (endless, short, short))
        wait_for(c, live, lambda job: (job["step"] or 0) >= 2)
        wait_for(c, dies, lambda job: (job["step"] or 0) >= 12)  # past its checkpoint at step 10
        assert c.get(f"/v1/jobs/{queued}").json()["status"] == "queued"
        store = Store(w)
        launcher = {j: store.get(j).pid for j in (live, dies)}
        store.close()
        srv.proc.kill()
        srv.proc.wait()
        os.killpg(launcher[dies], signal.SIGKILL)  # this one dies with its launcher: no exit status
        assert proc_start_time(launcher[live])  # the other outlived the server
        deadline = time.monotonic() + 10
        while proc_start_time(launcher[dies]) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    with server_process(w, "--max-running", "3", *root) as srv:
        c = httpx.Client(base_url=srv.url, headers=headers, timeout=30)
        got = c.get(f"/v1/jobs/{dies}").json()
        assert got["status"] == "interrupted" and got["resumable"] and "resume" in got["error"]["message"]
        step = c.get(f"/v1/jobs/{live}").json()["step"]
        job = wait_for(c, live, lambda j: (j["step"] or 0) > step + 2)  # re-attached: still training
        assert job["status"] == "running"
        assert c.post(f"/v1/jobs/{live}/cancel").status_code == 200
        job = wait_for(c, live, ended)
        assert job["status"] == "cancelled" and job["resumable"] and job["step"] < 100_000, job
        assert (w / "jobs" / live / "run" / "checkpoints" / f"step_{job['step']:08d}").is_dir()
        assert proc_start_time(launcher[live]) is None
        assert c.post(f"/v1/jobs/{dies}/resume").status_code == 200
        for j in (queued, dies):
            job = wait_for(c, j, ended, timeout=120)
            assert job["status"] == "succeeded" and job["step"] == 40, job
        assert c.get(f"/v1/jobs/{dies}").json()["attempts"] == 2
        a = losses(w / "jobs" / dies / "run" / "metrics.jsonl")
        assert a == losses(w / "jobs" / queued / "run" / "metrics.jsonl")  # resumed exactly
        assert [s for s, _ in a] == list(range(1, 41))
