"""`lmforge serve` with several adapters over one base, through the official `openai` client: a LoRA
run, a DoRA run and (loaded at run time through the admin route) a PEFT dir exported from the LoRA run,
requested concurrently so that they decode in one batch, each reply equal to its merged model's
greedy output; the admin routes' key, root and absence; adapters that do not fit the base refused."""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path

import pytest
import torch

from conftest import CORPUS, TINY, tiny_overrides
from lmforge.config import load_config
from lmforge.errors import LmforgeError
from lmforge.eval.generate import generate
from lmforge.eval.open_run import load_run
from lmforge.export.hf import export_adapter
from lmforge.finetune.lora import merge_lora
from lmforge.serve.engine import SamplingParams
from lmforge.train.trainer import train

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

KEY, ADMIN = "test-key-0123456789", "admin-key-9876543210"
BASE = ("train.max_steps=1", "checkpoint.every=0", "train.eval_every=0", "schedule.warmup_steps=0",
        "model.max_seq_len=128", "model.tie_embeddings=false", "model.init_std=0.1", "train.threads=1")


def _train(root: Path, data: Path, *extra: str) -> Path:
    train(load_config(TINY, tiny_overrides(root, data, *BASE, *extra)))
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_data_dir):
    """A base run (near its random init, untied head: greedy replies differ by prompt), LoRA and DoRA
    runs fine-tuned from it at a large lr (adapters far from zero), and the PEFT export of the LoRA run
    under the adapter root."""
    top = tmp_path_factory.mktemp("multilora")
    base = _train(top / "base", shared_data_dir, "optim.lr=1e-6")
    tuned = ("train.max_steps=3", "optim.lr=3e-2", f"model.init_from={base}", "finetune.r=4",
             "finetune.alpha=8")
    data = top / "data"  # the base's tokenizer: data of its own, prepared once for both
    lora = _train(top / "lora", data, *tuned, "finetune.method=lora")
    dora = _train(top / "dora", data, *tuned, "finetune.method=dora")
    root = top / "root"
    export_adapter(lora, root / "peft", say=lambda *_: None)
    return {"base": base, "lora": lora, "dora": dora, "root": root, "top": top}


@pytest.fixture(scope="module")
def merged(runs):
    out = {}
    for name in ("lora", "dora"):
        run = load_run(runs[name])
        out[name] = merge_lora(copy.deepcopy(run.model)).eval()
    out["base"] = load_run(runs["base"])
    out["peft"] = out["lora"]
    return out


@pytest.fixture(scope="module")
def server(runs):
    from lmforge.serve import start_server

    loras = [("lora", str(runs["lora"])), ("dora", str(runs["dora"]))]
    with start_server(runs["base"], api_keys=[KEY], model_name="base", max_batch_size=8, loras=loras,
                      admin_key=ADMIN, adapter_root=runs["root"], max_adapters=3) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def admin(server, route: str, body: dict, key: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/{route}", json=body, headers=headers, timeout=60)


def want(merged, name: str, prompt: str, n: int) -> str:
    tok = merged["base"].tokenizer
    model = merged["base"].model if name == "base" else merged[name]
    out = generate(model, tok.encode(prompt), n, temperature=0.0, eos_id=[tok.eos_id])[0]
    return tok.decode(out[:-1] if out and out[-1] == tok.eos_id else out)


PROMPTS = ["The quick brown fox", "def main():\n    ", "import os", "Lists are mutable sequences"]


def test_models_list_the_adapters_with_their_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["base", "lora", "dora"]
    assert models["lora"].parent == "base" and models["dora"].parent == "base"
    assert client.models.retrieve("dora").parent == "base"


def test_concurrent_adapters_batch_together_and_equal_the_merged_models(client, server, merged):
    jobs = [(name, p) for p in PROMPTS for name in ("base", "lora", "dora")]
    got: dict[tuple[str, str], str] = {}

    def call(name: str, prompt: str) -> None:
        r = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
        assert r.model == name
        got[name, prompt] = r.choices[0].text

    threads = [threading.Thread(target=call, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(jobs)
    assert server.engine.peak_batch > 3  # rows of different adapters did decode together
    for name, prompt in jobs:
        assert got[name, prompt] == want(merged, name, prompt, 12), (name, prompt)
    assert {got["lora", p] for p in PROMPTS} != {got["base", p] for p in PROMPTS}  # the adapters matter
    with pytest.raises(openai.NotFoundError, match="`base`, `lora`, `dora`"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_streamed_chat_of_an_adapter_equals_its_reply(client):
    messages = [{"role": "user", "content": "Lists are mutable sequences"}]
    whole = client.chat.completions.create(model="dora", messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="dora", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"dora"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    base = client.chat.completions.create(model="base", messages=messages, max_tokens=10, temperature=0)
    assert base.choices[0].message.content != whole.choices[0].message.content


def test_engine_logits_equal_the_merged_models(server, merged):
    """A mixed batch through the engine's forward: the base's rows bit for bit, each adapter's within
    1e-5 of its merged model (fp32)."""

    class Req:
        def __init__(self, adapter):
            self.params = SamplingParams(adapter=adapter)

    engine = server.engine
    ids = torch.tensor([merged["base"].tokenizer.encode("Lists are mutable sequences")[:6]] * 3)
    names = ["base", "lora", "dora"]
    with torch.inference_mode(), engine.adapters._lock:  # the engine thread waits meanwhile
        got = engine._forward([Req(engine.adapters.get(n)) for n in names], ids)
        assert torch.equal(got[0], merged["base"].model(ids[:1])[0])
        for i, name in enumerate(names[1:], 1):
            torch.testing.assert_close(got[i], merged[name](ids[i : i + 1])[0], rtol=0, atol=1e-5)


def test_runtime_load_and_unload(client, server, merged, runs):
    peft = {"lora_name": "peft", "lora_path": "peft/adapter"}
    assert admin(server, "load_lora_adapter", peft, KEY).status_code == 401  # an API key is no admin key
    assert admin(server, "load_lora_adapter", peft, None).status_code == 401
    r = admin(server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(runs["lora"])})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "outside the adapter root" in r.json()["error"]["message"]
    r = admin(server, "load_lora_adapter", {**peft, "load_inplace": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"  # refused, not ignored
    r = admin(server, "load_lora_adapter", peft)
    assert r.status_code == 200 and r.json()["id"] == "peft" and r.json()["kind"] == "lora"
    r = admin(server, "load_lora_adapter", {"lora_name": "more", "lora_path": "peft/adapter"})
    assert r.status_code == 400 and "max_adapters=3" in r.json()["error"]["message"]
    for prompt in PROMPTS[:2]:
        r = client.completions.create(model="peft", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want(merged, "peft", prompt, 12)
    chat = client.chat.completions.create(model="peft", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "peft"
    assert admin(server, "unload_lora_adapter", {"lora_name": "peft"}).status_code == 200
    assert admin(server, "unload_lora_adapter", {"lora_name": "peft"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="peft", prompt="x", max_tokens=2)
    assert [m.id for m in client.models.list().data] == ["base", "lora", "dora"]


def test_hostile_admin_bodies_get_a_400_naming_the_field(server):
    for body, param in (({"lora_name": "../../etc", "lora_path": "peft/adapter"}, "lora_name"),
                        ({"lora_name": "x" * 129, "lora_path": "peft/adapter"}, "lora_name"),
                        ({"lora_name": "base", "lora_path": "peft/adapter"}, "lora_name"),
                        ({"lora_name": "x", "lora_path": "/" + "a" * 5000}, "lora_path"),
                        ({"lora_name": "x", "lora_path": "../../../etc/passwd"}, "lora_path"),
                        ({"lora_name": "x", "lora_path": "nothing/here"}, "lora_path"),
                        ({"lora_name": ["x"], "lora_path": "peft/adapter"}, "lora_name"),
                        ({"lora_path": "peft/adapter"}, "lora_name")):
        r = admin(server, "load_lora_adapter", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(f"{server.url}/load_lora_adapter", content=b"{not json", timeout=30,
                   headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert [m.id for m in openai.OpenAI(base_url=server.url, api_key=KEY).models.list().data] == \
        ["base", "lora", "dora"]


def test_symlink_out_of_the_root_is_refused(server, runs):
    link = runs["root"] / "escape"
    os.symlink(runs["lora"], link)
    try:
        r = admin(server, "load_lora_adapter", {"lora_name": "esc", "lora_path": "escape"})
        assert r.status_code == 400 and "outside the adapter root" in r.json()["error"]["message"]
    finally:
        link.unlink()


def test_without_an_admin_key_the_routes_do_not_exist(runs):
    from lmforge.serve import start_server

    with start_server(runs["base"], api_keys=[KEY], model_name="base") as srv:
        r = admin(srv, "load_lora_adapter", {"lora_name": "peft", "lora_path": "peft/adapter"}, KEY)
        assert r.status_code == 404
        r = admin(srv, "load_lora_adapter", {"lora_name": "peft", "lora_path": "peft/adapter"}, None)
        assert r.status_code == 401  # the API key is still needed to learn that much


def test_adapters_that_do_not_fit_the_base_are_refused(runs, shared_data_dir):
    from lmforge.serve import build_server

    other = _train(runs["top"] / "other", shared_data_dir, "optim.lr=1e-2", "finetune.method=lora")
    with pytest.raises(LmforgeError, match=r"--lora x=.*trained on another base: its .* differs"):
        build_server(runs["base"], port=0, api_keys=None, loras=[("x", str(other))])
    with pytest.raises(LmforgeError, match="carries LoRA adapters of its own"):
        build_server(runs["lora"], port=0, api_keys=None, loras=[("x", str(runs["dora"]))])
    with pytest.raises(LmforgeError, match="--max-adapters"):
        build_server(runs["base"], port=0, api_keys=None, loras=[("a", "x"), ("b", "y")], max_adapters=1)


def test_cli_refuses_half_given_admin_settings(runs, capsys, monkeypatch):
    from lmforge.cli import main

    monkeypatch.delenv("LMFORGE_ADMIN_KEY", raising=False)
    for extra, why in ((["--admin-key", ADMIN], "--adapter-root"), (["--adapter-root", str(runs["root"])],
                       "admin key"), (["--lora", "nameonly"], "NAME=PATH")):
        assert main(["serve", str(runs["base"]), "--api-key", KEY, "--port", "0", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lmforge serve: error:") and why in err and "Traceback" not in err
    assert main(["serve", str(runs["base"]), "--api-key", KEY, "--admin-key", KEY, "--adapter-root",
                 str(runs["root"])]) == 2
    assert "differ from every API key" in capsys.readouterr().err


@pytest.mark.slow  # a train job in a job server child process: ~35 s on 2 cores
def test_job_server_publishes_a_finished_adapter(runs, merged, tmp_path, monkeypatch):
    """End to end: a LoRA train job on `lmforge jobs` (a child process holding the admin key), then
    POST /v1/jobs/{id}/publish loads its adapter into a running `lmforge serve`, whose replies for it
    equal the job's merged model."""
    import subprocess
    import sys

    import yaml

    from lmforge.jobserver.server import server_process
    from lmforge.serve import start_server

    ws = tmp_path / "ws"
    (ws / "jobs").mkdir(parents=True)
    sets = [f"data.sources=[{CORPUS}]", "data.max_chars=null",
            "logging.progress=none", f"model.init_from={runs['base']}", "finetune.method=lora",
            "finetune.r=4", "finetune.alpha=8", "optim.lr=3e-2", *BASE, "train.max_steps=3"]
    with start_server(runs["base"], api_keys=[KEY], model_name="base", admin_key=ADMIN,
                      adapter_root=ws / "jobs") as srv:
        monkeypatch.setenv("LMFORGE_ADMIN_KEY", ADMIN)  # the job server's copy of the admin key
        with server_process(ws, "--allow-root", str(runs["top"]), "--allow-root", str(CORPUS.parent),
                            "--publish-url", srv.url) as js:
            token = subprocess.run([sys.executable, "-m", "lmforge", "jobs", "token", "create",
                                    "--workspace", str(ws), "--user", "alice"], capture_output=True,
                                   text=True, check=True).stdout.strip()
            jobs = httpx.Client(base_url=js.url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
            config = yaml.safe_load(TINY.read_text())
            # The job's config.yaml states every model key: the base's, so that they agree with init_from.
            config["model"] = yaml.safe_load((runs["base"] / "config.yaml").read_text())["model"]
            r = jobs.post("/v1/jobs", json={"config": config, "set": sets, "name": "lora"})
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            r = jobs.post(f"/v1/jobs/{job_id}/publish", json={"server_url": srv.url, "lora_name": "early"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "not_publishable"  # still running
            job = _wait(jobs, job_id)
            assert job["status"] == "succeeded", jobs.get(f"/v1/jobs/{job_id}/logs").json()
            r = jobs.post(f"/v1/jobs/{job_id}/publish", json={"server_url": "http://example.com:1/v1",
                                                              "lora_name": "x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "server_url"
            anonymous = httpx.post(f"{js.url}/v1/jobs/{job_id}/publish", json={"server_url": srv.url})
            assert anonymous.status_code == 401
            r = jobs.post(f"/v1/jobs/{job_id}/publish", json={"server_url": srv.url, "lora_name": "from-job"})
            assert r.status_code == 200, r.text
            assert r.json()["adapter"]["id"] == "from-job" and r.json()["adapter"]["kind"] == "lora"
            r = jobs.post(f"/v1/jobs/{job_id}/publish", json={"server_url": srv.url, "lora_name": "from-job"})
            assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)
        model = merge_lora(copy.deepcopy(load_run(ws / "jobs" / job_id / "run").model)).eval()
        tok = merged["base"].tokenizer
        for prompt in PROMPTS[:2]:
            out = generate(model, tok.encode(prompt), 10, temperature=0.0, eos_id=[tok.eos_id])[0]
            expect = tok.decode(out[:-1] if out and out[-1] == tok.eos_id else out)
            r = client.completions.create(model="from-job", prompt=prompt, max_tokens=10, temperature=0)
            assert r.choices[0].text == expect


def _wait(client, job_id: str, timeout: float = 180.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled", "interrupted"):
            return job
        assert time.monotonic() < deadline, f"timed out; job is {job}"
        time.sleep(0.2)


def test_adapter_echo_logprobs_equal_the_merged_model(client, merged):
    tok = merged["base"].tokenizer
    prompt = "Lists are mutable sequences"
    ids = tok.encode(prompt)
    for name in ("dora", "lora"):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
        got = r.choices[0].logprobs.token_logprobs
        with torch.no_grad():
            lp = torch.log_softmax(merged[name](torch.tensor([ids])).float(), -1)[0]
        want_ = [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert got[0] is None and len(got) == len(want_)
        assert max(abs(a - b) for a, b in zip(got[1:], want_[1:])) < 1e-5, (name, got, want_)
        base = client.completions.create(model="base", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
        assert base.choices[0].logprobs.token_logprobs != got


def test_the_prefix_cache_never_hands_one_adapters_keys_to_another(client, merged):
    """The server runs with the prefix cache on (the default): a prompt of more than one cache block
    sent to the base, then to each adapter, must give each adapter its merged model's reply (the
    base's cached keys/values would give another)."""
    tok = merged["base"].tokenizer
    ids = (tok.encode(" ".join(PROMPTS)) * 20)[:100]
    for name in ("base", "lora", "dora", "lora"):
        r = client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0)
        model = merged["base"].model if name == "base" else merged[name]
        out = generate(model, ids, 8, temperature=0.0, eos_id=[tok.eos_id])[0]
        assert r.choices[0].text == tok.decode(out[:-1] if out and out[-1] == tok.eos_id else out), name
