"""Constrained decoding for the serving engine: JSON schemas, regular expressions and tagged JSON (tool
calls) compiled into token masks by llguidance (the `lmforge[structured]` extra).

Why llguidance (bench/constrained_decode.py, bench/results/constrained_decode.json): its per-step mask
is computed lazily from the parser state over a token trie, so a grammar costs no up-front work over
the vocabulary (compile in milliseconds, also for a 100k+ vocabulary, where xgrammar precomputes per
grammar and outlines-core builds a whole-vocabulary index), and the mask of one step takes tens of
microseconds; it implements the JSON-schema keywords OpenAI's strict mode uses and says which ones it
does not (refused in strict mode), and it bounds its own work per step (lexer fuel), so a hostile
grammar cannot stall the batch.

The shape of the API: a `Grammar` is compiled once per request and shared by its choices; each choice
takes its own `Matcher` (independent states for n > 1). The engine masks a whole batch at once with
`mask_logits_` (one int32 bitmask row per constrained row, unpacked with tensor ops, never a Python loop
over the vocabulary); `Matcher.allowed()` gives one row's mask as a bool tensor for everything else.
A matcher never allows the tokenizer's EOS itself: the engine ends a constrained reply when `done()`
(nothing but the end can follow) or, once the grammar `accepting()`, through the request's stop tokens,
which `mask_logits_` allows exactly then.

Output is compact JSON (", " and ": " separators, no other whitespace between tokens of the value):
a grammar that let the model pick whitespace would let a weak model pad a reply with newlines until
max_tokens, and OpenAI's JSON mode output is compact too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence

import torch

from lmforge.errors import LmforgeError

MAX_SCHEMA_BYTES = 64 * 1024  # a JSON schema's size as compact JSON
MAX_SCHEMA_DEPTH = 32  # nesting of objects/arrays in a schema document
MAX_PATTERN_CHARS = 4096  # a regular expression's length
MAX_TAGGED_SCHEMAS = 128  # alternatives of a tagged grammar (tools of one request)
MAX_TAG_CHARS = 256  # the begin / end literals of a tagged grammar
MAX_CACHED_TOKENIZERS = 8
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SHIFTS = torch.arange(32, dtype=torch.int32)


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
    # verbose_errors=False: an error names what is wrong, not the parser state (no grammar echoed back);
    # the fuel limits bound compile work and the work of every step (the defaults: ~20 ms and ~15 ms).
    return _llguidance().LLParserLimits(verbose_errors=False, max_grammar_size=200_000,
                                        max_lexer_states=100_000)


# -- the tokenizer adapter ------------------------------------------------------------------------------
_TABLES: dict[int, tuple[object, object, int]] = {}  # id(tokenizer) -> (tokenizer, LLTokenizer, vocab)


def token_table(tokenizer) -> tuple[object, int]:
    """llguidance's view of `tokenizer` (the bytes of every id, and EOS) and its vocabulary size, cached per
    tokenizer object (building it walks the whole vocabulary: ~1 s for 150k ids).

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
            clear = ~(1 << (eos % 32)) & 0xFFFFFFFF  # as a signed int32: bit 31 is the sign
            row[eos // 32] &= clear - (1 << 32) if clear >= 1 << 31 else clear


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


def tagged_json_grammar(tokenizer, begin: str, schemas: list[dict], end: str) -> Grammar:
    """The literal `begin`, then one JSON value valid against one of `schemas`, then the literal `end`
    (tool calls: begin="<tool_call>\\n", end="\\n</tool_call>")."""
    for name, s in (("begin", begin), ("end", end)):
        if not isinstance(s, str) or len(s) > MAX_TAG_CHARS:
            raise GrammarError(f"{name}: give a string of at most {MAX_TAG_CHARS} characters")
    if not schemas or len(schemas) > MAX_TAGGED_SCHEMAS:
        raise GrammarError(f"schemas: give 1 to {MAX_TAGGED_SCHEMAS} schemas, got {len(schemas)}")
    for i, s in enumerate(schemas):
        _check_schema(s, f"schemas[{i}]")
    if sum(len(json.dumps(s)) for s in schemas) > MAX_SCHEMA_BYTES * 4:
        raise GrammarError(f"schemas: more than {MAX_SCHEMA_BYTES * 4} bytes of schemas in all")
    alts = " | ".join("%json" + json.dumps({**s, "x-guidance": {**_JSON_OPTIONS, "lenient": False}})
                      for s in schemas)
    parts = [json.dumps(t) for t in (begin, end) if t]  # a JSON string is a Lark string literal
    body = f"({alts})"
    source = "start: " + " ".join(([parts[0]] if begin else []) + [body] + ([parts[-1]] if end else []))
    return Grammar(tokenizer, source, "schemas")


def _check_schema(schema, where: str) -> None:
    """Size and depth bounds on an untrusted schema, before the compiler sees it."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{where}: a JSON schema is a JSON object, got {type(schema).__name__}")
    try:
        size = len(json.dumps(schema, separators=(",", ":")))
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
    for j, m in enumerate(matchers):
        assert m.grammar.vocab_size == vocab, "one tokenizer per batch"
        try:
            m._fill(bits[j])
        except GrammarError as e:
            failed[j] = str(e)
    allowed = _unpack(bits, vocab)  # (k, vocab)
    for j, (m, stops) in enumerate(zip(matchers, stop_ids)):
        ids = [t for t in stops if t < vocab]
        if ids and j not in failed and m.accepting():
            allowed[j, ids] = True
    for j in (~allowed.any(dim=1)).nonzero().flatten().tolist():
        failed.setdefault(j, "the grammar allows no token here (and no stop token ends the reply)")
    allowed[list(failed)] = True
    V = logits.shape[1]
    if V > vocab:
        allowed = torch.cat([allowed, allowed.new_zeros((len(rows), V - vocab))], dim=1)
    index = torch.tensor(list(rows), device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :V].to(logits.device), float("-inf"))
    return failed


def _words(vocab: int) -> int:
    return (vocab + 31) // 32


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(k, words) int32 bitmasks -> (k, vocab) bool, bit i of word w being token 32 w + i."""
    return ((bits.unsqueeze(-1) >> _SHIFTS) & 1).view(bits.shape[0], -1)[:, :vocab].bool()


def _first_line(msg: str) -> str:
    """The compiler's message on one line (it spreads a regex error over several, with a caret)."""
    return " ".join(line.strip() for line in (msg or "invalid").strip().splitlines() if line.strip())[:300]
