"""tool_choice "required" with parallel calls allowed forces one call or more (OpenAI's meaning), in the
template's own markup for several (Hermes: each call wrapped, joined by the template's gap; Mistral: one
list joined by its separator), at most MAX_CALLS; exactly one with parallel_tool_calls false, a named
function, or a markup that takes one call (Llama's bare JSON). The grammar's text parses back into the
same calls. Driven token by token through the grammar's matcher (no model)."""

from __future__ import annotations

import json

import pytest

from lmforge.data.chat_template import ChatTemplate
from lmforge.data.tokenizer import Tokenizer
from lmforge.serve.tools import HERMES, MAX_CALLS, Markup, detect_markup, parse_reply, plan_tools
from tool_templates import QWEN

pytest.importorskip("llguidance")

from lmforge.serve.grammar import GrammarError, tagged_json_grammar  # noqa: E402
from lmforge.serve.tools import call_grammar  # noqa: E402

MISTRAL = Markup("mistral", "[TOOL_CALLS][", "]", sep=", ")
LLAMA = Markup("json", "", "", args_key="parameters", parallel=False)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ARGS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    corpus = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
              '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": "x"}]',
              '{"name": "get_time", "parameters": {"zone": "UTC"}}', "the quick brown fox"] * 20
    return Tokenizer.train(corpus, vocab_size=400, min_frequency=2)


def written(m: Markup, k: int) -> str:
    """k calls (alternating the two tools) as the markup writes them."""
    objs = [json.dumps({m.name_key: name, m.args_key: args}) for name, args in (ARGS * MAX_CALLS)[:k]]
    if m.sep is not None:
        return m.begin + m.sep.join(objs) + m.end
    return m.gap.join(m.begin + o + m.end for o in objs)


def feed(tok, grammar, text: str):
    """The matcher after `text`'s tokens, or None where the grammar refuses one of them."""
    matcher = grammar.matcher()
    try:
        for t in tok.encode(text):
            matcher.accept(t)
    except GrammarError:
        return None
    return matcher


@pytest.mark.parametrize("markup", [HERMES, MISTRAL], ids=["hermes", "mistral"])
def test_required_with_parallel_calls_takes_one_to_max_calls(tok, markup):
    grammar = call_grammar(tok, plan_tools(TOOLS, "required", None, None, markup, "t"))
    for k in (1, 2, 3, MAX_CALLS):
        m = feed(tok, grammar, written(markup, k))
        assert m is not None and m.accepting(), k
        # wrapped calls: the reply may end after any of them, must after MAX_CALLS; a list ends at its close
        assert m.done() == (k == MAX_CALLS or markup.sep is not None), k
        content, calls = parse_reply(written(markup, k), markup, ["get_weather", "get_time"])
        assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                    for c in calls] == (ARGS * MAX_CALLS)[:k]
    assert feed(tok, grammar, written(markup, MAX_CALLS + 1)) is None
    if markup.sep is None:  # between two wrapped calls only the template's gap
        assert feed(tok, grammar, written(markup, 1) + " " + written(markup, 1)) is None


@pytest.mark.parametrize("mode, only, parallel, markup", [
    ("required", None, False, HERMES),  # parallel_tool_calls false
    ("required", None, False, MISTRAL),
    ("named", "get_weather", None, HERMES),  # a named function: one call of it (OpenAI)
    ("named", "get_weather", True, MISTRAL),
    ("required", None, None, LLAMA),  # the template takes one call
], ids=["hermes-not-parallel", "mistral-not-parallel", "hermes-named", "mistral-named", "llama"])
def test_one_call_exactly_where_several_are_not_allowed(tok, mode, only, parallel, markup):
    grammar = call_grammar(tok, plan_tools(TOOLS, mode, only, parallel, markup, "t"))
    m = feed(tok, grammar, written(markup, 1))
    assert m is not None and m.done()
    if markup.sep is not None:
        assert feed(tok, grammar, markup.begin + json.dumps(dict([("name", "get_weather"), (
            "arguments", {"city": "Paris"})])) + markup.sep) is None


def test_the_gap_between_wrapped_calls_is_learned_from_the_template():
    assert detect_markup(ChatTemplate(QWEN, {"bos_token": "<s>", "eos_token": "</s>"})).gap == "\n"
    wide = QWEN.replace("or message.content %}{{- '\\n' }}", "or message.content %}{{- '\\n\\n' }}")
    assert wide != QWEN
    assert detect_markup(ChatTemplate(wide, {"bos_token": "<s>", "eos_token": "</s>"})).gap == "\n\n"


def test_several_items_are_bounded(tok):
    with pytest.raises(GrammarError, match="max_items"):
        tagged_json_grammar(tok, "<a>", [{"type": "object"}], "</a>", max_items=10_000)
    with pytest.raises(GrammarError, match="gap"):
        tagged_json_grammar(tok, "<a>", [{"type": "object"}], "</a>", max_items=2, gap="\n" * 1000)
