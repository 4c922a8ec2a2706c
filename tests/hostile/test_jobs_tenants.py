"""Two users on one job server: the second user's every path-typed key (config/paths.py, so a new key is
tried too) aimed at the workspace as a whole, the jobs dir, the first user's job (directly, through a
link, through a dir holding a link), the server's own files, '.', '' and '~' is refused or confined to
the second user's own job. Over-asking jobs (processes, threads, memory) are refused with 422 and never
queued; YAML the loader cannot build is a 422 naming the line. The app runs in-process without its
runner: nothing trains."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from conftest import TINY

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from lmforge.config import load_config  # noqa: E402
from lmforge.config.paths import OUTPUT, PATH_KEYS, path_values  # noqa: E402
from lmforge.jobserver.app import create_app  # noqa: E402
from lmforge.jobserver.auth import create_token  # noqa: E402
from lmforge.jobserver.limits import Limits  # noqa: E402
from lmforge.jobserver.store import Store  # noqa: E402


@pytest.fixture
def server(tmp_path):
    """(workspace, client(user), alice's job id, its dir) with alice's job holding a 'secret' file."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "corpus.txt").write_text("shared text\n")
    clients = []

    def client(user: str) -> TestClient:
        store = Store(ws)
        token = create_token(store, user)
        store.close()
        c = TestClient(create_app(ws, start_runner=False, jobs_per_minute=0),
                       headers={"Authorization": f"Bearer {token}"})
        c.__enter__()
        clients.append(c)
        return c

    alice = client("alice")
    r = alice.post("/v1/jobs", json={"config": tiny()})
    assert r.status_code == 201, r.text
    a = r.json()["id"]
    (ws / "jobs" / a / "run").mkdir()
    (ws / "jobs" / a / "run" / "secret.jsonl").write_text('{"text": "alice only"}\n')
    os.symlink(ws / "jobs" / a, ws / "to_alice")  # a link straight into her job
    (ws / "shared").mkdir()
    (ws / "shared" / "ok.txt").write_text("fine\n")
    os.symlink(ws / "jobs" / a / "run", ws / "shared" / "more")  # a readable dir hiding a link into it
    yield ws, client, a
    for c in clients:
        c.__exit__(None, None, None)


def tiny() -> dict:
    cfg = yaml.safe_load(TINY.read_text())
    cfg["data"]["sources"] = ["corpus.txt"]
    return cfg


def naming(key: str, value: str) -> dict:
    """tiny() with `key` naming `value` (in a list for a list key, in a step for a curate step's key)."""
    cfg = tiny()
    if key.startswith("curate.steps."):
        leaf = key.rsplit(".", 1)[1]
        step = {"blocklist_files": "harmful", "eval_files": "decontaminate"}[leaf]
        cfg["curate"] = {"steps": [{"step": step, leaf: [value]}]}
        return cfg
    if key == "data.sources.path":  # a weighted mixture entry (config/data.py)
        cfg["data"]["sources"] = [{"path": value, "weight": 1.0}]
        return cfg
    if key == "logging.mlflow.tracking_uri":
        value = "file:" + value
    if key == "rl.reward_model":
        cfg["rl"] = {"rewards": {"reward_model": 1.0}}
    *parents, leaf = key.split(".")
    node = cfg
    for k in parents:
        node = node.setdefault(k, {})
    lists = {"sources", "val_sources", "eval_tasks", "data", "val_data", "inputs"}
    node[leaf] = [value] if leaf in lists else value
    return cfg


def harmless(ws: Path, job: str, p: Path, role: str) -> bool:
    """Where a value of bob's job may point: inside his own job's dir (an output must), or, for an input,
    somewhere in the workspace that is not its whole, jobs/, a job of another or the server's files."""
    ws, own = ws.resolve(), (ws / "jobs" / job).resolve()
    if p == own or own in p.parents:
        return True
    if role == OUTPUT or ws not in p.parents:
        return False
    top = p.relative_to(ws).parts[0]
    return top != "jobs" and not top.startswith("server.")


HOSTILE = [".", "", "./", "..", "{ws}", "{ws}/", "jobs", "jobs/", "jobs/{a}", "jobs/{a}/run/secret.jsonl",
           "to_alice", "to_alice/run", "shared", "server.db", "server.db-wal", "server.lock", "~", "/",
           "builtin:/../..", "builtin:/../jobs/{a}", "hf:jobs/{a}", "file:jobs/{a}"]


@pytest.mark.parametrize("key", sorted(k for k in PATH_KEYS if k != "run.dir"))
def test_the_second_user_reaches_nothing_of_the_first_nor_of_the_server(server, key):
    ws, client, a = server
    bob = client("bob")
    for raw in HOSTILE:
        value = raw.format(ws=ws, a=a)
        r = bob.post("/v1/jobs", json={"config": naming(key, value)})
        if r.status_code == 422:
            err = r.json()["error"]
            assert err["code"] in ("path_not_allowed", "invalid_config"), (key, value, r.text)
            if err["code"] == "invalid_config":  # the schema refused the value itself (an empty template)
                assert key in err["message"], (key, value, r.text)
            continue
        assert r.status_code == 201, (key, value, r.text)
        # Accepted: then confined, as the config the job will run holds it (resolved, absolute).
        job = r.json()["id"]
        cfg = load_config(ws / "jobs" / job / "config.yaml")
        got = [p for k, p in path_values(cfg) if k == key]
        assert got, (key, value)
        for p in got:
            assert p.is_absolute() and harmless(ws, job, Path(os.path.realpath(p)), PATH_KEYS[key].role), \
                (key, value, p)
    assert (ws / "jobs" / a / "run" / "secret.jsonl").read_text() == '{"text": "alice only"}\n'


def test_readable_data_is_still_readable(server):
    """The rules refuse what they must and no more: shared data, a linked file inside the workspace, the
    user's own earlier job."""
    ws, client, a = server
    (ws / "shared" / "more").unlink()
    os.symlink(ws / "corpus.txt", ws / "shared" / "alias.txt")
    bob = client("bob")
    for sources in (["corpus.txt"], ["shared"], [str(ws / "shared" / "alias.txt")]):
        r = bob.post("/v1/jobs", json={"config": {**tiny(), "data": {**tiny()["data"], "sources": sources}}})
        assert r.status_code == 201, (sources, r.text)
    own = r.json()["id"]
    (ws / "jobs" / own / "run").mkdir()
    r = bob.post("/v1/jobs", json={"config": naming("model.init_from", f"jobs/{own}/run")})
    assert r.status_code == 201, r.text
    r = bob.post("/v1/jobs", json={"config": naming("data.dir", "prepared")})  # a relative output: own job
    cfg = yaml.safe_load((ws / "jobs" / r.json()["id"] / "config.yaml").read_text())
    assert cfg["data"]["dir"] == str((ws / "jobs" / r.json()["id"] / "prepared").resolve())


def test_a_refusal_names_the_key_and_why(server):
    ws, client, a = server
    bob = client("bob")
    for value, why in ((".", "the server's workspace as a whole"), ("jobs", "the dir of every user's jobs"),
                       ("shared", "holds a link more to"), ("server.lock", "one of the server's own files"),
                       ("to_alice", "another job's directory that is not yours"), ("", "an empty path")):
        r = bob.post("/v1/jobs", json={"config": naming("sft.data", value)})
        err = r.json()["error"]
        assert r.status_code == 422 and err["param"] == "sft.data" and why in err["message"], (value, r.text)
        assert str(ws / "jobs" / a / "run" / "secret") not in err["message"]
    assert bob.get("/v1/jobs").json()["data"] == []
    assert sorted(p.name for p in (ws / "jobs").iterdir()) == [a]  # nothing of a refused job remains


def over(limits: Limits, **changes) -> dict:
    cfg = tiny()
    for dotted, v in changes.items():
        section, leaf = dotted.split("__")
        cfg.setdefault(section, {})[leaf] = v
    return cfg


@pytest.fixture
def bounded(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "corpus.txt").write_text("text\n")
    store = Store(ws)
    token = create_token(store, "alice")
    store.close()
    limits = Limits.for_machine(max_procs_per_job=2, max_threads_per_job=4, max_memory_gb=2.0,
                                max_procs=4, max_memory_gb_total=4.0)
    with TestClient(create_app(ws, start_runner=False, limits=limits),
                    headers={"Authorization": f"Bearer {token}"}) as c:
        yield ws, c, limits


@pytest.mark.parametrize("body,param,text", [
    ({"nproc": 64}, "nproc", "at most 2 for one job (--max-procs-per-job)"),
    ({"set": ["parallel.tp=4"]}, "nproc", "the job needs 4 processes"),
    ({"set": ["train.threads=64"]}, "train.threads", "64 threads"),
    ({"set": ["parallel.dp_replicate=2", "train.threads=3"]}, "train.threads", "2 process(es) x 3 threads"),
    ({"set": ["model.d_model=4096", "model.n_layers=32", "model.n_heads=32"]}, "model", "--max-memory-gb"),
])
def test_an_over_asking_job_is_refused_and_never_queued(bounded, body, param, text):
    ws, c, _ = bounded
    r = c.post("/v1/jobs", json={"config": tiny(), **body})
    err = r.json()["error"]
    assert r.status_code == 422 and err["code"] == "over_limit" and err["param"] == param, r.text
    assert text in err["message"], err["message"]
    assert c.get("/v1/jobs").json()["data"] == [] and list((ws / "jobs").iterdir()) == []


def test_a_job_within_bounds_records_what_it_asked(bounded):
    ws, c, limits = bounded
    r = c.post("/v1/jobs", json={"config": tiny(), "set": ["parallel.dp_replicate=2", "train.threads=null"]})
    assert r.status_code == 201, r.text
    res = r.json()["resources"]  # unset train.threads: the job's share of its thread bound per process
    assert res["procs"] == 2 and res["threads"] == limits.max_threads_per_job // 2, res
    assert 1.0 <= res["memory_gb"] < 2, res  # two processes' base and the tiny model's weights
    assert c.post("/v1/jobs", json={"config": tiny()}).json()["resources"]["threads"] == 1  # tiny's own
    r = c.post("/v1/jobs", json={"config": tiny(), "nproc": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "nproc"


@pytest.mark.parametrize("text,line,what", [
    ("run: !!python/object/apply:os.system ['echo pwned']\n", 1, "could not determine a constructor"),
    ("run:\n  name: !!python/name:os.system\n", 2, "could not determine a constructor"),
    ("run:\n  name: 2001-02-30\n", 2, "day is out of range"),
    ("run: " + "[" * 5000 + "]" * 5000 + "\n", 1, "nest too deep (more than 64 levels"),
    ("".join(" " * i + "a:\n" for i in range(1200)), None, "nests too deep to read"),
    ("a: &x [1]\nb: *x\n", 2, "aliases"),
])
def test_yaml_the_loader_cannot_build_is_a_422_with_its_line(bounded, text, line, what):
    ws, c, _ = bounded
    for r in (c.post("/v1/jobs", json={"config": text}),
              c.post("/v1/jobs", content=text.encode(), headers={"Content-Type": "application/yaml"})):
        err = r.json()["error"]
        assert r.status_code == 422 and err["code"] == "invalid_config", r.text
        assert what in err["message"] and (line is None or err["message"].startswith(f"config:{line}:")), \
            err["message"]
    assert not (ws / "PWNED").exists() and c.get("/v1/jobs").json()["data"] == []


@pytest.mark.parametrize("body,status", [
    ({"config": 'run: {name: "\\ud800"}\n'}, 400),  # a lone surrogate from YAML's escape
    (b'{"config": {"run": {"name": "\\ud800"}}}', 400),  # ... and from JSON's
    ({"config": "train: {max_steps: 99999999999999999999999999}\n"}, 422),  # past a 64-bit row
    ({"config": {"data": {"sources": ["a" * 5000]}}}, 422),  # a name too long for the file system
    ({"config": {"data": {"sources": ["/" + "a/" * 3000]}}}, 422),
    ({"config": {"run": {"name": "x"}}, "set": ["data.sources=[" + "[" * 100 + "]"]}, 422),
])
def test_odd_requests_are_refused_without_a_trace(bounded, body, status):
    ws, c, _ = bounded
    c2 = TestClient(c.app, raise_server_exceptions=False, headers=c.headers)
    r = c2.post("/v1/jobs", content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert list((ws / "jobs").iterdir()) == []  # no job dir of a refused job


def test_a_link_made_while_a_job_queues_is_refused_when_it_starts(server):
    """The paths are checked again when the job is to start: a dir that was fine when the job was accepted
    and has since become a link into another user's job fails the job, and nothing is launched."""
    from lmforge.jobserver.runner import Runner

    ws, client, a = server
    (ws / "mine").mkdir()
    (ws / "mine" / "text.txt").write_text("my own text\n")
    cfg = tiny()
    cfg["data"]["sources"] = ["mine"]
    r = client("bob").post("/v1/jobs", json={"config": cfg})
    assert r.status_code == 201, r.text
    b = r.json()["id"]
    (ws / "mine" / "text.txt").unlink()
    (ws / "mine").rmdir()
    os.symlink(ws / "jobs" / a / "run", ws / "mine")
    store = Store(ws)
    try:
        store.update(a, status="failed")  # only bob's job is queued
        runner = Runner(store, ws, 1, limits=Limits.for_machine())
        create_app(ws, start_runner=False, runner=runner)  # the app hands the runner its path rules
        runner._start_queued()
        job = store.get(b)
        assert job.status == "failed" and job.pid is None
        assert job.error.startswith("refused when it was to start: ") and "data.sources" in job.error
    finally:
        store.close()
