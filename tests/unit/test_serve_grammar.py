"""Constrained decoding (serve/grammar.py) in the serving engine: over a set of JSON schemas, every reply
sampled at temperature 1 from a tiny random model parses and validates against its schema (jsonschema);
regex and tagged-JSON grammars; free rows batched with constrained rows give exactly their solo text;
n > 1 choices have independent grammar states; stop tokens only once the grammar is complete; bad,
oversized and too-deep schemas and patterns are refused; an imported (transformers) tokenizer works."""

from __future__ import annotations

import json
import re
import sys
import threading

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import LmforgeError
from lmforge.models import Transformer
from lmforge.serve.engine import Engine, SamplingParams

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from lmforge.serve import grammar as G  # noqa: E402
from lmforge.serve.grammar import (  # noqa: E402
    GrammarError,
    json_grammar,
    mask_logits_,
    regex_grammar,
    tagged_json_grammar,
)

CORPUS = ['{"name": "Ada", "age": 36, "tags": ["x", "y"], "ok": true, "v": null}',
          '[1, 2, 3.5, -4]', '{"user": {"id": 7}, "color": "red", "kind": "point"}',
          "the quick brown fox jumps over the lazy dog", "<tool_call>\n{}\n</tool_call>"] * 20

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    # nested objects, integer bounds, string length
    {**OBJ, "properties": {"user": {**OBJ, "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {**OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {**OBJ, "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}, "required": ["x"]},
    {"type": "integer", "exclusiveMinimum": 10, "maximum": 20},
    {**OBJ, "properties": {"a": {"type": "string"}, "b": {"type": "boolean"}, "c": {"type": "null"}}},
    {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},  # extra keys allowed
    {**OBJ, "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 5}, "minItems": 1,
     "maxItems": 3},
    {"type": "array", "maxItems": 3, "items": {**OBJ, "properties": {
        "k": {"type": "string", "enum": ["x", "y"]}, "v": {"type": "number"}}, "required": ["k", "v"]}},
    {"anyOf": [{"type": "integer"}, {**OBJ, "properties": {"s": {"type": "string", "maxLength": 3}},
                                     "required": ["s"]}]},
    {**OBJ, "properties": {"kind": {"const": "point"}, "ok": {"type": "boolean"}},
     "required": ["kind", "ok"]},
    {"$defs": {"p": {**OBJ, "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
     **OBJ, "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"type": "array", "items": {"$ref": "#/$defs/p"},
                                                            "maxItems": 2}}, "required": ["a", "b"]},
    # OpenAI strict style: every key required, nullable through a type list
    {**OBJ, "properties": {"q": {"type": ["string", "null"], "maxLength": 4}, "n": {"type": "integer"}},
     "required": ["q", "n"]},
]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(CORPUS, vocab_size=400, min_frequency=2)


def tiny_model(tok: Tokenizer, vocab_pad: int = 0) -> Transformer:
    """Random weights, plus a fixed logit bias toward the tokens that close a JSON value, so that
    temperature-1 replies end within max_tokens (a random model would otherwise write strings of
    hundreds of tokens); which tokens are valid where is the grammar's alone."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size + vocab_pad, d_model=32, n_layers=2, n_heads=4,
                                    n_kv_heads=2, max_seq_len=256, tie_embeddings=False, init_std=0.1)).eval()
    bias = torch.zeros(model.cfg.vocab_size)
    for i in range(tok.vocab_size):
        if any(c in tok.decode([i]) for c in '"}],'):
            bias[i] = 3.0
    model.register_forward_hook(lambda mod, args, out: out + bias)
    return model


@pytest.fixture(scope="module")
def engine(tok):
    with Engine(tiny_model(tok), tok.decode, max_batch_size=8) as eng:
        yield eng


def prompt(tok) -> list[int]:
    return tok.encode("Answer in JSON: ")


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_sampled_replies_parse_and_validate(tok, engine, k):
    schema = SCHEMAS[k]
    params = SamplingParams(max_tokens=200, temperature=1.0, n=4, seed=100 + k,
                            stop_ids=frozenset({tok.eos_id}), grammar=json_grammar(tok, schema))
    for text, n, reason in engine.generate([prompt(tok), tok.encode("x")], params, timeout=120):
        assert reason == "stop", (text, n)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode_gives_objects(tok, engine):
    params = SamplingParams(max_tokens=200, temperature=1.0, n=4, seed=3, stop_ids=frozenset({tok.eos_id}),
                            grammar=json_grammar(tok, None))
    outs = engine.generate([prompt(tok)], params, timeout=120)
    assert all(r == "stop" and isinstance(json.loads(t), dict) for t, _, r in outs), outs


def test_regex_and_stop_token_only_once_complete(tok, engine):
    pattern = r"[0-9]{2,4}(-[a-z]{1,3})?"
    params = SamplingParams(max_tokens=40, temperature=1.0, n=8, seed=5, stop_ids=frozenset({tok.eos_id}),
                            grammar=regex_grammar(tok, pattern))
    for text, _, reason in engine.generate([prompt(tok)], params, timeout=120):
        assert reason == "stop" and re.fullmatch(pattern, text), text
    m = regex_grammar(tok, "[0-9]+").matcher()
    logits = torch.zeros(2, tok.vocab_size)
    assert mask_logits_(logits, [0], [m], [{tok.eos_id}]) == {}
    assert logits[0, tok.eos_id] == float("-inf") and not logits[1].isinf().any()  # row 1 untouched
    m.accept(tok.encode("7")[0])
    assert m.accepting() and not m.done() and m.allowed()[tok.encode("7")[0]]
    assert not m.allowed()[tok.eos_id]  # the tokenizer's EOS only through the request's stop ids
    logits = torch.zeros(1, tok.vocab_size)
    mask_logits_(logits, [0], [m], [{tok.eos_id}])
    assert logits[0, tok.eos_id] == 0


def test_tagged_json_is_begin_one_schema_end(tok, engine):
    schemas = [{**OBJ, "properties": {"name": {"const": "get_weather"}, "arguments": {
        **OBJ, "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}},
        "required": ["name", "arguments"]},
        {**OBJ, "properties": {"name": {"const": "add"}, "arguments": {
            **OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}},
         "required": ["name", "arguments"]}]
    g = tagged_json_grammar(tok, "<tool_call>\n", schemas, "\n</tool_call>")
    params = SamplingParams(max_tokens=200, temperature=1.0, n=6, seed=11, grammar=g)
    for text, _, reason in engine.generate([prompt(tok)], params, timeout=120):
        assert reason == "stop" and text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
        call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
        assert sum(jsonschema.Draft202012Validator(s).is_valid(call) for s in schemas) == 1, call


def collect(engine, jobs):
    """Submit every (prompts, params) at once (they batch together); the texts of each, in order."""
    results = [None] * len(jobs)

    def run(i, prompts, params):
        results[i] = [t for t, _, _ in engine.generate(prompts, params, timeout=120)]

    threads = [threading.Thread(target=run, args=(i, *j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert None not in results
    return results


def test_free_rows_beside_constrained_rows_give_their_solo_text(tok):
    eng = Engine(tiny_model(tok), tok.decode, max_batch_size=8)
    free = [([prompt(tok)], SamplingParams(max_tokens=30, temperature=0.0)),
            ([tok.encode("the quick")], SamplingParams(max_tokens=30, temperature=1.0, seed=9, n=2))]
    with eng:
        alone = collect(eng, free)
        constrained = [([prompt(tok)], SamplingParams(max_tokens=60, temperature=1.0, seed=s, n=2,
                                                    grammar=json_grammar(tok, SCHEMAS[s]))) for s in range(3)]
        mixed = collect(eng, free + constrained)
    assert eng.peak_batch > 3  # they did share steps
    assert mixed[: len(free)] == alone


def test_n_choices_have_independent_states(tok, engine):
    schema = SCHEMAS[1]
    g = json_grammar(tok, schema)
    many = engine.generate([prompt(tok)], SamplingParams(max_tokens=100, n=3, seed=40, grammar=g),
                           timeout=120)
    solo = [engine.generate([prompt(tok)], SamplingParams(max_tokens=100, seed=40 + j, grammar=g),
                            timeout=120)[0] for j in range(3)]
    assert many == solo  # choice j is the request seeded 40 + j alone: no state leaks between choices
    assert len({t for t, _, _ in many}) > 1
    for text, _, _ in many:
        jsonschema.validate(json.loads(text), schema)


def test_padded_vocabulary_never_samples_past_the_tokenizer(tok):
    with Engine(tiny_model(tok, vocab_pad=37), tok.decode, max_batch_size=2) as eng:
        params = SamplingParams(max_tokens=100, temperature=1.0, n=4, seed=1,
                                grammar=json_grammar(tok, SCHEMAS[2]))
        for text, _, reason in eng.generate([prompt(tok)], params, timeout=120):
            assert reason == "stop" and json.loads(text)["color"] in ("red", "green", "blue")


@pytest.mark.parametrize("bad, match", [
    ({"type": "foo"}, "Invalid type"),
    ({"not": {"type": "integer"}}, "not"),  # strict: a keyword that cannot be enforced is refused
    ([1, 2], "JSON object"),
    ({"enum": ["x" * 100] * 1000}, "bytes"),
    ({"type": "array", "items": json.loads('{"items": ' * 40 + "{}" + "}" * 40)}, "nested"),
])
def test_bad_schemas_are_refused(tok, bad, match):
    with pytest.raises(GrammarError, match=match):
        json_grammar(tok, bad)


def test_non_strict_enforces_what_it_can(tok):
    g = json_grammar(tok, {"type": "object", "properties": {"a": {"not": {"type": "integer"}}}}, strict=False)
    m = g.matcher()
    assert m.allowed()[tok.encode("{")[0]] and not m.allowed()[tok.encode("[")[0]]


def test_bad_patterns_and_tags_are_refused(tok):
    for bad in ("[a-", "", "a" * (G.MAX_PATTERN_CHARS + 1)):
        with pytest.raises(GrammarError, match="pattern"):
            regex_grammar(tok, bad)
    with pytest.raises(GrammarError, match="schemas"):
        tagged_json_grammar(tok, "<a>", [], "</a>")
    with pytest.raises(GrammarError, match="begin"):
        tagged_json_grammar(tok, "x" * 1000, [{}], "</a>")


def test_accept_refuses_a_token_the_grammar_does_not_allow(tok):
    m = json_grammar(tok, SCHEMAS[2]).matcher()
    with pytest.raises(GrammarError, match="not allowed"):
        m.accept(tok.encode("x")[0])


def test_imported_transformers_tokenizer(tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf, eos_token="<|endoftext|>")
    m = json_grammar(hf, SCHEMAS[2]).matcher()
    ids = hf.encode('{"color": "green"}', add_special_tokens=False)
    for t in ids:
        m.accept(t)
    assert m.done()


def test_missing_extra_names_it(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(LmforgeError, match=r"lmforge\[structured\]"):
        regex_grammar(object(), "a")
