"""`response_format` through the official `openai` client against `lmforge serve`: json_schema (strict) and
json_object replies parse and validate, streamed and not (the stream's text equals the reply's at the
same seed); lmforge's regex extension; {"type": "text"} is the free reply; bad schemas and patterns
are a 400 naming response_format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import TINY, tiny_overrides
from lmforge.config import load_config
from lmforge.train.trainer import train

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

KEY = "test-key-0123456789"
OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    {**OBJ, "properties": {"city": {"type": "string", "maxLength": 8},
                           "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
     "required": ["city", "unit", "days"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {**OBJ, "properties": {"ok": {"type": "boolean"}, "tag": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["ok", "tag"]},
]
MESSAGES = [{"role": "user", "content": "Give me the forecast as JSON."}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_data_dir) -> Path:
    root = tmp_path_factory.mktemp("structured") / "run"
    train(load_config(TINY, tiny_overrides(
        root, shared_data_dir, "train.max_steps=1", "checkpoint.every=0", "train.eval_every=0",
        "optim.lr=1e-6", "schedule.warmup_steps=0", "model.max_seq_len=128", "model.tie_embeddings=false",
        "model.init_std=0.1")))
    return root


@pytest.fixture(scope="module")
def client(run_dir):
    from lmforge.serve import start_server

    with start_server(run_dir, api_keys=[KEY], model_name="tiny", max_batch_size=4) as srv:
        yield openai.OpenAI(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_json_schema_replies_validate_streamed_and_not(client, k):
    fmt = schema_format(SCHEMAS[k])
    for seed in (1, 2):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt,
                                           temperature=1.0, seed=seed, max_tokens=64, n=2)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[k])
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt,
                                                temperature=1.0, seed=seed, max_tokens=64, n=2, stream=True)
        texts = ["", ""]
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        assert texts == [c.message.content for c in r.choices]


def test_json_object_and_text_formats(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.0, max_tokens=64,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.0, max_tokens=20)
    text = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "text"},
                                          temperature=0.0, max_tokens=20)
    assert text.choices[0].message.content == free.choices[0].message.content


def test_regex_extension(client):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=3, n=4,
                                       response_format={"type": "regex", "regex": pattern}, max_tokens=40)
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.message.content), c.message.content


@pytest.mark.parametrize("fmt, match", [
    (schema_format({"type": "foo"}), "Invalid type"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "description": "d"}}, "description"),
    (schema_format({"not": {"type": "integer"}}), "not"),  # strict: a keyword it cannot enforce
    (schema_format({"type": "array", "items": json.loads('{"items": ' * 40 + "{}" + "}" * 40)}), "nested"),
    ({"type": "regex", "regex": "[a-"}, "regex"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "response_format"),
    ({"type": "text", "strict": True}, "response_format"),
])
def test_bad_formats_are_a_400_naming_response_format(client, fmt, match):
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=5)
    assert e.value.body["param"].startswith("response_format")
