"""`lmforge serve` with a Hugging Face dir whose chat template is hostile: a render that never ends is
refused (400, naming the template's file) within seconds while other requests, chat ones included, are
answered; prompts holding lone surrogates are 400s, not 500s; a conversation longer than the context is
refused by its rendered size before it is tokenized."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.train.trainer import train

pytest.importorskip("fastapi")

KEY = "template-key-0123456789"
# ChatML's text, and a loop that never ends when the first message says "hang".
TEMPLATE = (
    "{% if messages[0]['content'] == 'hang' %}{% for i in range(9000) %}{% for j in range(9000) %}"
    "{% for k in range(9000) %}{% endfor %}{% endfor %}{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, shared_data_dir) -> Path:
    root = tmp_path_factory.mktemp("serve_templates")
    train(load_config(TINY, tiny_overrides(root / "run", shared_data_dir, "train.max_steps=1",
                                           "checkpoint.every=0", "train.eval_every=0")))
    assert main(["export", str(root / "run"), str(root / "hf")]) == 0
    config = root / "hf" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": TEMPLATE}))
    return root / "hf"


@pytest.fixture(scope="module")
def server(hf_dir):
    from lmforge.serve import start_server

    with start_server(hf_dir, api_keys=[KEY], model_name="tiny") as srv:
        yield srv


def request(server, path: str, body: dict | None = None, raw: bytes | None = None):
    host, port = server.sock.getsockname()[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json",
                                                   "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    return resp.status, payload


def chat(content: str, max_tokens: int = 2) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}


def test_a_render_that_never_ends_is_refused_while_others_are_answered(server):
    assert request(server, "/v1/chat/completions", chat("hello"))[0] == 200  # the worker is warm
    refused: dict = {}

    def hang():
        t0 = time.perf_counter()
        refused["answer"] = request(server, "/v1/chat/completions", chat("hang"))
        refused["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=hang)
    thread.start()
    time.sleep(0.3)  # the hanging render has started
    answered = []
    for _ in range(3):  # while it runs, chat and completion requests are served
        status, body = request(server, "/v1/chat/completions", chat("hello"))
        answered.append(("answer" in refused, status, body["choices"][0]["message"]["role"]))
        status, body = request(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        answered.append(("answer" in refused, status, body["object"]))
    thread.join(30)
    assert answered[0] == (False, 200, "assistant") and answered[1] == (False, 200, "text_completion")
    assert all(a[1] == 200 for a in answered)
    status, body = refused["answer"]
    assert status == 400 and refused["seconds"] < 5.0
    message = body["error"]["message"]
    assert "tokenizer_config.json did not finish rendering" in message
    assert body["error"]["param"] == "messages"
    assert request(server, "/v1/chat/completions", chat("hello again"))[0] == 200  # a fresh worker took over


def test_lone_surrogates_are_bad_requests(server):
    for path, raw in (("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'),
                      ("/v1/chat/completions", b'{"model": "tiny", "max_tokens": 2, "messages": '
                                               b'[{"role": "user", "content": "a\\udfffb"}]}')):
        status, body = request(server, path, raw=raw)
        assert status == 400, body
        assert "lone surrogate" in body["error"]["message"]
        assert body["error"]["param"] in ("prompt", "messages.0.content")
    emoji = b'{"model": "tiny", "prompt": "a\\ud83d\\ude00b", "max_tokens": 2}'  # a pair is one character
    assert request(server, "/v1/completions", raw=emoji)[0] == 200


def test_a_conversation_past_the_context_is_refused_by_its_size(server):
    status, body = request(server, "/v1/chat/completions", chat("word " * 150_000))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "longer than the model's context of 64 tokens" in body["error"]["message"]
