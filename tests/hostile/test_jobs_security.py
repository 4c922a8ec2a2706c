"""The job server against hostile requests: tokens (hashed, constant-time, revocable), other users' jobs
(404, not 403), paths in configs (run.dir forced, data / init_from / teacher... confined after symlinks),
names (job ids, artifact names, links out of a run dir), body size and job-creation rate limits. The app
runs in-process without its runner: jobs stay queued and nothing trains."""

from __future__ import annotations

import os
import sqlite3

import pytest
import yaml

from conftest import TINY

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from lmforge.jobserver.app import create_app  # noqa: E402
from lmforge.jobserver.auth import RateLimiter, create_token  # noqa: E402
from lmforge.jobserver.store import Store  # noqa: E402


@pytest.fixture
def env(tmp_path):
    """(workspace, outside dir, client factory(user, **app options))."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (ws / "corpus.txt").write_text("some text\n")
    (outside / "secret.txt").write_text("secret\n")
    clients = []

    def client(user: str = "alice", **opts) -> TestClient:
        store = Store(ws)
        token = create_token(store, user)
        store.close()
        c = TestClient(create_app(ws, start_runner=False, **opts),
                       headers={"Authorization": f"Bearer {token}"})
        c.__enter__()
        clients.append(c)
        return c

    yield ws, outside, client
    for c in clients:
        c.__exit__(None, None, None)


def tiny(**sections) -> dict:
    cfg = yaml.safe_load(TINY.read_text())
    cfg["data"]["sources"] = ["corpus.txt"]
    for key, value in sections.items():
        section, leaf = key.split("__")
        cfg.setdefault(section, {})[leaf] = value
    return cfg


def post(c: TestClient, cfg: dict, **extra):
    return c.post("/v1/jobs", json={"config": cfg, **extra})


def test_tokens_are_hashed_and_checked(env):
    ws, _, client = env
    c = client("alice")
    token = c.headers["Authorization"][7:]
    db = (ws / "server.db").read_bytes() + b"".join(p.read_bytes() for p in ws.glob("server.db-*"))
    _, tid, secret = token.split("_", 2)  # the secret is base64url: it may hold "_" itself
    assert secret.encode() not in db  # only the hash is stored
    assert oct((ws / "server.db").stat().st_mode & 0o777) == "0o600"
    assert c.get("/v1/jobs").status_code == 200
    for bad in (f"lmf_{tid}_{secret[:-1]}A" if secret[-1] != "A" else f"lmf_{tid}_{secret[:-1]}B",
                f"lmf_{tid}_{secret}x", token.upper(), "", "lmf_", f"Basic {token}"):
        header = bad if bad.startswith("Basic") else f"Bearer {bad}"
        r = c.get("/v1/jobs", headers={"Authorization": header})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token", bad
    assert c.get("/health", headers={"Authorization": ""}).status_code == 200


def test_another_users_job_is_not_found(env):
    _, _, client = env
    alice, bob = client("alice"), client("bob")
    job = post(alice, tiny()).json()["id"]
    assert alice.get(f"/v1/jobs/{job}").status_code == 200
    for method, path in (("GET", ""), ("POST", "/cancel"), ("POST", "/resume"), ("DELETE", ""),
                         ("GET", "/logs"), ("GET", "/artifacts"), ("GET", "/events")):
        r = bob.request(method, f"/v1/jobs/{job}{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", (path, r.text)
    assert bob.get("/v1/jobs").json()["data"] == []
    assert bob.get("/v1/jobs", params={"after": job}).status_code == 404
    assert alice.post(f"/v1/jobs/{job}/cancel").json()["status"] == "cancelled"  # queued: at once


@pytest.mark.parametrize("key,value", [
    ("data__sources", ["/etc/passwd"]),
    ("data__sources", ["../outside/secret.txt"]),
    ("data__val_sources", ["~/.ssh"]),
    ("data__dir", "/tmp/elsewhere"),
    ("model__init_from", "../outside"),
    ("distill__teacher", "/"),
    ("sft__data", ["corpus.txt", "/etc/shadow"]),
    ("sft__template", "/etc/passwd.jinja"),
    ("model__init_from", "server.db"),
    ("distill__topk_cache", "server.db-wal"),
    ("logging__wandb", {"dir": "/tmp"}),
    ("logging__mlflow", {"tracking_uri": "file:///tmp/mlruns"}),
    ("logging__mlflow", {"tracking_uri": "http://169.254.169.254/"}),
    ("finetune__init_adapter", "jobs/job-0123456789abcdef"),
    ("train__eval_tasks", ["../outside"]),
])
def test_paths_outside_the_workspace_are_refused(env, key, value):
    _, _, client = env
    c = client()
    r = post(c, tiny(**{key: value}))
    err = r.json()["error"]
    assert r.status_code == 422 and err["code"] == "path_not_allowed", r.text
    assert err["param"].startswith(key.replace("__", ".")), r.text
    assert c.get("/v1/jobs").json()["data"] == []  # nothing was queued


def test_symlinks_are_resolved_before_the_check(env):
    ws, outside, client = env
    c = client()
    os.symlink(outside, ws / "innocent")
    r = post(c, tiny(data__sources=["innocent/secret.txt"]))
    assert r.status_code == 422 and "outside the server's workspace" in r.json()["error"]["message"]


def test_run_dir_is_forced_and_allowed_paths_are_resolved(env):
    ws, outside, client = env
    c = client(allow_roots=(str(outside),))
    sources = ["builtin:python", "corpus.txt", str(outside / "secret.txt")]
    r = post(c, tiny(run__dir="/etc", data__sources=sources))
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    cfg = yaml.safe_load((ws / "jobs" / job / "config.yaml").read_text())
    assert cfg["run"]["dir"] == str(ws.resolve() / "jobs" / job / "run")
    assert cfg["data"]["sources"] == ["builtin:python", str((ws / "corpus.txt").resolve()),
                                      str((outside / "secret.txt").resolve())]


def test_paths_into_own_jobs_only(env):
    ws, _, client = env
    alice, bob = client("alice"), client("bob")
    a = post(alice, tiny()).json()["id"]
    r = post(bob, tiny(model__init_from=f"jobs/{a}/run"))
    assert r.status_code == 422 and "another job" in r.json()["error"]["message"]
    assert post(alice, tiny(model__init_from=f"jobs/{a}/run")).status_code == 201  # her own earlier job


def test_names_cannot_traverse(env):
    ws, outside, client = env
    c = client()
    job = post(c, tiny()).json()["id"]
    run = ws / "jobs" / job / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    os.symlink(outside / "secret.txt", run / "leak.txt")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "w.safetensors").write_bytes(b"w")
    assert c.get(f"/v1/jobs/{job}/artifacts/metrics.jsonl").text == '{"step": 1, "loss": 2.0}\n'
    names = {a["name"] for a in c.get(f"/v1/jobs/{job}/artifacts").json()["data"]}
    assert "metrics.jsonl" in names and "leak.txt" not in names and not any("checkpoints" in n for n in names)
    for name in ("leak.txt", "../../../server.db", "..%2F..%2Fserver.db", "%2e%2e/%2e%2e/server.db",
                 "checkpoints/w.safetensors", ".lock", "/etc/passwd", "a/../../config.yaml"):
        r = c.get(f"/v1/jobs/{job}/artifacts/{name}")
        assert r.status_code in (400, 404) and b"secret" not in r.content, (name, r.status_code)
    for bad_id in ("..", "job-../../server.db", "%2e%2e%2fserver.db", "job-0123"):
        assert c.get(f"/v1/jobs/{bad_id}").status_code == 404
    r = post(c, tiny(), name="../../x")
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"


def test_body_size_limit(env):
    _, _, client = env
    c = client(max_body_bytes=4096)
    r = c.post("/v1/jobs", content=b"{" + b" " * 5000 + b"}", headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(10):
            yield b" " * 1000

    r = c.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_job_creation_is_rate_limited_per_user(env):
    _, _, client = env
    alice = client("alice", jobs_per_minute=1, job_burst=2)
    assert [post(alice, tiny()).status_code for _ in range(2)] == [201, 201]
    r = post(alice, tiny())
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
    assert r.json()["error"]["code"] == "rate_limited"
    limiter = RateLimiter(per_minute=60, burst=1)  # one a second
    assert limiter.take("x") == 0 and 0 < limiter.take("x") <= 1.0 and limiter.take("y") == 0


def test_request_shape_checks(env):
    ws, _, client = env
    c = client()
    assert post(c, tiny(), bogus=1).status_code == 400
    r = c.post("/v1/jobs", json={"config": "a: &x [1]\nb: *x\n"})
    assert r.status_code == 422 and "aliases" in r.json()["error"]["message"]
    r = c.post("/v1/jobs", json={"config": "train: [\n"})
    assert r.status_code == 422 and "invalid YAML" in r.json()["error"]["message"]
    r = post(c, tiny(parallel__tp=2), nproc=3)
    assert r.status_code == 422 and r.json()["error"]["param"] == "nproc"
    for raw in (b"[1, 2]", b"\xff{", b'{"config": ' * 5000):
        r = c.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, raw[:20]
    r = c.post("/v1/jobs", json={"kind": "eval", "source": "job-0123456789abcdef"})
    assert r.status_code == 404
    assert c.get("/v1/jobs", params={"status": "exploded"}).status_code == 400
    # The store holds the jobs as rows; a second app over the same workspace sees the same ones.
    rows = sqlite3.connect(ws / "server.db").execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
    assert rows == 0


def test_process_count_follows_the_parallel_layout(env):
    """torchrun is used when the layout needs several processes; a request's nproc must fit the layout."""
    from lmforge.config import load_config
    from lmforge.jobserver.jobs import RequestError, process_count
    from lmforge.jobserver.runner import launch_argv
    from lmforge.jobserver.store import Job

    def cfg(*sets):
        return load_config(TINY, list(sets))

    assert process_count(cfg(), None) == 1
    assert process_count(cfg("parallel.tp=2", "parallel.dp_shard=2"), None) == 4
    assert process_count(cfg("parallel.dp_replicate=2"), 4) == 4  # dp_shard -1 fills the rest
    for sets, asked in ((("parallel.dp_replicate=2",), 3), (("parallel.tp=2", "parallel.dp_shard=2"), 2)):
        with pytest.raises(RequestError, match="does not fit the parallel layout"):
            process_count(cfg(*sets), asked)
    job = Job(id="job-0123456789abcdef", user="a", kind="train", name="x", status="queued", created_at=0,
              queued_at=0, nproc=4, resume=True, spec={"args": ["train", "-c", "config.yaml"]})
    argv = launch_argv(job)
    assert argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert argv[5:] == ["-m", "lmforge", "train", "-c", "config.yaml", "--resume"]
    job.nproc, job.resume = 1, False
    assert launch_argv(job)[1:] == ["-m", "lmforge", "train", "-c", "config.yaml"]


def test_delete_refuses_an_active_job_and_removes_artifacts_only_when_asked(env):
    ws, _, client = env
    c = client()
    a, b = post(c, tiny()).json()["id"], post(c, tiny()).json()["id"]
    r = c.delete(f"/v1/jobs/{a}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_active"
    for j in (a, b):
        assert c.post(f"/v1/jobs/{j}/cancel").json()["status"] == "cancelled"
    assert c.delete(f"/v1/jobs/{a}").json()["artifacts_deleted"] is False
    assert (ws / "jobs" / a / "config.yaml").is_file() and c.get(f"/v1/jobs/{a}").status_code == 404
    assert c.delete(f"/v1/jobs/{b}", params={"artifacts": "true"}).json()["artifacts_deleted"] is True
    assert not (ws / "jobs" / b).exists()
    # Resuming needs a train job that ended; a cancelled one goes back to the queue.
    c2 = post(c, tiny()).json()["id"]
    assert c.post(f"/v1/jobs/{c2}/resume").status_code == 409  # still queued
    c.post(f"/v1/jobs/{c2}/cancel")
    r = c.post(f"/v1/jobs/{c2}/resume")
    assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["error"] is None
