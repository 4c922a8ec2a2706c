"""Tool calling on the chat route, without a model: the tool markup learned from each family's chat
template (Qwen/Hermes, Llama 3.1, Mistral; none for a template that ignores tools), replies parsed back
into OpenAI tool_calls (malformed ones left as content), streamed deltas that reassemble to the same
calls, and the request's tool fields checked and bounded."""

from __future__ import annotations

import json
import sys

import pytest
from pydantic import ValidationError

from lmforge.data.chat_template import ChatTemplate
from lmforge.serve.protocol import ChatCompletionRequest
from lmforge.serve.tools import (
    HERMES,
    Markup,
    StreamParser,
    ToolsRefused,
    call_schemas,
    detect_markup,
    parse_reply,
    plan_tools,
)
from tool_templates import CHATML, LLAMA31, MISTRAL, QWEN

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
MISTRAL_MARKUP = Markup("mistral", "[TOOL_CALLS][", "]", sep=", ")
LLAMA_MARKUP = Markup("json", "", "", args_key="parameters", parallel=False)
NAMES = ["get_weather", "get_time"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, SPECIALS)


@pytest.mark.parametrize("source, want", [
    (QWEN, HERMES),
    (LLAMA31, LLAMA_MARKUP),
    (MISTRAL, MISTRAL_MARKUP),
])
def test_markup_is_learned_from_the_template(source, want):
    got = detect_markup(template(source))
    assert (got.begin, got.end, got.name_key, got.args_key, got.sep, got.parallel) == (
        want.begin, want.end, want.name_key, want.args_key, want.sep, want.parallel)


def test_a_template_that_ignores_tools_has_no_markup_and_is_refused():
    assert detect_markup(template(CHATML)) is None
    assert detect_markup(ChatTemplate.chatml()) is None
    with pytest.raises(ToolsRefused, match="does not render 'tools'") as e:
        plan_tools([WEATHER], "auto", None, None, None, "lmforge's ChatML template")
    assert e.value.param == "tools"


def test_a_template_that_reads_tools_but_cannot_render_our_call_falls_back_to_hermes():
    odd = ("{% if tools %}TOOLS{% endif %}{% for m in messages %}{{ m.role }}: "
           "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    assert detect_markup(template(odd)) == HERMES


@pytest.mark.parametrize("source", [QWEN, LLAMA31, MISTRAL])
def test_a_call_rendered_by_the_template_parses_back(source):
    """What the template writes for an assistant's call is what the parser reads back as that call."""
    t = template(source)
    m = detect_markup(t)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    args = {"city": "Paris", "days": [1, 2], "extra": {"unit": "C"}}
    call = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    prompt = t.render(user, add_generation_prompt=True, tools=[WEATHER, TIME])
    full = t.render(user + [{"role": "assistant", "tool_calls": [call]}], tools=[WEATHER, TIME])
    reply = full[len(prompt):].removesuffix("</s>").removesuffix("<|eot_id|>").removesuffix("<|im_end|>\n")
    content, calls = parse_reply(reply, m, NAMES)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", args)]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
       '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
REPLIES = [  # (markup, reply, content, [(name, arguments text)])
    (HERMES, TWO, "Let me look.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city":  "Nice"}}\n</tool_call>', None,
     [("get_weather", '{"city":  "Nice"}')]),  # the arguments exactly as written
    (HERMES, '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>\nDone.', "Done.",
     [("get_weather", '{"city": "Oslo"}')]),
    (MISTRAL_MARKUP, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, '
     '"id": "abc123456"}, {"name": "get_time", "arguments": {"city": "Oslo"}}]', None,
     [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"city": "Oslo"}')]),
    (LLAMA_MARKUP, '{"name": "get_weather", "parameters": {"city": "Rome", "x": [1, {"y": 2}]}}', None,
     [("get_weather", '{"city": "Rome", "x": [1, {"y": 2}]}')]),
    (LLAMA_MARKUP, '<|python_tag|>{"name": "get_time", "parameters": {}}', None, [("get_time", "{}")]),
]
MALFORMED = [  # replies that are not calls: the whole text is the content
    (HERMES, "Plain text, no call < tool  \n"),
    (HERMES, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),  # not a function of the request
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'),  # not an object
    (HERMES, '<tool_call>\nnot json at all\n</tool_call>'),
    (LLAMA_MARKUP, '{"name": "get_weather", "parameters": {"city": "Rome"}} and more'),
    (LLAMA_MARKUP, '{"name": "get_weather"}'),
    (LLAMA_MARKUP, "Hello there"),
]
CUT = [  # calls that go wrong after their arguments began (cut off by max_tokens, or text inside the
    # markup after them): content as well, but a stream has sent their start already
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {}} trailing\n</tool_call>', "{}"),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": ', '{"city": '),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_c', "{}"),
    (MISTRAL_MARKUP, '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}', "{}"),
]


def calls_of(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("markup, reply, content, calls", REPLIES)
def test_replies_parse_into_openai_tool_calls(markup, reply, content, calls):
    got_content, got = parse_reply(reply, markup, NAMES)
    assert (got_content, calls_of(got)) == (content, calls)
    assert len({c["id"] for c in got}) == len(got)


@pytest.mark.parametrize("markup, reply", MALFORMED + [c[:2] for c in CUT])
def test_malformed_calls_are_content_not_errors(markup, reply):
    assert parse_reply(reply, markup, NAMES) == (reply, [])


@pytest.mark.parametrize("depth", [40, 5000])
def test_a_call_nested_too_deep_is_content_whatever_the_recursion_limit(depth):
    deep_list = "[" * depth + "]" * depth
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"a": ' + deep_list + "}}\n</tool_call>"
    assert parse_reply(reply, HERMES, NAMES) == (reply, [])
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # as torch.compile's tests leave it: json can then read 5000 levels
    try:
        assert parse_reply(reply, HERMES, NAMES) == (reply, [])
    finally:
        sys.setrecursionlimit(limit)
    ok = "[" * 20 + "]" * 20  # nested as deep as a request's arguments may be: a call
    assert parse_reply(reply.replace(deep_list, ok), HERMES, NAMES)[1]


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = parse_reply(TWO, HERMES, NAMES, parallel=False)
    assert content == "Let me look." and calls_of(calls) == [("get_weather", '{"city": "Paris"}')]


def streamed(markup: Markup, reply: str, step: int, parallel: bool = True) -> tuple[list[dict], str | None,
                                                                                       list[tuple[str, str]]]:
    """The deltas of `reply` fed `step` characters at a time, and what a client assembles from them."""
    p = StreamParser(markup, NAMES, parallel)
    deltas = []
    for i in range(0, len(reply), step):
        deltas += p.feed(reply[i: i + step])
    deltas += p.finish()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function"
                assert tc["function"]["arguments"] == ""  # the name first, then the arguments
                calls[tc["index"]] = [tc["function"]["name"], ""]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    assert p.called == bool(calls)
    assert p.parsed == bool(parse_reply(reply, markup, NAMES, parallel)[1])  # finish_reason "tool_calls"
    return deltas, content or None, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize("markup, reply", [(m, r) for m, r, _, _ in REPLIES] + MALFORMED)
def test_streamed_deltas_reassemble_to_the_same_reply(markup, reply, step):
    content, calls = parse_reply(reply, markup, NAMES)
    _, got_content, got_calls = streamed(markup, reply, step)
    assert (got_content, got_calls) == (content, calls_of(calls))


def test_streamed_content_comes_before_the_call_and_arguments_in_fragments():
    deltas, _, _ = streamed(HERMES, TWO, 2)
    kinds = ["content" if "content" in d else "call" for d in deltas]
    assert kinds[0] == "content" and "content" not in kinds[kinds.index("call"):]
    fragments = [d for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert len(fragments) > 2  # the arguments arrive as they are written, not at the end
    assert streamed(HERMES, TWO, 2, parallel=False)[2] == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("markup, reply, sent", CUT)
def test_a_streamed_call_cut_by_max_tokens_stays_as_sent(markup, reply, sent):
    """A call whose name was sent cannot be taken back: it stays as sent, its arguments cut."""
    _, content, calls = streamed(markup, reply, 1)
    assert content is None and calls == [("get_weather", sent)]


def test_call_schemas_force_the_name_and_the_parameters():
    [schema] = call_schemas(LLAMA_MARKUP, [WEATHER, TIME], only="get_weather")
    assert schema["properties"] == {"name": {"const": "get_weather"},
                                    "parameters": WEATHER["function"]["parameters"]}
    assert schema["required"] == ["name", "parameters"] and schema["additionalProperties"] is False
    assert [s["properties"]["name"]["const"] for s in call_schemas(HERMES, [WEATHER, TIME])] == NAMES


# -- the request ---------------------------------------------------------------------------------------
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **fields})


def test_a_second_turn_reaches_the_template_as_transformers_passes_it():
    r = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    assert r.conversation() == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"}]
    assert r.tool_mode() == "auto" and r.tool_dicts() == [WEATHER]
    named_result = {"role": "tool", "tool_call_id": "elsewhere", "name": "get_time", "content": "9:00"}
    assert request(messages=[*CHAT["messages"], named_result]).conversation()[-1] == {
        "role": "tool", "content": "9:00", "tool_call_id": "elsewhere", "name": "get_time"}
    assert request(tools=[WEATHER], tool_choice="none").tool_mode() is None
    assert request(tools=[WEATHER], tool_choice="required").tool_mode() == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert request(tools=[WEATHER], tool_choice=named).tool_mode() == "named"


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def fn(name="get_weather", **more) -> dict:
    return {"type": "function", "function": {"name": name, **more}}


@pytest.mark.parametrize("fields, message", [
    ({"tools": [fn(f"f{i}") for i in range(129)]}, "at most 128 items"),
    ({"tools": [fn("bad name!")]}, "should match pattern"),
    ({"tools": [fn("x" * 65)]}, "should match pattern"),
    ({"tools": [fn(), fn()]}, "defines the function 'get_weather' twice"),
    ({"tools": [fn(description="d" * 4097)]}, "at most 4096 characters"),
    ({"tools": [fn(parameters=deep(40))]}, "nested more than 32 levels deep"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "Input should be 'function'"),
    ({"tools": [fn(color="red")]}, "Extra inputs are not permitted"),
    ({"tool_choice": "auto"}, "'tool_choice' needs 'tools'"),
    ({"tool_choice": "sometimes", "tools": [fn()]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}, "tools": [fn()]},
     "names the function 'other', which is not one of 'tools'"),
    ({"parallel_tool_calls": False}, "'parallel_tool_calls' needs 'tools'"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "needs 'tool_call_id'"),
    ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "needs 'content'"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "only allowed on a message of"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only allowed on an assistant"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "is not JSON text"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]}, "the JSON text of a list"),
    ({"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, "refusal"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        # json reads it or not by the recursion limit (other tests raise it): refused either way
        "name": "f", "arguments": '{"a": ' + "[" * 5000 + "]" * 5000 + "}"}}]}]},
     "not JSON text|nested more than 32 levels deep"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": json.dumps(deep(40))}}]}]}, "nested more than 32 levels deep"),
])
def test_bad_tool_fields_are_refused_naming_them(fields, message):
    with pytest.raises(ValidationError, match=message):
        request(**fields)


def test_strict_is_refused_where_nothing_enforces_it():
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    with pytest.raises(ToolsRefused, match=r"tools\[0\].function.strict: true is enforced only") as e:
        plan_tools([strict], "auto", None, None, HERMES, "t")
    assert e.value.param == "tools.0.function.strict"
    assert plan_tools([WEATHER], "auto", None, False, HERMES, "t").parallel is False
    assert plan_tools([WEATHER], "auto", None, None, LLAMA_MARKUP, "t").parallel is False
