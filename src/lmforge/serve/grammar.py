"""Constrained decoding for the serving engine: JSON schemas, regular expressions and tagged JSON (tool
calls) compiled into token masks by llguidance (the `lmforge[structured]` extra).

Why llguidance (bench/constrained_decode.py, numbers in bench/results/constrained_decode.json): a serving
request brings a new schema each time, so compile time is paid on the request's latency. llguidance
computes each step's mask lazily from the parser state over a token trie: compiling takes about a
millisecond whatever the vocabulary (65k ids: ~1 ms median over 6 schemas, where xgrammar took
20-80 ms and 0.6-1 s for a nested one, and outlines-core 140-490 ms and up to 0.7 s), for a per-step mask
of ~35-40 us at p50 (xgrammar and outlines-core, having precomputed, answer in 1-3 us, but xgrammar's p99
was 3-11 ms on that vocabulary). In lmforge's engine, a batch of 8 constrained rows spent ~5% of its
time masking (demo model: 0.9x the free batch's tokens/s; half free, half constrained: 0.98x).
It implements the JSON-schema keywords OpenAI's strict mode uses and names the ones it does not
(refused in strict mode), and it bounds its own work per compile and per step (lexer fuel).

The shape of the API: a `Grammar` is compiled once per request and shared by its choices; each choice
takes its own `Matcher` (independent states for n > 1). The engine masks a whole batch at once with
`mask_logits_` (one int32 bitmask row per constrained row, unpacked by numpy in one pass, never a Python
loop over the vocabulary); `Matcher.allowed()` gives one row's mask as a bool tensor.
A matcher never allows the tokenizer's EOS itself: the engine ends a constrained reply when `done()`
(nothing but the end can follow) or, once the grammar `accepting()`, through the request's stop tokens,
which `mask_logits_` allows exactly then.

JSON is written compactly (", " and ": " separators, no other whitespace between the tokens of the
value): a grammar that let the model choose whitespace would let a weak model pad a reply with newlines
until max_tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from lmforge.errors import LmforgeError

MAX_SCHEMA_BYTES = 64 * 1024  # a JSON schema's size as compact JSON
MAX_SCHEMA_DEPTH = 32  # nesting of objects/arrays in a schema document
MAX_PATTERN_CHARS = 4096  # a regular expression's length
MAX_TAGGED_SCHEMAS = 128  # alternatives of a tagged grammar (tools of one request)
MAX_TAG_CHARS = 256  # the begin / end (and sep / gap) literals of a tagged grammar
MAX_TAGGED_ITEMS = 64  # values of a tagged grammar taking several (tool calls: tools.py's MAX_CALLS)
MAX_CACHED_TOKENIZERS = 8
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(LmforgeError):
    """A schema, pattern or grammar that cannot be compiled (or is over a bound), or a token the
    grammar does not allow."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise LmforgeError("structured output (response_format, tool_choice required) needs llguidance: "
                           "pip install 'lmforge[structured]'") from None
    return llguidance


def _limits():
    # verbose_errors=False: an error names what is wrong, not the parser state (no grammar echoed back).
    # The fuel limits bound the work of a compile and of every step: initial_lexer_fuel at a fifth of
    # llguidance's default still compiles a 27 kB schema of 200 properties (patterns, enums, arrays) in
    # ~40 ms, and keeps a hostile `(a{1000}){1000}` under a second instead of several.
    return _llguidance().LLParserLimits(verbose_errors=False, initial_lexer_fuel=200_000,
                                        max_grammar_size=200_000, max_lexer_states=100_000)


# -- the tokenizer adapter ------------------------------------------------------------------------------
_TABLES: dict[int, tuple[object, object, int]] = {}  # id(tokenizer) -> (tokenizer, LLTokenizer, vocab)


def token_table(tokenizer) -> tuple[object, int]:
    """llguidance's view of `tokenizer` (the bytes of every id, and EOS) and its vocabulary size, cached per
    tokenizer object (building it walks the whole vocabulary: ~1 s for 65k ids on a 2-core CPU).

    `tokenizer`: an lmforge Tokenizer, a `tokenizers.Tokenizer`, a path to a tokenizer.json or a
    transformers fast tokenizer (an imported model's)."""
    hit = _TABLES.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1], hit[2]
    from lmforge.data.tokenizer import Tokenizer

    llg = _llguidance()
    tok = Tokenizer.of(tokenizer)
    vocab = tok.vocab_size
    table = llg.LLTokenizer(tok.hf.to_str(), n_vocab=vocab, eos_token=tok.eos_id)
    if len(_TABLES) >= MAX_CACHED_TOKENIZERS:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[id(tokenizer)] = (tokenizer, table, vocab)  # holding the object keeps its id from reuse
    return table, vocab


# -- grammars -------------------------------------------------------------------------------------------
class Grammar:
    """A compiled grammar over one tokenizer: compiled once per request, shared by its choices."""

    def __init__(self, tokenizer, source: str, what: str) -> None:
        llg = _llguidance()
        self.table, self.vocab_size = token_table(tokenizer)
        self.eos_id = int(self.table.eos_token)
        t0 = time.perf_counter()
        self._proto = llg.LLMatcher(self.table, source, log_level=0, limits=_limits())
        if not self._proto.is_error():
            # The first mask builds the lexer's states lazily (seconds for a hostile `(a{1000}){1000}`):
            # here, in the compiling thread, not in a decode step of the batch; the matchers copied from
            # the prototype share what it built.
            first = torch.zeros(_words(self.vocab_size), dtype=torch.int32)
            self._proto.unsafe_compute_mask_ptr(first.data_ptr(), first.numel() * 4)
        self.compile_s = time.perf_counter() - t0
        if self._proto.is_error():
            raise GrammarError(f"{what}: {_first_line(self._proto.get_error())}")

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar (one per choice)."""
        return Matcher(self, self._proto.deep_copy())


class Matcher:
    """Where one choice stands in its grammar."""

    def __init__(self, grammar: Grammar, m) -> None:
        self.grammar, self._m = grammar, m

    def allowed(self) -> torch.Tensor:
        """Bool (vocab_size,): the tokens the grammar allows next (the tokenizer's EOS never: see the
        module docstring)."""
        bits = torch.zeros((1, _words(self.grammar.vocab_size)), dtype=torch.int32)
        self._fill(bits[0])
        return _unpack(bits, self.grammar.vocab_size)[0]

    def accept(self, token: int) -> None:
        """Advance by `token`; a token the grammar does not allow is a GrammarError (the matcher is then
        unusable)."""
        if not self._m.consume_token(int(token)) or self._m.is_error():
            raise GrammarError(f"token {int(token)} is not allowed by the grammar here"
                               f" ({_first_line(self._m.get_error())})")

    def accepting(self) -> bool:
        """The text so far is a complete match (the reply may end here, or go on)."""
        return self._m.is_accepting()

    def done(self) -> bool:
        """The grammar is complete: nothing but the end of the reply may follow."""
        return self._m.is_stopped()

    def _fill(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask into `row` (int32, contiguous, on the CPU), EOS bit cleared."""
        if self._m.is_error():
            raise GrammarError(f"the grammar failed: {_first_line(self._m.get_error())}")
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        eos = self.grammar.eos_id
        if eos < self.grammar.vocab_size:
            word = int(row[eos // 32]) & 0xFFFFFFFF & ~(1 << (eos % 32))
            row[eos // 32] = word - (1 << 32) if word >= 1 << 31 else word  # back to a signed int32


def json_grammar(tokenizer, schema: dict | None, strict: bool = True) -> Grammar:
    """Replies that are one JSON value valid against `schema` (None: any JSON object, OpenAI's json_object
    mode). strict: a keyword the engine cannot enforce is a GrammarError; strict=False enforces the
    keywords it can and ignores the others (OpenAI's non-strict json_schema guarantees no more)."""
    if schema is None:
        schema = {"type": "object"}
    _check_schema(schema, "schema")
    llg = _llguidance()
    try:
        source = llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={**_JSON_OPTIONS, "lenient": not strict})
    except ValueError as e:
        raise GrammarError(f"schema: {_first_line(str(e))}") from None
    return Grammar(tokenizer, source, "schema")


def regex_grammar(tokenizer, pattern: str) -> Grammar:
    """Replies that match the regular expression `pattern` as a whole (Rust regex syntax: no
    backreferences or lookaround)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("pattern: give a non-empty regular expression string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise GrammarError(f"pattern: {len(pattern)} characters, more than the {MAX_PATTERN_CHARS} allowed")
    return Grammar(tokenizer, _llguidance().LLMatcher.grammar_from_regex(pattern), "pattern")


def tagged_json_grammar(tokenizer, begin: str, schemas: list[dict], end: str, *, max_items: int = 1,
                        sep: str | None = None, gap: str = "") -> Grammar:
    """The literal `begin`, then one JSON value valid against one of `schemas`, then the literal `end`
    (tool calls: begin="<tool_call>\\n", end="\\n</tool_call>").

    max_items > 1: one to max_items values, written as the template writes several calls: `sep` given,
    one `begin` with the values joined by `sep` before one `end` (Mistral's "[TOOL_CALLS][a, b]"); else
    each value in its own begin/end, the wrappings joined by `gap` (Hermes' "\\n")."""
    for name, s in (("begin", begin), ("end", end), ("sep", sep or ""), ("gap", gap)):
        if not isinstance(s, str) or len(s) > MAX_TAG_CHARS:
            raise GrammarError(f"{name}: give a string of at most {MAX_TAG_CHARS} characters")
    if not schemas or len(schemas) > MAX_TAGGED_SCHEMAS:
        raise GrammarError(f"schemas: give 1 to {MAX_TAGGED_SCHEMAS} schemas, got {len(schemas)}")
    if not 1 <= max_items <= MAX_TAGGED_ITEMS:
        raise GrammarError(f"max_items: give 1 to {MAX_TAGGED_ITEMS}, got {max_items}")
    for i, s in enumerate(schemas):
        _check_schema(s, f"schemas[{i}]")
    if sum(len(json.dumps(s)) for s in schemas) > MAX_SCHEMA_BYTES * 4:
        raise GrammarError(f"schemas: more than {MAX_SCHEMA_BYTES * 4} bytes of schemas in all")
    alts = " | ".join("%json" + json.dumps({**s, "x-guidance": {**_JSON_OPTIONS, "lenient": False}})
                      for s in schemas)

    def lit(t: str) -> list[str]:  # a JSON string is a Lark string literal; Lark has no empty one
        return [json.dumps(t)] if t else []

    body = f"({alts})"
    if max_items == 1:
        source = "start: " + " ".join(lit(begin) + [body] + lit(end))
    elif sep is not None:  # the rule `item` is written once: its alternatives compile once for all items
        source = (f"start: {' '.join(lit(begin) + ['item'])} ({' '.join(lit(sep) + ['item'])})"
                  f"{{0,{max_items - 1}}} {' '.join(lit(end))}\nitem: {body}")
    else:
        source = (f"start: wrapped ({' '.join(lit(gap) + ['wrapped'])}){{0,{max_items - 1}}}\n"
                  f"wrapped: {' '.join(lit(begin) + [body] + lit(end))}")
    return Grammar(tokenizer, source, "schemas")


def _check_schema(schema, where: str) -> None:
    """Size and depth bounds on an untrusted schema, before the compiler sees it."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{where}: a JSON schema is a JSON object, got {type(schema).__name__}")
    try:
        size = len(json.dumps(schema, separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{where}: not JSON ({e})") from None
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{where}: {size} bytes, more than the {MAX_SCHEMA_BYTES} allowed")
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{where}: nested more than {MAX_SCHEMA_DEPTH} levels deep")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


# -- masking a batch ------------------------------------------------------------------------------------
def mask_logits_(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Matcher],
                 stop_ids: Sequence[Iterable[int]]) -> dict[int, str]:
    """Set to -inf, in place, every logit of `logits` (B, V) rows `rows` that matchers[j] does not allow;
    row j's `stop_ids[j]` are allowed exactly when its grammar is accepting. Ids past the tokenizer's
    vocabulary (a padded embedding) are never allowed. Rows not listed are untouched.

    Returns {j: why} for the matchers that failed (a grammar over its per-step work bound, or one that
    allows nothing): their rows are left as they were, for the caller to end with an error, so that one
    failing grammar does not take the rest of the batch with it."""
    if not rows:
        return {}
    vocab = matchers[0].grammar.vocab_size
    bits = torch.zeros((len(rows), _words(vocab)), dtype=torch.int32)
    failed: dict[int, str] = {}
    for j, (m, stops) in enumerate(zip(matchers, stop_ids)):
        assert m.grammar.vocab_size == vocab, "one tokenizer per batch"
        try:
            m._fill(bits[j])
        except GrammarError as e:
            failed[j] = str(e)
            continue
        ids = [t for t in stops if 0 <= t < vocab]
        if ids and m.accepting():
            _set_bits(bits[j], ids)
    for j in (bits == 0).all(dim=1).nonzero().flatten().tolist():
        failed.setdefault(j, "the grammar allows no token here (and no stop token ends the reply)")
    V = logits.shape[1]
    # (k, min(V, vocab)) bool, moved to the logits' device in one copy; the bits past vocab are never set
    blocked = _unpack(~bits, min(V, vocab)).to(logits.device, non_blocking=True)
    for j, i in enumerate(rows):
        if j not in failed:
            row = logits[i]
            row[: blocked.shape[1]].masked_fill_(blocked[j], float("-inf"))
            row[vocab:] = float("-inf")
    return failed


def _words(vocab: int) -> int:
    return (vocab + 31) // 32


def _set_bits(row: torch.Tensor, ids: Iterable[int]) -> None:
    """Set the bits of token `ids` in one int32 bitmask row."""
    for t in ids:
        word = int(row[t // 32]) & 0xFFFFFFFF | 1 << (t % 32)
        row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # back to a signed int32


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(k, words) int32 bitmasks -> (k, vocab) bool, bit i of word w being token 32 w + i (numpy's
    unpackbits: one pass over bytes, ~10x faster than shifting 32 lanes in torch)."""
    b = bits.numpy().astype("<i4", copy=False).view(np.uint8)  # little-endian: byte 4w+i = tokens 32w+8i..
    return torch.from_numpy(np.unpackbits(b, axis=1, bitorder="little")).view(torch.bool)[:, :vocab]


def _first_line(msg: str) -> str:
    """The compiler's message on one line (it spreads a regex error over several, with a caret)."""
    return " ".join(line.strip() for line in (msg or "invalid").strip().splitlines() if line.strip())[:300]
