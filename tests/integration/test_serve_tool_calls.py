"""Tool calling through the official `openai` client against `lmforge serve` on localhost: a two-turn tool
conversation (a call forced by tool_choice, its result sent back, the model's answer) with the Qwen/Hermes
and the Llama 3.1 template shapes; the forced call parses and validates against the function's schema,
streamed deltas reassemble to the same call, the second turn is rendered with the call and its result
(the reply equals eval.generate's greedy output on that render), and a template without tool support
is refused naming `tools`; tool_choice "required" lets a model write several calls (a model steered to
write two gets two, one with parallel_tool_calls false or a named function); streamed logprobs with tools
add up to the unstreamed reply's, token for token, none lagging behind the content it carries."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import TINY, tiny_overrides
from lmforge.config import load_config
from lmforge.data.chat_template import ChatTemplate, stop_ids
from lmforge.eval.chat import chat_prompt_ids
from lmforge.eval.generate import generate
from lmforge.eval.open_run import load_run
from lmforge.train.trainer import train
from tool_templates import CHATML, LLAMA31, QWEN

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")


KEY = "tools-key-0123456789"
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_data_dir):
    root = tmp_path_factory.mktemp("serve_tools") / "run"
    train(load_config(TINY, tiny_overrides(
        root, shared_data_dir, "train.max_steps=1", "checkpoint.every=0", "train.eval_every=0",
        "optim.lr=1e-6", "schedule.warmup_steps=0", "model.max_seq_len=1024", "model.tie_embeddings=false",
        "model.init_std=0.1")))
    return load_run(root)


@pytest.fixture(scope="module")
def servers(run):
    """One engine behind three apps: the Qwen/Hermes, Llama 3.1 and ChatML (no tools) templates."""
    from lmforge.serve import Server, bind
    from lmforge.serve.app import create_app
    from lmforge.serve.engine import Engine

    engine = Engine(run.model, run.tokenizer.decode, max_batch_size=4).start()
    out = {}
    for name, source in (("qwen", QWEN), ("llama", LLAMA31), ("chatml", CHATML)):
        template = ChatTemplate(source, SPECIALS, name=f"the {name} template", end_of_turn=None)
        app = create_app(engine, run.tokenizer, template, model_name="tiny", api_keys=[KEY])
        out[name] = (Server(app, bind("127.0.0.1", 0), engine, "tiny").start(), template)
    yield out
    for server, _ in out.values():
        server.stop()
    engine.close()


def client(servers, name):
    return openai.OpenAI(base_url=servers[name][0].url, api_key=KEY, max_retries=0, timeout=120)


def greedy_text(run, template, messages, max_tokens: int, tools=None) -> str:
    ids = chat_prompt_ids(template, run.tokenizer, messages, tools=tools)
    stops = stop_ids(template, run.tokenizer)
    out = generate(run.model, ids, max_tokens, temperature=0.0, eos_id=sorted(stops))[0]
    return run.tokenizer.decode(out[:-1] if out and out[-1] in stops else out)


def check_call(call, name: str) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    args = json.loads(call.function.arguments)
    schema = next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]
    jsonschema.validate(args, schema)
    return args


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_two_turn_tool_conversation(servers, run, family):
    c = client(servers, family)
    template = servers[family][1]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named, max_tokens=200,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    args = check_call(call, "get_weather")
    # the second turn: the client's own message object back, then the call's result
    messages = USER + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    r2 = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=12, temperature=0)
    rendered = USER + [
        {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function",
                                              "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "18 C, sunny"}]
    want = greedy_text(run, template, rendered, 12, tools=TOOLS)
    assert "18 C, sunny" in template.render(rendered, True, tools=TOOLS)
    # "auto": the tiny model writes no call, so the reply is its text, untouched
    assert r2.choices[0].message.content == want and not r2.choices[0].message.tool_calls
    assert r2.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r2.choices[0].finish_reason


def test_required_picks_a_tool_and_streams_the_same_call(servers):
    c = client(servers, "qwen")
    kw = {"model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
          "temperature": 0}
    whole = c.chat.completions.create(**kw).choices[0]
    [call] = whole.message.tool_calls
    args = check_call(call, call.function.name)
    chunks = list(c.chat.completions.create(**kw, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert calls[0].id.startswith("call_") and calls[0].function.name == call.function.name
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:])
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == args
    assert not "".join(d.content or "" for d in deltas)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_sampled_forced_calls_always_parse(servers):
    """At temperature 1.5 a random model's calls still parse and validate: the grammar writes them."""
    c = client(servers, "llama")
    r = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                  max_tokens=200, temperature=1.5, n=6, seed=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        check_call(call, call.function.name)


def test_tool_choice_none_answers_as_without_tools(servers):
    c = client(servers, "qwen")
    plain = c.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
    none = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none",
                                     max_tokens=8, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_a_template_without_tool_support_is_refused(servers):
    c = client(servers, "chatml")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=4)
    assert e.value.status_code == 400 and e.value.body["param"] == "tools"
    assert "does not render 'tools'" in e.value.body["message"]
    # and a bad tool field is an OpenAI-shaped 400 naming it, not a 500
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=USER, tools=[{"type": "function", "function": {
            "name": "bad name"}}], max_tokens=4)
    assert e.value.body["param"].startswith("tools.0.function.name")


@pytest.mark.parametrize("extra, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": {"type": "object"}}}]},
     "tools.0.function.strict", "enforced only when a call is forced"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"},
     "tools", "cannot be enforced"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not one of 'tools'"),
    ({"tools": TOOLS, "messages": [{"role": "tool", "content": "18 C"}]}, "messages.0", "tool_call_id"),
])
def test_tool_requests_that_cannot_be_honoured_are_400s_naming_the_field(servers, extra, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client(servers, "qwen").chat.completions.create(**{"model": "tiny", "messages": USER, "max_tokens": 4,
                                                           **extra})
    assert e.value.body["param"] == param and message in e.value.body["message"]


# -- several calls under "required" ----------------------------------------------------------------------
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


class Scripted(nn.Module):
    """The tiny model steered to reply `script` (token ids): a large bias on script[t] for the reply's
    t-th token, counted from the last prefill's length (one request at a time); past the script, the
    model's own logits. Whatever the grammar refuses of the script, the model does not write."""

    def __init__(self, inner: nn.Module, script: list[int]) -> None:
        super().__init__()
        self.inner, self.cfg, self.script, self.prompt_len = inner, inner.cfg, script, 0

    def forward(self, ids: torch.Tensor, **kw) -> torch.Tensor:
        logits = self.inner(ids, **kw).clone()
        positions = kw.get("position_ids")
        if positions is None:  # a prompt's prefill: its last position predicts the reply's first token
            self.prompt_len = ids.shape[1]
            nexts = [0]
        else:  # a decode step: each row's fed token is at position p, its next token the reply's
            nexts = [int(p) + 1 - self.prompt_len for p in positions[:, -1]]
        for row, t in enumerate(nexts):
            if 0 <= t < len(self.script):
                logits[row, -1, self.script[t]] += 100.0
        return logits


@pytest.fixture(scope="module")
def two_calls(run):
    """A Qwen-template server whose model writes TWO_CALLS, then ends its turn."""
    from lmforge.serve import Server, bind
    from lmforge.serve.app import create_app
    from lmforge.serve.engine import Engine

    template = ChatTemplate(QWEN, SPECIALS, name="the qwen template", end_of_turn=None)
    model = Scripted(run.model, [])
    engine = Engine(model, run.tokenizer.decode, max_batch_size=1).start()
    app = create_app(engine, run.tokenizer, template, model_name="tiny", api_keys=[KEY])
    server = Server(app, bind("127.0.0.1", 0), engine, "tiny").start()
    c = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    c.steer = lambda text: setattr(  # the reply the model writes, then its end of turn
        model, "script", run.tokenizer.encode(text) + [min(stop_ids(template, run.tokenizer))])
    c.steer(TWO_CALLS)
    yield c
    server.stop()
    engine.close()


def test_required_takes_several_calls_when_parallel_calls_are_allowed(two_calls):
    kw = {"model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300,
          "temperature": 0}
    for extra in ({}, {"parallel_tool_calls": True}):
        choice = two_calls.chat.completions.create(**kw, **extra).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        first, second = choice.message.tool_calls
        assert check_call(first, "get_weather") == {"city": "Oslo", "days": 3}
        assert check_call(second, "get_time") == {"zone": "CET"} and first.id != second.id
    chunks = list(two_calls.chat.completions.create(**kw, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name) for d in deltas if d.id] == [(0, "get_weather"), (1, "get_time")]
    args = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in (0, 1)]
    assert [json.loads(a) for a in args] == [{"city": "Oslo", "days": 3}, {"zone": "CET"}]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("extra", [{"parallel_tool_calls": False}, {"tool_choice": NAMED}],
                         ids=["not-parallel", "named"])
def test_one_call_only_without_parallel_calls_or_for_a_named_function(two_calls, extra):
    """The model would write a second call: the grammar ends the reply after the first."""
    kw = {"model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300,
          "temperature": 0, **extra}
    choice = two_calls.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert check_call(call, "get_weather") == {"city": "Oslo", "days": 3}


@pytest.mark.parametrize("reply, tool_choice", [
    (TWO_CALLS, "required"), ("Let me look.\n" + TWO_CALLS, "auto"),
    ("Just <b>text</b> <tool", "auto"),  # what may begin a call is held back until the reply ends
], ids=["forced-calls", "content-then-calls", "free-text"])
def test_streamed_logprobs_with_tools_add_up_to_the_unstreamed_ones(two_calls, reply, tool_choice):
    two_calls.steer(reply)
    kw = {"model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 300,
          "temperature": 0.8, "seed": 7, "logprobs": True, "top_logprobs": 3}
    whole = two_calls.chat.completions.create(**kw)
    chunks = list(two_calls.chat.completions.create(**kw, stream=True))
    choice = whole.choices[0]
    entries = [e for ch in chunks[1:] if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in choice.logprobs.content]
    assert len(entries) == whole.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)
    # what was streamed is the same reply, and no chunk's content runs ahead of the tokens sent with it
    text = content = ""
    deltas = []
    for ch in chunks[1:]:
        d = ch.choices[0]
        text += "".join(e.token for e in d.logprobs.content) if d.logprobs else ""
        content += d.delta.content or ""
        deltas += d.delta.tool_calls or ()
        assert text.startswith(content.rstrip())
    assert text.startswith(reply) and (content or None) == choice.message.content
    calls = [(d.function.name, d.function.arguments) for d in deltas if d.id]
    assert len(calls) == len(choice.message.tool_calls or ()) == (0 if "<b>" in reply else 2)
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_streamed_logprobs_of_several_sampled_choices_with_tools(servers):
    """n choices of the random model at a fixed seed: each choice's streamed logprobs are its own."""
    kw = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 24, "temperature": 1.0, "seed": 3,
          "n": 3, "logprobs": True, "top_logprobs": 2}
    c = client(servers, "qwen")
    whole = c.chat.completions.create(**kw)
    streamed = {i: [] for i in range(3)}
    for ch in c.chat.completions.create(**kw, stream=True):
        if ch.choices[0].logprobs:
            streamed[ch.choices[0].index] += [e.model_dump() for e in ch.choices[0].logprobs.content]
    assert len({tuple(e["token"] for e in s) for s in streamed.values()}) > 1  # the choices differ
    for choice in whole.choices:
        assert streamed[choice.index] == [e.model_dump() for e in choice.logprobs.content]
