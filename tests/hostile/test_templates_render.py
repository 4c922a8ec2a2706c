"""Hostile chat templates and chat data below the CLI: every way a template can work past a budget
(loops, C-level padding and formatting, big integers, doubling strings, recursion) is refused within
seconds with a TemplateError naming the template, the worker recovers for the next render, renders
are cut at a sequence's worth of text without changing the tokens a sequence keeps, and JSON readers
turn deep nesting, lone surrogates and byte order marks into clear answers."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from lmforge.data import chat_template, template_pool
from lmforge.data.chat import ChatStats, _iter_jsonl, to_conversation
from lmforge.data.chat_template import (
    CHATML,
    CHATML_TOKENS,
    ChatTemplate,
    TemplateError,
    shipped_template,
    tokenizer_template,
)
from lmforge.data.sft_examples import fit, label_mask
from lmforge.data.template_pool import pool
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError
from lmforge.utils.jsontext import BadJSON, loads

MSGS = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
HOSTILE = {
    "nested range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops": "{% for i in range(9000) %}{% for j in range(9000) %}{{ '' }}{% endfor %}{% endfor %}",
    "loops over messages": "{% for a in range(9000) %}{% for m in messages %}{% for b in range(9000) %}"
                           "{% endfor %}{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * 10000000000 }}",
    "repeat a list": "{{ [1, 2] * 10000000000 }}",
    "doubling by ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                     "{% endfor %}{{ ns.s }}",
    "doubling a list": "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "strftime format": "{{ strftime_now('%Y' * 20000000) }}",
    "strftime format by ~": "{% set ns = namespace(f='%Y') %}{% for i in range(24) %}"
                            "{% set ns.f = ns.f ~ ns.f %}{% endfor %}{{ strftime_now(ns.f) }}",
    "percent width": "{{ '%99999999999s' % 'x' }}",
    "format filter width": "{{ '%99999999999s'|format('x') }}",
    "format filter star width": "{{ '%*s'|format(99999999999, 'x') }}",
    "str.format width": "{{ '{:>99999999999}'.format('x') }}",
    "format_map width": "{{ '{a:>99999999999}'.format_map({'a': 1}) }}",
    "ljust": "{{ 'x'.ljust(10**10) }}",
    "center method": "{{ 'x'.center(9999999999) }}",
    "zfill": "{{ '1'.zfill(9999999999) }}",
    "center filter": "{{ 'x'|center(99999999999) }}",
    "indent filter": "{{ 'a\nb'|indent(99999999999) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(9999999) }}",
    "replace doubling": "{% set ns = namespace(s='x' * 1000) %}{% for i in range(6) %}"
                        "{% set ns.s = ns.s.replace('x', ns.s) %}{% endfor %}{{ ns.s|length }}",
    "replace filter doubling": "{% set ns = namespace(s='x' * 1000) %}{% for i in range(6) %}"
                               "{% set ns.s = ns.s|replace('x', ns.s) %}{% endfor %}{{ ns.s|length }}",
    "power": "{{ 9 ** (9 ** 9) }}",
    "power tower": "{{ 2 ** (2 ** (2 ** (2 ** (2 ** 2)))) }}",
    "product doubling": "{% set ns = namespace(n=99) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                        "{% endfor %}{{ ns.n }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "lipsum": "{{ lipsum(100000000) }}",
    "json indent": "{{ messages|tojson(indent=2000000000) }}",
    "range step": "{% for i in range(0, 10**18, 10**9) %}{% endfor %}",
    "join doubling": "{% set ns = namespace(s=['x']) %}{% for i in range(40) %}"
                     "{% set ns.s = [ns.s|join(''), ns.s|join('')] %}{% endfor %}{{ ns.s|length }}",
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = ["the quick brown fox jumps over the lazy dog " * 4, "What is 2 + 2? 4 6 lorem ipsum dolor"] * 50
    t = Tokenizer.train(texts, vocab_size=300, min_frequency=1)
    t.add_special_tokens(CHATML_TOKENS)
    return t


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_are_refused_within_seconds(name):
    template = ChatTemplate(HOSTILE[name], name=f"the chat template {name}.jinja")
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match=f"the chat template {name}.jinja (failed to render|did not finish"
                                            "|needed more than)"):
        template.render(MSGS)
    assert time.perf_counter() - t0 < 5.0
    # the worker that was stopped is replaced: the next template renders as it should
    assert ChatTemplate(CHATML + "\n").render(MSGS).startswith("<|im_start|>user\nWhat is 2 + 2?")


def test_a_template_nested_too_deeply_to_compile():
    with pytest.raises(TemplateError, match="x.jinja does not compile: it is nested too deeply"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", name="the chat template x.jinja")
    with pytest.raises(TemplateError, match="at most 1,048,576"):
        ChatTemplate("x" * (2 << 20))


def test_legitimate_templates_keep_working():
    """Repetition, padding and ranges of ordinary size are a template's business."""
    template = ChatTemplate(
        "{{ '=' * 40 }}{{ '%5s'|format('a') }}{{ 'x'.ljust(8) }}|{{ '{:>4}'.format(7) }}{{ 2 ** 10 }}"
        "{% for i in range(messages|length) %}{{ messages[i]['content']|indent(2) }}{% endfor %}"
        "{{ strftime_now('%Y-%m-%d')|length }}"
    )
    assert template.render(MSGS) == "=" * 40 + "    ax       |   71024What is 2 + 2?410"


def test_only_lmforge_templates_render_in_process(monkeypatch):
    other = ChatTemplate(CHATML + " ", name="lmforge's ChatML template")  # trust is by the text, not a name
    text, spans = other.assistant_spans(MSGS)
    assert text == ChatTemplate.chatml().render(MSGS) + " "
    assert text[spans[0][0] : spans[0][1]] == "4<|im_end|>"

    def no_worker(*args):
        raise AssertionError("rendered in a worker")

    monkeypatch.setattr(template_pool._Worker, "run", no_worker)
    assert ChatTemplate.chatml().trusted and ChatTemplate.chatml().render(MSGS) == text[:-1]
    with pytest.raises(AssertionError, match="in a worker"):
        other.render(MSGS)


def test_a_batch_names_the_conversation_the_template_fails_on():
    template = ChatTemplate("{% if messages[0]['content'] == 'bad' %}{{ raise_exception('no') }}{% endif %}"
                            "{{ messages[0]['content'] }}")
    ok = template.render_batch([MSGS, MSGS])
    assert [r.text for r in ok] == ["What is 2 + 2?"] * 2
    with pytest.raises(TemplateError) as e:
        template.render_batch([MSGS, [{"role": "user", "content": "bad"}], MSGS])
    assert e.value.index == 1
    loop = ChatTemplate("{% if messages[0]['content'] == 'bad' %}" + HOSTILE["nested loops"] + "{% endif %}")
    with pytest.raises(TemplateError, match="did not finish") as e:
        loop.render_batch([MSGS, MSGS, [{"role": "user", "content": "bad"}], MSGS])
    assert e.value.index == 2


def test_a_worker_killed_from_outside_is_replaced():
    template = ChatTemplate(CHATML + " ")
    with pool().worker() as w:
        if w.proc is not None:
            w.proc.kill()
            w.proc.wait()
    assert template.render(MSGS).endswith("<|im_end|>\n ")


def conversation(n_turns: int) -> list[dict]:
    out = []
    for i in range(n_turns):
        out += [{"role": "user", "content": f"question {i} the quick brown fox"},
                {"role": "assistant", "content": f"answer {i} jumps over the lazy dog"}]
    return out


@pytest.mark.parametrize("generation_tags", [True, False])
@pytest.mark.parametrize("loss_on", ["assistant", "last", "all"])
def test_a_cut_render_keeps_the_tokens_of_the_uncut_one(tok, generation_tags, loss_on):
    """Rendering only the text a sequence can hold changes nothing the sequence keeps."""
    source = CHATML if generation_tags else CHATML.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    template = ChatTemplate(source)
    conv = to_conversation({"messages": conversation(60)}, "x")
    seq_len = 48
    full = label_mask(conv, template, tok, loss_on)
    limit = tok.text_budget(seq_len + 1)
    cut = label_mask(conv, template, tok, loss_on, template.render_batch([conv.messages], spans=True,
                                                                         limit=limit)[0])
    assert full.complete and not cut.complete and len(cut.ids) < len(full.ids)
    a, b = fit(full, seq_len, "truncate"), fit(cut, seq_len, "truncate")
    if loss_on == "last":  # the last turn is past the cut either way: nothing to learn
        assert a is None and b is None
        return
    assert a.ids.tolist() == b.ids.tolist() and a.mask.tolist() == b.mask.tolist()
    assert fit(cut, seq_len, "drop") is None and fit(full, seq_len, "drop") is None


def test_a_conversation_of_100000_turns_costs_what_its_first_turns_cost(tok):
    conv = to_conversation({"messages": conversation(50_000)}, "x")
    for template in (ChatTemplate.chatml(), ChatTemplate(CHATML.replace("{% generation %}", "").replace(
            "{% endgeneration %}", ""))):
        t0 = time.perf_counter()
        r = template.render_batch([conv.messages], spans=True, limit=tok.text_budget(65))[0]
        ex = fit(label_mask(conv, template, tok, "assistant", r), 64, "truncate")
        assert time.perf_counter() - t0 < 2.0 and not r.complete
        assert len(ex.ids) == 64 and ex.mask.any()


def test_templates_shipped_with_a_tokenizer(tmp_path, tok):
    tok_file = tmp_path / "tokenizer.json"
    config = tmp_path / "tokenizer_config.json"
    assert shipped_template(tok_file, {}) is None
    listed = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert shipped_template(tok_file, {"chat_template": listed})[0] == "D"
    for value, why in (([{"name": "default", "template": 5}], "entry 0"), ([["default", "x"]], "entry 0"),
                       ([{"name": "tool_use", "template": "T"}], 'no "default"'), (7, "not int 7"),
                       ({"default": "D"}, "not dict")):
        with pytest.raises(DataError, match=why):
            shipped_template(tok_file, {"chat_template": value})
    config.write_bytes(b"\xef\xbb\xbf" + json.dumps({"chat_template": "{{ eos_token }}",
                                                      "eos_token": "</s>"}).encode())
    template = tokenizer_template(tok_file, tok)
    assert template.render(MSGS) == "</s>" and template.end_of_turn == "</s>"
    config.write_text("[" * 100_000)
    with pytest.raises(DataError, match="tokenizer_config.json: not valid JSON .*nested too deeply"):
        tokenizer_template(tok_file, tok)


def test_json_lines_deep_nesting_surrogates_and_byte_order_marks(tmp_path):
    f = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": MSGS})
    f.write_bytes(b"\xef\xbb\xbf" + (good + "\n").encode() + b"[" * 100_000 + b"\n"
                  + b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}\n'
                  + b'{"emoji": "\\ud83d\\ude00"}\n\xef\xbb\xbf{}\n')
    rows = list(_iter_jsonl(f, ChatStats()))
    assert rows[0] == (f"{f}:1", {"messages": MSGS})  # the byte order mark of the file is no record's
    assert "nested too deeply" in rows[1][1].why
    assert rows[2][1].why.startswith("messages.0.content holds a lone surrogate")
    assert rows[3][1] == {"emoji": "\U0001f600"}  # a surrogate pair is one character, and fine
    assert "malformed JSON" in rows[4][1].why  # a byte order mark inside the file is not one


def test_loads_refuses_what_no_encoder_can_take():
    with pytest.raises(BadJSON, match="nested too deeply"):
        loads("{\"a\": " * 50_000)
    with pytest.raises(BadJSON) as e:
        loads('{"a": [1, {"b\\udc00": 2}]}')
    assert e.value.path == "a.1.b\\udc00"
    assert loads(b'{"ok": "\\u00e9\\ud83d\\ude00"}') == {"ok": "\u00e9\U0001f600"}


def test_tokenizing_a_lone_surrogate_is_a_data_error(tok):
    for encode in (tok.encode, tok.encode_chat, lambda s: tok.encode_batch(["fine", s])):
        with pytest.raises(DataError, match="lone surrogate .* at character 1"):
            encode("a\ud800b")


def test_text_budget_holds_more_than_its_tokens(tok):
    rng = np.random.default_rng(0)
    alphabet = list("the quick brown fox 2+4?\n") + ["<|im_end|>", "é", "日本"]
    for n in (1, 16, 64):
        text = "".join(rng.choice(alphabet, size=tok.text_budget(n)))[: tok.text_budget(n)]
        assert len(tok.encode_chat(text)[0]) > n


def test_each_prefix_render_has_the_deadline_and_the_conversation_a_cap(monkeypatch, tok):
    """A template without generation tags renders two prefixes per turn: a long conversation is work in
    proportion to its turns (each render has the deadline), a template slow on every one is stopped."""
    plain = ChatTemplate(CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    conv = conversation(400)
    t0 = time.perf_counter()
    plain.render_batch([conv], spans=True, limit=tok.text_budget(4096))
    took = time.perf_counter() - t0
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", max(took / 4, 0.05))  # less than the whole job
    r = plain.render_batch([conv], spans=True, limit=tok.text_budget(4096))[0]
    assert len(r.spans) == 400 and r.complete
    slow = ChatTemplate("{% for i in range(2000) %}{% for j in range(500) %}{% endfor %}{% endfor %}"
                        + plain.source, name="the chat template slow.jinja")
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 5.0)
    monkeypatch.setattr(template_pool, "JOB_SECONDS", 1.5)
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match="slow.jinja did not finish rendering a conversation within 1.5 s "
                                            "in all"):
        slow.render_batch([conv], spans=True, limit=tok.text_budget(4096))
    assert time.perf_counter() - t0 < 5.0
