"""Rendering a chat template under a work budget: the Jinja environment, the renders themselves, and the
worker process that runs them for templates lmforge did not write.

A template from someone else's model dir is code. Jinja's sandbox stops it from reaching Python's
internals but not from working: nested loops, `'x' * 10**10`, `9**9**9`, padding a string to a billion
characters. Two layers bound that work:

  - in the environment (a first layer, for a fast and precise message): repetition (`*`), padding and
    format widths (`ljust`, `center`, `'%99999999s'`, `'{:>99999999}'`, the `format`, `center` and
    `indent` filters), `replace` that multiplies a string, integer powers and products past
    MAX_INT_BITS, `range` past RANGE_FLOOR numbers (plus two per message), and `strftime_now` formats
    past MAX_DATE_FORMAT characters are refused before Python starts on them;
  - everything else (C-level work that cannot be interrupted once started, loops that do not end,
    doubling a string with `~` in a loop) is bounded by the process: an untrusted template renders in
    this file run as a worker (`python -I template_sandbox.py`, importing nothing of lmforge or torch),
    whose address space is limited (RLIMIT_AS) and which its parent kills when a render outlives its
    deadline (lmforge.data.template_pool). A SIGALRM with its default action is the worker's own
    backstop should the parent be gone.

Renders stream: the output stops at `limit` characters (what the caller can use: a sequence length's
worth of text), so a 100,000-turn conversation costs what its first turns cost.

Protocol (one JSON line each way, UTF-8 with surrogates passed through): the worker writes "ready",
then for each request {"source", "specials", "seconds", "jobs": [job, ...]} answers one line per job,
in order, as each finishes: {"text", "spans", "complete"} or {"error", "kind"}; a "spans" job that
renders prefixes also writes PROGRESS after each, and `seconds` bound each render, not the job. A job is
{"op": "compile", "kind"}, {"op": "render", "messages", "gen", "limit"}, {"op": "spans", "messages",
"limit"} or {"op": "task", "context", "limit"} (a task file's template with a document's fields); a
render or spans job may add "tools", the conversation's function definitions.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from functools import lru_cache
from typing import Any

MAX_BUILT = 1 << 20  # characters one repetition, padding or format width may build
MAX_INT_BITS = 1 << 16  # bits of an integer a power or product may make
RANGE_FLOOR = 10_000  # numbers a range may hold, plus two per message
MAX_DATE_FORMAT = 256  # characters of a strftime_now format
REGEX_SECONDS = 1.0  # one regex_replace call in a task template (utils/safe_regex.py's budget)
MEMORY_BUDGET = 1 << 30  # bytes of address space a worker may add, beyond 8x its request
PROGRESS = b"0"  # the line a worker writes after each prefix render of a long conversation
_MARKER = re.compile("\x00gen(\\d+)\x00")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class RenderFailure(Exception):
    """What went wrong, in words for the user (the caller names the template). `kind`: compile, render,
    prefix (assistant turns cannot be found by rendering prefixes) or memory."""

    kind = "render"


class CompileFailure(RenderFailure):
    kind = "compile"


class PrefixMismatch(RenderFailure):
    kind = "prefix"


class BudgetExceeded(RenderFailure):
    """An operation the first layer refuses (raised inside Jinja, which passes it through)."""


def has_generation_tag(source: str) -> bool:
    return _GENERATION_TAG.search(source) is not None


# -- the first layer: checks on the operations that build big values ---------------------------------
def _refuse(what: str, size: int, limit: int = MAX_BUILT, unit: str = "characters") -> None:
    if size > limit:
        raise BudgetExceeded(f"{what} would make {size:,} {unit} (at most {limit:,}); a chat template "
                             "renders messages, it does not build large values")


def _check_repeat(left: Any, right: Any) -> None:
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            _refuse("repeating with '*'", len(seq) * max(n, 0), MAX_BUILT,
                    "characters" if isinstance(seq, str) else "items")
    if isinstance(left, int) and isinstance(right, int):
        _refuse("multiplying integers", left.bit_length() + right.bit_length(), MAX_INT_BITS, "bits")


def _check_power(base: Any, exp: Any) -> None:
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        _refuse("'**'", base.bit_length() * exp, MAX_INT_BITS, "bits")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _check_widths(numbers: list[str], args: Any) -> None:
    for n in numbers:
        if n and n.isdigit():
            _refuse("a format width", int(n))
    if "*" in numbers:  # widths taken from the arguments
        values = args if isinstance(args, tuple) else (args,)
        for v in values:
            if isinstance(v, int):
                _refuse("a format width", v)


def _check_percent(fmt: Any, args: Any) -> None:
    if isinstance(fmt, str):
        numbers = [n for m in _PERCENT_SPEC.finditer(fmt) for n in m.groups() if n]
        _check_widths(numbers, args)


def _check_brace(fmt: str) -> None:
    for m in _BRACE_SPEC.finditer(fmt):
        for n in re.findall(r"\d+", m.group(1)):
            _refuse("a format width", int(n))


def _check_replace(s: str, old: Any, new: Any, count: Any = -1) -> None:
    if not (isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return
    hits = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    # Growth in proportion to the text (indenting every line) is a template's business; a string
    # multiplied by itself is not.
    _refuse("'replace'", len(s) + hits * (len(new) - len(old)), 4 * len(s) + MAX_BUILT)


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format in its own function
    s, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if not isinstance(s, str):
        return
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        _refuse(f"'{name}'", args[0])
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _refuse("'expandtabs'", len(s) + s.count("\t") * size)
    elif name == "replace" and len(args) >= 2:
        _check_replace(s, *args[:3])
    elif name in ("format", "format_map"):
        _check_brace(s)


def _range(limit: int):
    def bounded(*args: int) -> range:
        rng = range(*args)
        _refuse("'range'", len(rng), limit, "numbers")
        return rng

    return bounded


@lru_cache(maxsize=64)
def compile_template(source: str, kind: str = "chat"):
    """The compiled template (CompileFailure with the template's line when it does not compile). kind:
    "chat" (a chat template, as transformers renders it) or "task" (an eval task file's doc_to_text and
    the like, as lm-evaluation-harness renders them: undefined names are errors, trailing newlines kept,
    its `regex_replace` filter)."""
    import jinja2

    try:
        return _environment(kind).from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise CompileFailure(f"{e.message} (template line {e.lineno})") from None
    except RecursionError:
        raise CompileFailure("it is nested too deeply") from None


def _budgeted_filters() -> dict:
    """Jinja's `format`, `center`, `indent` and `replace` filters, each refusing (BudgetExceeded) a width
    or a replacement that would build more than MAX_BUILT characters before Jinja's own filter runs."""
    from jinja2.filters import do_center, do_format, do_indent, do_replace

    def format_filter(value, *args, **kwargs):
        _check_percent(value, args or tuple(kwargs.values()))
        return do_format(value, *args, **kwargs)

    def center(value, width=80):
        if isinstance(width, int):
            _refuse("'center'", width)
        return do_center(value, width)

    def indent(s, width=4, first=False, blank=False):
        if isinstance(width, int):
            _refuse("'indent'", width)
        elif isinstance(width, str):
            _check_replace(str(s), "\n", "\n" + width)
        return do_indent(s, width, first, blank)

    def replace(eval_ctx, s, old, new, count=None):
        _check_replace(str(s), old, new, -1 if count is None else count)
        return do_replace(eval_ctx, s, old, new, count)

    replace.jinja_pass_arg = do_replace.jinja_pass_arg  # it takes the eval context, as Jinja's does
    return dict(format=format_filter, center=center, indent=indent, replace=replace)


def _regex_replace(s, pattern, repl, count=0):
    """The harness's filter, under REGEX_SECONDS a call where the `regex` package is installed (it
    reads Python's patterns and can stop a match); the worker's deadline bounds it anyway."""
    if not (isinstance(s, str) and isinstance(pattern, str) and isinstance(repl, str)):
        raise BudgetExceeded("regex_replace takes a text, a pattern and a replacement, all strings")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise BudgetExceeded(f"regex_replace's count must be a whole number >= 0, got {count!r}")
    try:
        import regex
    except ImportError:
        return re.sub(pattern, repl, s, count=count)
    try:
        return regex.sub(pattern, repl, s, count=count, timeout=REGEX_SECONDS)
    except TimeoutError:
        raise BudgetExceeded(f"regex_replace: the regex {pattern[:100]!r} ran past its "
                             f"{REGEX_SECONDS:g} s budget on a {len(s):,}-character text") from None


@lru_cache(maxsize=2)
def _environment(kind: str = "chat"):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records the text its body renders to and outputs a
        marker in its place, which the render swaps back while noting where it landed."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(
                self.call_method("_span", [jinja2.nodes.ContextReference()]), [], [], body
            ).set_lineno(lineno)

        def _span(self, context, caller):
            text = caller()
            spans = context.get("__spans__")
            if spans is not None:
                spans.append(text)
                return f"\x00gen{len(spans) - 1}\x00"
            return text

    class Budgeted(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                _check_repeat(left, right)
            elif operator == "**":
                _check_power(left, right)
            elif operator == "%":
                _check_percent(left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
            _check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        if isinstance(fmt, str):
            _refuse("a strftime_now format", len(fmt), MAX_DATE_FORMAT)
        return datetime.now().strftime(fmt)

    budgeted = _budgeted_filters()
    if kind == "task":
        env = Budgeted(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        env.filters.update(regex_replace=_regex_replace, **budgeted)
        env.globals["range"] = _range(RANGE_FLOOR)
        return env
    env = Budgeted(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters.update(tojson=tojson, **budgeted)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


# -- renders ----------------------------------------------------------------------------------------
def _collect(stream, limit: int, edit=None) -> tuple[str, bool]:
    """(text, complete): a template's output stream read until it ends or passes `limit` characters;
    `edit(piece, length so far)` may rewrite each piece. Any error of the template's is a RenderFailure."""
    import jinja2

    out: list[str] = []
    length, complete = 0, True
    try:
        for piece in stream:
            if edit is not None:
                piece = edit(piece, length)
            out.append(piece)
            length += len(piece)
            if length > limit:
                complete = False
                break
    except RenderFailure:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise RenderFailure(str(e)) from None
    except MemoryError:
        raise
    except Exception as e:  # a template is code: any error in it is the template's, reported as such
        raise RenderFailure(f"{type(e).__name__}: {e}") from None
    finally:
        stream.close()
    return "".join(out)[:limit], complete


def render(source: str, specials: dict[str, str], messages: list[dict], add_generation_prompt: bool,
           limit: int, track: bool = False, tools: list[dict] | None = None
           ) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, spans, complete): the first `limit` characters of the conversation rendered by `source`;
    `complete` is False when there was more. track: the (start, end) spans of its generation blocks.
    tools: the conversation's function definitions, the template's `tools` (unset when None)."""
    template = compile_template(source)
    bodies: list[str] = []
    variables: dict[str, Any] = {
        **specials,
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "range": _range(RANGE_FLOOR + 2 * len(messages)),
    }
    if tools is not None:
        variables["tools"] = tools
    spans: list[tuple[int, int]] = []
    edit = None
    if track:
        variables["__spans__"] = bodies
        edit = lambda piece, at: _swap_markers(piece, bodies, at, spans) if "\x00" in piece else piece  # noqa: E731
    text, complete = _collect(template.generate(**variables), limit, edit)
    if not complete:
        spans = [(a, min(b, limit)) for a, b in spans if a < limit]
    return text, spans, complete


def render_task(source: str, context: dict[str, Any], limit: int) -> tuple[str, bool]:
    """(text, complete): the first `limit` characters of a task template rendered with `context` (a
    document's fields)."""
    return _collect(compile_template(source, "task").generate(**context), limit)


def _swap_markers(piece: str, bodies: list[str], at: int, spans: list[tuple[int, int]]) -> str:
    """`piece` with each generation marker replaced by the text of its block; the blocks' spans
    (offset by `at`, where the piece starts) appended to `spans`. A marker the template dropped or
    mangled gives no span."""
    parts, pos = [], 0
    for m in _MARKER.finditer(piece):
        i = int(m.group(1))
        if i >= len(bodies):
            continue
        parts.append(piece[pos : m.start()])
        at += len(parts[-1])
        parts.append(bodies[i])
        spans.append((at, at + len(bodies[i])))
        at += len(bodies[i])
        pos = m.end()
    parts.append(piece[pos:])
    return "".join(parts)


def assistant_spans(source: str, specials: dict[str, str], messages: list[dict], limit: int,
                    progress=lambda: None, tools: list[dict] | None = None
                    ) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, spans, complete) of the conversation cut at `limit` characters, with the spans of the
    assistant turns that start before the cut (see lmforge.data.chat_template). Without generation
    tags each turn costs two more renders; `progress()` is called after each, so that the deadline
    can be one render's (many short turns are work in proportion, not a loop)."""
    if has_generation_tag(source):
        return render(source, specials, messages, False, limit, track=True, tools=tools)
    text, _, complete = render(source, specials, messages, False, limit, tools=tools)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _, whole = render(source, specials, messages[:k], True, limit, tools=tools)
        if not whole:  # this turn, and every later one, starts past the cut
            break
        through, _, whole = render(source, specials, messages[: k + 1], False, limit, tools=tools)
        if not (through.startswith(before) and text.startswith(through)):
            raise PrefixMismatch(
                "renders earlier turns differently once later ones follow, so the assistant tokens "
                "cannot be found by rendering prefixes; use a template that marks them with "
                "{% generation %} ... {% endgeneration %} (sft.template), or sft.loss_on=all"
            )
        spans.append((len(before), len(through)))
        if not whole:
            break
        progress()
    return text, spans, complete


def run_job(source: str, specials: dict[str, str], job: dict, progress=lambda: None) -> dict:
    """One job of the protocol above, answered as a dict (errors included)."""
    try:
        if job["op"] == "compile":
            compile_template(source, job.get("kind", "chat"))
            return {"text": "", "spans": [], "complete": True}
        if job["op"] == "task":
            text, complete = render_task(source, job["context"], job["limit"])
            return {"text": text, "spans": [], "complete": complete}
        if job["op"] == "spans":
            text, spans, complete = assistant_spans(source, specials, job["messages"], job["limit"],
                                                    progress, job.get("tools"))
        else:
            text, spans, complete = render(source, specials, job["messages"], job["gen"], job["limit"],
                                           tools=job.get("tools"))
    except RenderFailure as e:
        return {"error": str(e), "kind": e.kind}
    except MemoryError:
        return {"error": "", "kind": "memory"}
    except RecursionError:
        return {"error": "RecursionError: it recurses too deeply", "kind": "render"}
    return {"text": text, "spans": spans, "complete": complete}


# -- the worker ---------------------------------------------------------------------------------------
def _address_space() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _limit_memory(resource, extra: int) -> None:
    try:
        now = _address_space()
    except (OSError, ValueError):  # no /proc (not Linux): the deadline alone bounds the render
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = now + MEMORY_BUDGET + extra
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_AS, (want, hard))


def serve_forever() -> None:
    """The worker's loop: requests from stdin, one answer per job on stdout, until stdin closes."""
    import math
    import resource
    import signal

    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the backstop kills the process, C code or not
    _environment()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    out.write(b'"ready"\n')
    out.flush()
    backstop = [0]  # seconds: the request's deadline and a margin

    def progress() -> None:  # one render done: the parent's deadline (and the backstop) start again
        out.write(PROGRESS + b"\n")
        out.flush()
        signal.alarm(backstop[0])

    while line := inp.readline():
        _limit_memory(resource, 8 * len(line))
        request = json.loads(line.decode("utf-8", "surrogatepass"))
        backstop[0] = math.ceil(request["seconds"]) + 2
        for job in request["jobs"]:
            signal.alarm(backstop[0])
            answer = run_job(request["source"], request["specials"], job, progress)
            signal.alarm(0)
            out.write(json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
            out.flush()
            if answer.get("kind") == "memory":  # what failed to allocate may have left a half state
                return


if __name__ == "__main__":
    serve_forever()
