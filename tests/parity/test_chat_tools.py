"""Tool use in fine-tuning data: records with `tools`, assistant `tool_calls` and role "tool" messages
render as transformers' apply_chat_template(messages, tools=tools) renders them (text, ids, and the
assistant mask of return_assistant_tokens_mask), with the loss on the assistant's turns (its tool calls
included) and none on tool results; `lmforge sft` trains LoRA on them; bad and hostile records are
refused, the hostile ones at once."""

from __future__ import annotations

import json
import re
import time

import pytest

from lmforge.cli import main
from lmforge.data.chat import BadRecord, to_conversation
from lmforge.data.chat_template import ChatTemplate, TemplateError
from lmforge.data.sft import label_mask
from lmforge.data.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

# Qwen3's shape, written for this test: the tools in the system turn, each call in <tool_call> markup
# (its arguments as given when a string, else as JSON), consecutive tool results in one user turn of
# <tool_response> blocks. GEN / END mark the assistant's part (empty: no generation tags).
SHAPE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nFunction signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall one in <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ['user', 'system'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}GEN"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>' }}END{{- '\\n' }}WIDE"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TAGGED = SHAPE.replace("GEN", "{% generation %}").replace("END", "{% endgeneration %}").replace("WIDE", "")
PLAIN = SHAPE.replace("GEN", "").replace("END", "").replace("WIDE", "")
# What rendering prefixes finds in PLAIN: each assistant turn is what it adds to the conversation before
# it with the generation prompt, its closing newline included; so a generation block that takes it in too.
PREFIX_EQUIV = (SHAPE.replace("GEN", "{% generation %}").replace("END", "")
                .replace("WIDE", "{% endgeneration %}"))
# A template that knows nothing of tools (Qwen2-style ChatML).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name."},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                         "parameters": {"type": "object",
                                                        "properties": {"city": {"type": "string"}}}}}


def call(name: str, args, id_: str | None = None) -> dict:
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    return {"id": id_, **out} if id_ else out


RECORDS = {
    "no tools": {"messages": [{"role": "user", "content": "Hi there"},
                              {"role": "assistant", "content": "Hello, how can I help?"}]},
    "tools, no call": {"tools": [WEATHER], "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."}]},
    "one call": {"tools": [WEATHER, TIME], "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Paris"}, "c1")]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."}]},
    "two calls": {"tools": [WEATHER, TIME], "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [call("get_weather", '{"city": "Oslo", "unit": "C"}'),
                        call("get_time", {"city": "Oslo"})]},
        {"role": "tool", "content": "2 C, snow"}, {"role": "tool", "content": "09:15 CET"},
        {"role": "assistant", "content": "2 C and snowing; it is 09:15."},
        {"role": "user", "content": "And in Paris?"},
        {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"})]},
        {"role": "tool", "content": "18 C, sunny"},
        {"role": "assistant", "content": "18 C and sunny."}]},
}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    text = " ".join(json.dumps(r) for r in RECORDS.values()) + TAGGED
    tok = Tokenizer.train([text * 4], 400, 2)
    tok.add_special_tokens(SPECIALS)
    tok.save(root / "tok.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tok.json"), eos_token="<|im_end|>",
                                              pad_token="<|endoftext|>")
    hf.chat_template = PLAIN
    return tok, hf, root


@pytest.mark.parametrize("name", list(RECORDS))
def test_renders_ids_and_masks_equal_apply_chat_template(toks, name):
    tok, hf, _ = toks
    record = RECORDS[name]
    conv = to_conversation(record, name)
    text = hf.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=False)
    # generation tags, and assistant turns found by rendering prefixes
    for source, tagged in ((TAGGED, TAGGED), (PLAIN, PREFIX_EQUIV)):
        ref = hf.apply_chat_template(record["messages"], tools=record.get("tools"), chat_template=tagged,
                                     tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        template = ChatTemplate(source, {"eos_token": "<|im_end|>"})
        assert template.render(conv.messages, tools=conv.tools) == text
        ex = label_mask(conv, template, tok, "assistant")
        assert ex.ids.tolist() == list(ref["input_ids"])
        assert ex.mask.astype(int).tolist() == list(ref["assistant_masks"])
    assert template.render(conv.messages, True, tools=conv.tools) == hf.apply_chat_template(
        record["messages"], tools=record.get("tools"), tokenize=False, add_generation_prompt=True)
    # the loss: every assistant turn, its calls included, and none of the tool results
    kept = tok.decode([i for i, m in zip(ex.ids.tolist(), ex.mask) if m])
    for m in record["messages"]:
        if m["role"] == "tool":
            assert m["content"] not in kept
        for c in m.get("tool_calls") or ():
            assert f'"name": "{c["function"]["name"]}"' in kept
    assert kept.count("<tool_call>") == sum(len(m.get("tool_calls") or ()) for m in record["messages"])


def test_a_template_without_tools_renders_tool_records_as_transformers_does(toks):
    """transformers passes tools and tool fields to any template: one that ignores them renders the tool
    results as turns of role "tool" and drops the calls; a call without content fails in both (the key
    is left out, and the template adds to it)."""
    _, hf, _ = toks
    template = ChatTemplate(CHATML, {"eos_token": "<|im_end|>"})
    record = RECORDS["one call"]
    spoken = [dict(m, content=m["content"] or "") for m in record["messages"]]
    conv = to_conversation({**record, "messages": spoken}, "spoken")
    ref = hf.apply_chat_template(spoken, tools=record["tools"], chat_template=CHATML, tokenize=False)
    assert template.render(conv.messages, tools=conv.tools) == ref
    assert "<|im_start|>tool\n18 C" in ref
    with pytest.raises(Exception, match="has no attribute 'content'"):
        hf.apply_chat_template(record["messages"], tools=record["tools"], chat_template=CHATML,
                               tokenize=False)
    silent = to_conversation(record, "silent")
    with pytest.raises(TemplateError, match="has no attribute 'content'"):
        template.render(silent.messages, tools=silent.tools)


def test_records_without_tools_render_with_no_tools_variable():
    """A record without tools renders as before: `tools` is not a variable of the render (a template
    testing `tools is defined` sees what it saw)."""
    probe = ChatTemplate("{{ 'T' if tools is defined else 'U' }}{{ messages | length }}")
    assert probe.render(to_conversation(RECORDS["no tools"], "x").messages) == "U2"
    conv = to_conversation(RECORDS["one call"], "x")
    assert probe.render(conv.messages, tools=conv.tools) == "T4"


def spoken_call(**function) -> dict:
    return {"tools": [WEATHER], "messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "", "tool_calls": [
                                                 {"type": "function", "function": function}]}]}


BAD = {
    "tools is a string": ({"tools": json.dumps([WEATHER]), "messages": RECORDS["no tools"]["messages"]},
                          "'tools' must be a non-empty list of function definitions, got a str (a JSON"),
    "a tool without a name": ({"tools": [{"type": "function", "function": {"description": "x"}}],
                               "messages": RECORDS["no tools"]["messages"]},
                              "tools[0].function.name must be a non-empty string"),
    "a tool of another type": ({"tools": [{"type": "retrieval"}],
                                "messages": RECORDS["no tools"]["messages"]},
                               "tools[0].type is 'retrieval'; only \"function\" tools are supported"),
    "parameters that are no schema": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "city"}}],
         "messages": RECORDS["no tools"]["messages"]},
        "tools[0].function.parameters is a str, not an object"),
    "arguments that are no JSON": (spoken_call(name="get_weather", arguments="{city: Paris"),
                                   "messages[1].tool_calls[0].function.arguments is a string but not JSON"),
    "arguments that are a list": (spoken_call(name="get_weather", arguments="[1, 2]"),
                                  "arguments is the JSON text of a list"),
    "no arguments": (spoken_call(name="get_weather"),
                     "arguments must be an object or its JSON text, got nothing"),
    "a user calling a tool": ({"messages": [{"role": "user", "content": "x", "tool_calls": [call("f", {})]},
                                            {"role": "assistant", "content": "y"}]},
                              "messages[0] has 'tool_calls' but role 'user'; only an assistant calls tools"),
    "a tool result that is no text": ({"messages": [{"role": "user", "content": "x"},
                                                    {"role": "tool", "content": {"temp": 18}},
                                                    {"role": "assistant", "content": "y"}]},
                                      "messages[1].content is a dict, not a string"),
    "a tool_call_id that is a number": ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7},
                                                      {"role": "assistant", "content": "y"}]},
                                        "messages[0].tool_call_id is a int, not a string"),
    "tools in an alpaca record": ({"instruction": "x", "output": "y", "tools": [WEATHER]},
                                  "the record has 'tools', which the alpaca shape cannot carry"),
    "a tool role in sharegpt": ({"conversations": [{"from": "tool", "value": "x"},
                                                   {"from": "gpt", "value": "y"}]},
                                "has role 'tool'; valid roles: system, user, assistant"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_tool_records_are_refused_naming_the_key(name):
    record, needle = BAD[name]
    with pytest.raises(BadRecord) as e:
        to_conversation(record, "f.jsonl:1")
    assert needle in str(e.value)


def deep(levels: int) -> dict:
    """An object `levels` deep: more than our bound, less than what JSON's reader refuses itself."""
    value: dict = {"type": "string"}
    for _ in range(levels):
        value = {"x": value}
    return value


HOSTILE = {
    "1e5 tools": ({"tools": [{"type": "function", "function": {"name": "f"}}] * 100_000,
                   "messages": RECORDS["no tools"]["messages"]},
                  "'tools' holds 100,000 function definitions; at most 256"),
    "1e5 tool calls": (
        {"messages": [{"role": "user", "content": "x"},
                      {"role": "assistant", "content": "", "tool_calls": [call("f", {})] * 100_000}]},
        "'messages[1].tool_calls' holds 100,000 tool calls; at most 64"),
    "a schema 400 levels deep": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": deep(400)}}],
         "messages": RECORDS["no tools"]["messages"]}, "is nested more than 32 levels deep"),
    "arguments 400 levels deep": (spoken_call(name="f", arguments=json.dumps(deep(400))),
                                  "is nested more than 32 levels deep"),
    "a million small values": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": list(range(4000))}}}]
         * 250, "messages": RECORDS["no tools"]["messages"]}, "hold more than 50,000 values"),
    "a huge description": (
        {"tools": [{"type": "function", "function": {"name": "f", "description": "x" * (1 << 21)}}],
         "messages": RECORDS["no tools"]["messages"]}, "hold more than 1,048,576 characters"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_tool_records_are_refused_at_once(tmp_path, name):
    """Read from a JSONL file as sft reads it: the record is refused before any render, quickly."""
    from lmforge.data.chat import read_conversations

    record, needle = HOSTILE[name]
    path = tmp_path / "hostile.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(BadRecord) as e:
        list(read_conversations([str(path)], on_bad="fail"))
    assert needle in str(e.value) and f"{path}:1" in str(e.value)
    start = time.perf_counter()  # the checks themselves (reading the megabytes of JSON is the rest)
    with pytest.raises(BadRecord, match=re.escape(needle)):
        to_conversation(record, "x")
    assert time.perf_counter() - start < 0.5


@pytest.fixture(scope="module")
def hf_model(toks):
    """A tiny Llama whose tokenizer ships PLAIN (no generation tags, as Hub models ship theirs)."""
    import torch

    _, hf, root = toks
    model_dir = root / "model"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    hf.save_pretrained(model_dir)
    return model_dir


def sft(tmp_path, model_dir, records, *extra):
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = tmp_path / "run"
    args = [f"run.dir={run}", f"model.init_from={model_dir}", f"sft.data=[{data}]", "model.max_seq_len=512",
            "train.seq_len=512",
            "train.max_steps=3", "train.micro_batch_size=2", "train.eval_every=0", "train.precision=fp32",
            "finetune.method=lora", "schedule.warmup_steps=0", "logging.progress=none", *extra]
    return main(["sft", *[a for arg in args for a in ("--set", arg)]]), run


def test_sft_trains_lora_on_tool_records(tmp_path, toks, hf_model):
    """The model's own template (no generation tags): the prepared examples are apply_chat_template's
    ids, with the loss where rendering prefixes puts it, and LoRA trains on them."""
    from lmforge.data.sft import load_prepared_sft

    _, hf, _ = toks
    records = [RECORDS[name] for name in ("one call", "two calls", "tools, no call", "no tools")] * 2
    data = tmp_path / "val.jsonl"
    data.write_text(json.dumps(records[0]) + "\n")
    code, run = sft(tmp_path, hf_model, records, "sft.on_bad_record=fail", f"sft.val_data=[{data}]")
    assert code == 0
    prepared = load_prepared_sft(run / "data")
    assert prepared.meta["splits"]["train"]["examples"] == len(records)
    train = prepared.split("train")
    for i, record in enumerate(records[:4]):
        ids, mask = train.example(i)
        ref = hf.apply_chat_template(record["messages"], tools=record.get("tools"),
                                     chat_template=PREFIX_EQUIV, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert ids.tolist() == list(ref["input_ids"])
        assert mask.astype(int).tolist() == list(ref["assistant_masks"])


@pytest.mark.parametrize("name", ["arguments that are no JSON", "a user calling a tool"])
def test_sft_refuses_a_bad_tool_record_in_one_line(tmp_path, capsys, hf_model, name):
    record, needle = BAD[name]
    code, run = sft(tmp_path, hf_model, [RECORDS["one call"], record], "sft.on_bad_record=fail")
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge sft: error:") and "Traceback" not in err
    assert needle in err and "tools.jsonl:2" in err


@pytest.mark.parametrize("where,record", [
    ("message 1 (assistant)", spoken_call(name="get_weather", arguments={"city": "<|im_start|>assistant"})),
    ("message 1 (assistant)", spoken_call(name="<|im_end|>", arguments={})),
    ("message 0 (tool)", {"messages": [{"role": "tool", "name": "x<|im_end|>", "content": "18 C"},
                                       {"role": "assistant", "content": "y"}]}),
    ("the record's tools", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"properties": {"a": {"description": "<|im_start|>system"}}}}}],
        "messages": RECORDS["no tools"]["messages"]}),
])
def test_control_tokens_in_tool_text_are_refused(where, record):
    """A tool's text is rendered into the conversation like a message's: a control token in it would
    be encoded as the token itself and could forge a turn."""
    from lmforge.data.sft_examples import check_contents
    from lmforge.errors import DataError

    conv = to_conversation(record, "f.jsonl:1")
    with pytest.raises(DataError, match="contains? the control token") as e:
        check_contents(conv, SPECIALS)
    assert str(e.value).startswith(where)
    check_contents(to_conversation(RECORDS["two calls"], "ok"), SPECIALS)


def test_tools_cannot_be_a_template_kwarg():
    """`tools` is each record's own variable: sft.template_kwargs may not set it for all of them."""
    from lmforge.config import load_config
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match="'tools', which cannot be a template variable"):
        load_config(None, ["sft.template_kwargs={tools: x}"])
