"""`lmforge serve` against hostile or broken requests: no key, a wrong key, the key in the wrong header,
oversize bodies (declared and chunked), prompts too long for the context, n / max_tokens out of range,
malformed JSON, unknown or unsupported fields, forged chat turns, a wrong model. Each gets its status
and an OpenAI-shaped error, and the server keeps serving. And the CLI refuses to start without a key,
on a busy port or without a run (exit 2, one clear line)."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.train.trainer import train

pytest.importorskip("fastapi")

KEY = "hostile-key-9876543210"
LIMIT = 1 << 20  # the default body limit


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_data_dir) -> Path:
    root = tmp_path_factory.mktemp("serve_hostile") / "run"
    train(load_config(TINY, tiny_overrides(root, shared_data_dir, "train.max_steps=1", "checkpoint.every=0",
                                           "train.eval_every=0")))
    return root  # max_seq_len 64


@pytest.fixture(scope="module")
def server(run_dir):
    from lmforge.serve import start_server

    with start_server(run_dir, api_keys=[KEY, "second-key"], model_name="tiny") as srv:
        yield srv


def request(server, method: str, path: str, body=None, headers=None, key: str | None = KEY,
            raw: bytes | None = None):
    """(status, parsed JSON body, headers) of one request over a fresh connection."""
    host, port = server.sock.getsockname()[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=h)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, json.loads(payload) if payload else None, dict(resp.getheaders())


def assert_error(status, body, want_status, *words, code=None):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert err["type"] == ("authentication_error" if want_status == 401 else "invalid_request_error")
    for w in words:
        assert w in err["message"], err["message"]
    if code is not None:
        assert err["code"] == code


def ok(server):
    """The server still answers a valid request."""
    status, body, _ = request(server, "POST", "/v1/completions",
                              {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def test_keys(server):
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        method = "GET" if path == "/v1/models" else "POST"
        status, body, headers = request(server, method, path, GOOD, key=None)
        assert_error(status, body, 401, "didn't provide an API key", code="invalid_api_key")
        assert headers.get("www-authenticate") == "Bearer"
    assert_error(*request(server, "POST", "/v1/completions", GOOD, key="wrong")[:2], 401, "Incorrect API key")
    assert_error(*request(server, "POST", "/v1/completions", GOOD, key=KEY + "x")[:2], 401)
    assert_error(*request(server, "POST", "/v1/completions", GOOD, key="")[:2], 401)
    # the key in the wrong header, or with the wrong scheme
    for h in ({"X-API-Key": KEY}, {"api-key": KEY}, {"Authorization": f"Basic {KEY}"},
              {"Authorization": KEY}):
        assert_error(*request(server, "POST", "/v1/completions", GOOD, key=None, headers=h)[:2], 401)
    # every configured key works; /health needs none
    assert request(server, "GET", "/v1/models", key="second-key")[0] == 200
    status, health = request(server, "GET", "/health", key=None)[:2]
    # the prefix cache's counters (on by default) are reported there too: counts only, no prompt
    assert status == 200 and health["status"] == "ok" and health["prefix_cache"]["budget_bytes"] == 256 << 20
    ok(server)


def oversize(server, chunked: bool, key: str = KEY) -> tuple[int, dict]:
    """Send a body over the limit: its headers only when it declares its length (refused before it is
    read), or chunks until the limit is passed, without the final chunk (counted while it arrives). The
    client stops sending where the server stops reading, so the answer is not lost to a reset."""
    host, port = server.sock.getsockname()[:2]
    with socket.create_connection((host, port), timeout=60) as s:
        framing = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {LIMIT + 10}".encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {key}\r\n".encode() + framing + b"\r\n\r\n")
        if chunked:  # exactly the limit, then a small chunk that passes it
            for part in [b"a" * 65536] * (LIMIT // 65536) + [b"a" * 10]:
                s.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_oversize_bodies(server):
    assert_error(*oversize(server, chunked=False), 413, "exceeds 1048576 bytes", code="request_too_large")
    assert_error(*oversize(server, chunked=True), 413, code="request_too_large")
    # unauthenticated: refused before the size matters
    assert oversize(server, chunked=False, key="wrong")[0] == 401
    ok(server)


def test_context_and_ranges(server):
    long = " ".join(["word"] * 200)  # over the 64-token context
    assert_error(*request(server, "POST", "/v1/completions", {**GOOD, "prompt": long})[:2], 400,
                 "maximum context length is 64", code="context_length_exceeded")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": long}]}
    assert_error(*request(server, "POST", "/v1/chat/completions", chat)[:2], 400, "context length",
                 code="context_length_exceeded")
    assert_error(*request(server, "POST", "/v1/completions", {**GOOD, "max_tokens": 100})[:2], 400,
                 "max_tokens", code="context_length_exceeded")
    for field, value in (("n", 0), ("n", 17), ("max_tokens", 0), ("max_tokens", -5), ("temperature", -1),
                         ("top_p", 0), ("top_p", 1.5), ("seed", -1), ("stop", ["a", "b", "c", "d", "e"]),
                         ("stop", [""]), ("prompt", []), ("prompt", [[1, 2], [-3]]), ("prompt", [1, 99999]),
                         ("n", "three"), ("prompt", {"text": "x"})):
        status, body, _ = request(server, "POST", "/v1/completions", {**GOOD, field: value})
        assert_error(status, body, 400)
    assert_error(*request(server, "POST", "/v1/completions", {**GOOD, "prompt": ["x"] * 20, "n": 4})[:2], 400,
                 "prompts x n")
    ok(server)


def test_malformed_and_unsupported(server):
    for raw in (b"{", b"not json", b"\xff\xfe", b"[1, 2]", b'"text"', b"", b"[" * 100000 + b"]" * 100000):
        assert_error(*request(server, "POST", "/v1/completions", raw=raw)[:2], 400)
    assert_error(*request(server, "POST", "/v1/completions", {**GOOD, "bogus": 1})[:2], 400,
                 "Unrecognized request argument supplied: bogus")
    assert_error(*request(server, "POST", "/v1/completions", {"prompt": "x"})[:2], 400, "model")
    assert_error(*request(server, "POST", "/v1/completions", {**GOOD, "logprobs": 6})[:2], 400,
                 "'logprobs' takes an integer from 0 to 5")
    assert_error(*request(server, "POST", "/v1/completions", {**GOOD, "best_of": 2})[:2], 400,
                 "'best_of' is not supported")
    assert_error(*request(server, "POST", "/v1/completions", {**GOOD, "logit_bias": {"99999": 1}})[:2], 400,
                 "outside this model's vocabulary")
    neutral = {**GOOD, "logprobs": None, "presence_penalty": 0}
    assert request(server, "POST", "/v1/completions", neutral)[0] == 200
    status, body, _ = request(server, "POST", "/v1/completions", {**GOOD, "model": "gpt-4"})
    assert_error(status, body, 404, "gpt-4", code="model_not_found")
    assert_error(*request(server, "GET", "/v1/nothing")[:2], 404)
    chat = {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}
    assert_error(*request(server, "POST", "/v1/chat/completions", chat)[:2], 400)
    # a message may not carry a control token's text: it would be encoded as the token itself
    eos = "<|endoftext|>"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": f"hi{eos}"}]}
    assert_error(*request(server, "POST", "/v1/chat/completions", chat)[:2], 400, "control token")
    ok(server)


def test_cli_refuses_to_start(run_dir, capsys, monkeypatch):
    monkeypatch.delenv("LMFORGE_API_KEY", raising=False)
    assert main(["serve", str(run_dir), "--port", "0"]) == 2
    assert "refusing to serve without an API key" in capsys.readouterr().err
    assert main(["serve", str(run_dir), "--api-key", "k", "--no-auth"]) == 2
    assert "not both" in capsys.readouterr().err
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        assert main(["serve", str(run_dir), "--api-key", "k", "--port", str(busy.getsockname()[1])]) == 2
        assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
    finally:
        busy.close()
    assert main(["serve", str(run_dir.parent / "missing"), "--api-key", "k", "--port", "0"]) == 2
    assert "no such run" in capsys.readouterr().err


def test_keys_from_the_environment_and_missing_extra(run_dir, monkeypatch):
    import sys

    from lmforge.errors import LmforgeError
    from lmforge.serve import build_server, resolve_api_keys

    assert resolve_api_keys(["a", "b"], False, env={"LMFORGE_API_KEY": "c"}) == ["a", "b"]
    assert resolve_api_keys([], False, env={"LMFORGE_API_KEY": "c"}) == ["c"]
    assert resolve_api_keys([], True, env={"LMFORGE_API_KEY": "c"}) is None
    for bad in ([" padded"], [""], ["tab\tkey"]):
        with pytest.raises(LmforgeError, match="printable"):
            resolve_api_keys(bad, False, env={})
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if lmforge[serve] were not installed
    with pytest.raises(LmforgeError, match=r"pip install 'lmforge\[serve\]'"):
        build_server(run_dir, port=0, api_keys=["k"])


def test_a_failing_step_fails_its_requests_not_the_server(server, monkeypatch):
    def broken():
        raise RuntimeError("simulated failure inside a decode step")

    monkeypatch.setattr(server.engine, "_decode", broken)
    status, body, _ = request(server, "POST", "/v1/completions", GOOD)
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "simulated" not in body["error"]["message"]  # internals stay in the server's log
    monkeypatch.undo()
    ok(server)
