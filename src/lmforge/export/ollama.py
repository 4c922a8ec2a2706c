"""An Ollama Modelfile for a GGUF export: FROM the file beside it, the chat template as Ollama's Go
template, the end-of-turn tokens as stops and the sampling defaults.

Jinja chat templates cannot be translated in general, so the common shapes are recognised instead:
each shape here is a Go template, and a run's Jinja template is that shape when both render the same
probe conversations to the same text (the Go side by `render_go`, an evaluator of exactly the subset of
Go's text/template these shapes use). A template of no known shape gets no TEMPLATE line: Ollama then
reads `tokenizer.chat_template` from the GGUF and matches it against its own known templates."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

# name -> (Go template, the stop token it ends a turn with)
SHAPES: dict[str, tuple[str, str]] = {
    "chatml": (
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
        "<|im_start|>assistant\n",
        "<|im_end|>",
    ),
    "llama3": (
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
        "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    ),
    "gemma": (
        "{{- range .Messages }}<start_of_turn>"
        "{{ if eq .Role \"assistant\" }}model{{ else }}{{ .Role }}{{ end }}\n{{ .Content }}<end_of_turn>\n"
        "{{ end }}<start_of_turn>model\n",
        "<end_of_turn>",
    ),
    "mistral": (
        "{{- range .Messages }}{{- if eq .Role \"user\" }}[INST] {{ .Content }} [/INST]"
        "{{- else if eq .Role \"assistant\" }}{{ .Content }}</s>{{- end }}{{- end }}",
        "</s>",
    ),
}
# Conversations a shape must render like the Jinja template; a probe the Jinja template refuses
# (Gemma and Mistral have no system role) is skipped, and at least one must render.
PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}),
    ({"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Name a colour."}),
)
_TAG = re.compile(r"(\s*)\{\{(-?)\s*(.*?)\s*(-?)\}\}(\s*)", re.S)


def _parse(src: str) -> list[tuple[str, str]]:
    """Go template source -> [('text', s) | ('action', a)], with {{- and -}} trimming applied."""
    out: list[tuple[str, str]] = []
    pos = 0
    for m in _TAG.finditer(src):
        before = src[pos:m.start()] + m.group(1)
        if m.group(2):
            before = before.rstrip()
        out.append(("text", before))
        out.append(("action", m.group(3)))
        pos = m.end() if m.group(4) else m.end() - len(m.group(5))
    out.append(("text", src[pos:]))
    return [(k, v) for k, v in out if k == "action" or v]


def render_go(src: str, messages: Sequence[dict[str, Any]]) -> str:
    """Render `src` (Go template text of the subset in SHAPES: range .Messages, if / else if / else on
    `eq .Role "x"`, .Role, .Content) with Ollama's `.Messages`; ValueError for anything else."""
    items = _parse(src)

    def block(i: int, dot: dict[str, Any] | None, out: list[str] | None) -> tuple[int, str]:
        """Run items from i until an `end` / `else...` at this level; returns (index, the keyword)."""
        while i < len(items):
            kind, a = items[i]
            if kind == "text":
                if out is not None:
                    out.append(a)
                i += 1
            elif a == "range .Messages":
                end, kw = block(i + 1, None, None)  # a dry run finds the matching end
                if kw != "end":
                    raise ValueError("range without end")
                for msg in messages if out is not None else []:
                    block(i + 1, msg, out)
                i = end + 1
            elif a.startswith("if "):
                i = conditional(i, a[3:], dot, out)
            elif a == "end" or a == "else" or a.startswith("else if "):
                return i, a
            elif a in (".Role", ".Content"):
                if out is not None:
                    if dot is None:
                        raise ValueError(f"{a} outside range .Messages")
                    out.append(str(dot[a[1:].lower()]))
                i += 1
            else:
                raise ValueError(f"unsupported Go template action {{{{ {a} }}}}")
        return i, ""

    def test(cond: str, dot: dict[str, Any] | None) -> bool:
        m = re.fullmatch(r'eq \.Role "([a-z]+)"', cond)
        if m is None:
            raise ValueError(f"unsupported condition {cond!r}")
        return dot is not None and dot["role"] == m.group(1)

    def conditional(i: int, cond: str, dot, out) -> int:
        taken = False
        while True:
            run = out is not None and not taken and (cond == "" or test(cond, dot))
            taken = taken or run
            i, kw = block(i + 1, dot, out if run else None)
            if kw == "end":
                return i + 1
            if kw == "else":
                cond = ""
            elif kw.startswith("else if "):
                cond = kw[len("else if "):]
            else:
                raise ValueError("if without end")

    out: list[str] = []
    i, kw = block(0, None, out)
    if kw:
        raise ValueError(f"unexpected {{{{ {kw} }}}}")
    return "".join(out)


def match_shape(render_jinja, strip_prefix: str = "") -> str | None:
    """The SHAPES name whose Go template renders every probe like `render_jinja(messages)` (the Jinja
    template with the generation prompt, minus a leading `strip_prefix`: the BOS llama.cpp adds itself),
    or None."""
    expected: list[tuple[Sequence[dict], str]] = []
    for probe in PROBES:
        try:
            text = render_jinja(list(probe))
        except Exception:  # noqa: BLE001 - a template that refuses a probe (no system role) skips it
            continue
        expected.append((probe, text[len(strip_prefix):] if strip_prefix and text.startswith(strip_prefix)
                         else text))
    if not expected:
        return None
    for name, (go, _) in SHAPES.items():
        if all(render_go(go, probe) == text for probe, text in expected):
            return name
    return None


def _quote(value: str) -> str:
    # Modelfile strings: a one-line value in "..." (JSON-style escapes), a template in """..."""
    return json.dumps(value)


def modelfile_text(gguf_path: str, shape: str | None, chat_template: str | None, stops: Sequence[str],
                   params: dict[str, Any]) -> str:
    """The Modelfile: FROM `gguf_path`, TEMPLATE of `shape` (or a comment saying why none), a stop per
    end-of-turn token, and the sampling parameters."""
    lines = ["# Written by lmforge export --format gguf. Use: ollama create NAME -f THIS_FILE", "",
             f"FROM {gguf_path}"]
    if shape is not None:
        go, stop = SHAPES[shape]
        if '"""' in go:
            raise AssertionError(shape)
        lines += [f"# the run's chat template, recognised as {shape}", f'TEMPLATE """{go}"""']
        stops = list(dict.fromkeys([stop, *stops]))
    elif chat_template is not None:
        lines.append("# no TEMPLATE: the run's chat template has no known Go form; Ollama reads it from the "
                     "GGUF (tokenizer.chat_template)")
    else:
        lines.append("# no TEMPLATE: the run has no chat template (a base model: prompts go in as they are)")
    for s in stops:
        lines.append(f"PARAMETER stop {_quote(s)}")
    for key, value in params.items():
        lines.append(f"PARAMETER {key} {value}")
    return "\n".join(lines) + "\n"
