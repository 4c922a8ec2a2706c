"""Every field of `lmforge serve`'s request models is in a table saying whether it works or is refused,
and a live server does what the table says: a request with the field set to a value that means
something gets 200 when it works, an OpenAI-shaped 400 naming the field when it is refused. A field
added to a request model without an entry here fails the first test, so no field can be accepted and
ignored unnoticed. What each working field does is tested in its own file (named in the table)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.config import load_config
from lmforge.serve.protocol import ChatCompletionRequest, CompletionRequest, Message
from lmforge.train.trainer import train

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

KEY = "test-key-0123456789"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# field -> ("works", value, where its effect is tested) | ("refused", value, why)
COMPLETIONS = {
    "model": ("works", "tiny", "test_serve_openai.py"),
    "prompt": ("works", [[1, 2, 3], [4, 5]], "test_serve_openai.py"),
    "max_tokens": ("works", 3, "test_serve_openai.py"),
    "temperature": ("works", 0.7, "test_serve_engine.py"),
    "top_p": ("works", 0.9, "test_serve_engine.py"),
    "top_k": ("works", 5, "test_serve_engine.py"),
    "n": ("works", 2, "test_serve_openai.py"),
    "stop": ("works", ["\n"], "test_serve_engine.py"),
    "seed": ("works", 7, "test_serve_engine.py"),
    "stream": ("works", True, "test_serve_openai.py"),
    "stream_options": ("works", {"include_usage": True}, "test_serve_openai.py"),
    "user": ("works", "u-1", "an end user's id for the operator's records: no effect on the reply (OpenAI)"),
    "logprobs": ("works", 2, "test_serve_logprobs.py"),
    "echo": ("works", True, "test_serve_logprobs.py, test_serve_lm_eval.py"),
    "logit_bias": ("works", {"5": 3.5}, "test_serve_penalties.py"),
    "presence_penalty": ("works", 0.5, "test_serve_penalties.py"),
    "frequency_penalty": ("works", 0.5, "test_serve_penalties.py"),
    "top_logprobs": ("refused", 2, "a chat field; completions' logprobs: k gives the k best"),
    "suffix": ("refused", "end", "fill-in-the-middle needs a model trained for it"),
    "best_of": ("refused", 2, "not implemented: use n and rank by logprobs"),
}
CHAT = {
    "model": ("works", "tiny", "test_serve_openai.py"),
    "messages": ("works", USER, "test_serve_openai.py"),
    "max_tokens": ("works", 3, "test_serve_openai.py"),
    "max_completion_tokens": ("works", 3, "test_serve_openai.py"),
    "temperature": ("works", 0.7, "test_serve_engine.py"),
    "top_p": ("works", 0.9, "test_serve_engine.py"),
    "top_k": ("works", 5, "test_serve_engine.py"),
    "n": ("works", 2, "test_serve_openai.py"),
    "stop": ("works", ["\n"], "test_serve_engine.py"),
    "seed": ("works", 7, "test_serve_engine.py"),
    "stream": ("works", True, "test_serve_openai.py"),
    "stream_options": ("works", {"include_usage": True}, "test_serve_openai.py"),
    "user": ("works", "u-1", "an end user's id for the operator's records: no effect on the reply (OpenAI)"),
    "logprobs": ("works", True, "test_serve_logprobs.py"),
    "top_logprobs": ("works", 3, "test_serve_logprobs.py"),
    "logit_bias": ("works", {"5": 3.5}, "test_serve_penalties.py"),
    "presence_penalty": ("works", 0.5, "test_serve_penalties.py"),
    "frequency_penalty": ("works", 0.5, "test_serve_penalties.py"),
    "response_format": ("works", {"type": "json_object"}, "test_serve_grammar.py, test_serve_structured.py"),
    # the tiny run's ChatML template renders no tools: refused by the template, not the protocol (the
    # Qwen / Llama 3.1 templates' tool calls: test_serve_tool_calls.py)
    "tools": ("refused", [TOOL], "this run's chat template has no tool support"),
    "tool_choice": ("refused", "required", "needs tools (which this template cannot render)"),
    "parallel_tool_calls": ("refused", False, "needs tools"),
    "echo": ("refused", True, "a completions field"),
    "suffix": ("refused", "end", "a completions field"),
    "best_of": ("refused", 2, "a completions field, and not implemented"),
}
# fields of one chat message: those a client sends back in a second turn work; the rest only at null
MESSAGE = {
    "role": ("works", "user"), "content": ("works", "hi"), "name": ("works", "ann"),
    "tool_calls": ("works", None), "tool_call_id": ("works", None),
    "refusal": ("refused", "no"), "function_call": ("refused", {"name": "f", "arguments": "{}"}),
    "audio": ("refused", {"id": "a"}),
}


def test_every_field_of_every_request_model_is_in_the_table():
    assert set(COMPLETIONS) == set(CompletionRequest.model_fields)
    assert set(CHAT) == set(ChatCompletionRequest.model_fields)
    assert set(MESSAGE) == set(Message.model_fields)


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared_data_dir):
    from lmforge.serve import start_server

    root: Path = tmp_path_factory.mktemp("fields") / "run"
    train(load_config(TINY, tiny_overrides(
        root, shared_data_dir, "train.max_steps=1", "checkpoint.every=0", "train.eval_every=0",
        "model.max_seq_len=64")))
    with start_server(root, api_keys=[KEY], model_name="tiny", max_batch_size=4) as srv:
        yield srv


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/{route}", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60)


def _cases(table, base):
    for field, (verdict, value, _) in table.items():
        body = {**base, field: value}
        if field in ("max_tokens", "max_completion_tokens"):
            body.pop("max_tokens", None)
            body[field] = value
        if field == "stream_options":
            body["stream"] = True
        if field == "top_logprobs" and verdict == "works":
            body["logprobs"] = True
        yield field, verdict, body


@pytest.mark.parametrize("route, table, base", [
    ("completions", COMPLETIONS, {"model": "tiny", "prompt": "ab", "max_tokens": 3}),
    ("chat/completions", CHAT, {"model": "tiny", "messages": USER, "max_tokens": 3}),
], ids=["completions", "chat"])
def test_the_server_does_what_the_table_says(server, route, table, base):
    for field, verdict, body in _cases(table, base):
        r = post(server, route, body)
        if verdict == "works":
            assert r.status_code == 200, (field, r.text)
        else:
            assert r.status_code == 400, (field, r.text)
            error = r.json()["error"]
            assert error["param"] == field or field in error["message"], (field, error)


def test_message_fields(server):
    for field, (verdict, value) in MESSAGE.items():
        message = {"role": "user", "content": "hi", field: value}
        r = post(server, "chat/completions", {"model": "tiny", "messages": [message], "max_tokens": 2})
        if verdict == "works":
            assert r.status_code == 200, (field, r.text)
        else:
            assert r.status_code == 400 and field in r.text, (field, r.text)
