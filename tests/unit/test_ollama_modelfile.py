"""The Ollama Modelfile of a GGUF export: it parses as Ollama's format, and its TEMPLATE (a Go
template) renders a conversation to the same text as the run's Jinja chat template, for each shape it
writes (ChatML, Llama 3, Gemma, Mistral); other templates get no TEMPLATE line."""

from __future__ import annotations

import json
import re

import pytest

from lmforge.data.chat_template import CHATML, ChatTemplate
from lmforge.export.ollama import SHAPES, match_shape, modelfile_text, render_go

# The templates these models ship (tokenizer_config.json), as published.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
ALPACA = ("{% for m in messages %}{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n"
          "{% else %}### Response:\n{{ m['content'] }}\n\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}### Response:\n{% endif %}")
# shape -> (Jinja template, its BOS text: llama.cpp adds that token itself, so the Go template omits it)
CASES = {"chatml": (CHATML, ""), "llama3": (LLAMA3, "<|begin_of_text|>"), "gemma": (GEMMA, "<bos>"),
         "mistral": (MISTRAL, "<s>")}
# a conversation none of the recognition probes has: longer, with newlines and quotes in the contents
CONVERSATION = [
    {"role": "user", "content": 'Write "hi" twice,\nthen stop.'},
    {"role": "assistant", "content": "hi hi"},
    {"role": "user", "content": "Now in French?"},
    {"role": "assistant", "content": "salut salut"},
    {"role": "user", "content": "Thanks {{ .Content }}"},
]


def parse_modelfile(text: str) -> dict[str, list[str]]:
    """Ollama's Modelfile format: `INSTRUCTION args` lines, `#` comments, and triple-quoted values
    that may span lines; instructions are case-insensitive. Raises on anything else."""
    out: dict[str, list[str]] = {}
    pos = 0
    line_re = re.compile(r'[ \t]*(?:#[^\n]*|(\w+)[ \t]+("""(.*?)"""|[^\n]*))?[ \t]*(?:\n|$)', re.S)
    while pos < len(text):
        m = line_re.match(text, pos)
        assert m and m.end() > pos, f"cannot parse the Modelfile at {text[pos:pos + 40]!r}"
        if m.group(1):
            value = m.group(3) if m.group(3) is not None else m.group(2).strip()
            out.setdefault(m.group(1).upper(), []).append(value)
        pos = m.end()
    assert set(out) <= {"FROM", "TEMPLATE", "PARAMETER", "SYSTEM", "ADAPTER", "LICENSE", "MESSAGE"}, out
    return out


def _jinja(source: str, bos: str):
    template = ChatTemplate(source, {"bos_token": bos or "<s>", "eos_token": "</s>"})
    return lambda messages: template.render(messages, add_generation_prompt=True)


@pytest.mark.parametrize("shape", sorted(CASES))
def test_each_shape_is_recognised_and_renders_like_the_jinja_template(shape):
    source, bos = CASES[shape]
    render = _jinja(source, bos)
    assert match_shape(render, bos) == shape
    expected = render(CONVERSATION)
    assert expected.startswith(bos)
    assert render_go(SHAPES[shape][0], CONVERSATION) == expected[len(bos):]


def test_chatml_renders_a_known_good_string():
    # what Ollama's own ChatML templates give for this conversation (checks the evaluator, not the shape)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}]
    assert render_go(SHAPES["chatml"][0], messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>assistant\n")
    # Go's {{- trims the whitespace before it, newlines included; {{ if }} / {{ else }} pick one branch
    go = ('a \n {{- range .Messages }}[{{ if eq .Role "user" }}U{{ else if eq .Role "x" }}X{{ else }}O'
          '{{ end }}]{{ end }} \n{{- /* */ -}}')
    with pytest.raises(ValueError, match="unsupported"):
        render_go(go, messages)
    assert render_go(go.replace("{{- /* */ -}}", ""), messages) == "a[O][U][O] \n"


def test_unsupported_go_is_refused():
    for bad in ("{{ .System }}", "{{ range .Tools }}{{ end }}", "{{ if .First }}x{{ end }}",
                "{{ range .Messages }}"):
        with pytest.raises(ValueError):
            render_go(bad, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("shape", sorted(CASES))
def test_the_modelfile_parses_and_holds_template_stops_and_parameters(shape):
    source, _ = CASES[shape]
    text = modelfile_text("./run.gguf", shape, source, ["<|endoftext|>"], {"temperature": 1.0, "top_k": 0})
    parsed = parse_modelfile(text)
    assert parsed["FROM"] == ["./run.gguf"]
    assert parsed["TEMPLATE"] == [SHAPES[shape][0]]
    stops = [json.loads(p[len("stop "):]) for p in parsed["PARAMETER"] if p.startswith("stop ")]
    assert stops == [SHAPES[shape][1], "<|endoftext|>"]
    assert "temperature 1.0" in parsed["PARAMETER"] and "top_k 0" in parsed["PARAMETER"]


def test_a_template_of_no_known_shape_gets_no_template_line():
    render = _jinja(ALPACA, "")
    assert match_shape(render) is None
    parsed = parse_modelfile(modelfile_text("./run.gguf", None, ALPACA, ["</s>"], {}))
    assert "TEMPLATE" not in parsed and parsed["PARAMETER"] == ['stop "</s>"']
    # a base model (no template at all) neither
    assert "TEMPLATE" not in parse_modelfile(modelfile_text("./run.gguf", None, None, [], {}))
