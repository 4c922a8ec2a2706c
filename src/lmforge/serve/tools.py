"""Tool calling for the chat route: which tool markup the served chat template writes, the reply's markup
parsed back into OpenAI `tool_calls` (whole, or streamed as deltas), and the grammar that forces a call
(`tool_choice` "required" or a named function).

The markup is learned from the template itself, not from the model's name: a known call is rendered
through it (`detect_markup`) and the JSON object holding the call's name and arguments is found in the
assistant's turn; what comes before it is the call's opening (Qwen/Hermes `<tool_call>\\n`, Mistral
`[TOOL_CALLS][`, nothing for Llama 3.x's bare JSON), what follows it the closing, and the keys that held
the name and the arguments are the keys to read back ("arguments", Llama's "parameters"). Rendering two
calls says how several are written (each wrapped, or a list with a separator) or that the template
takes one only (Llama 3.1 raises). A template whose call cannot be found this way is parsed with the
Hermes markup, the most common one. A template that never reads `tools` (lmforge's ChatML, Qwen2's)
has no tool markup at all: `detect_markup` answers None and the request is refused, because a model
that was never shown a tool format would be handed tools it cannot see (vLLM renders them through such
a template and silently drops them).

Parsing: a call is the opening, then JSON objects {name: a function of the request, arguments: an
object} (joined by the separator), then the closing; the text around the calls is the message's
content (None when only whitespace), trimmed where it meets a call. Anything malformed (bad JSON, an
unknown function, a call cut off by max_tokens) leaves the whole reply as content, never an error.

Streaming (StreamParser): content deltas until an opening may begin (its first characters are held
back), then per call a delta with index, id, type and name once its arguments have begun as an object,
then the arguments' text as it is written; the deltas add up to the unstreamed reply. A call that goes
wrong after its start was sent (cut by max_tokens) cannot be taken back: it stays as sent, and the
choice ends with the engine's finish_reason, not "tool_calls". Llama's bare JSON has no opening to
watch for: a reply that starts with "{" is held until it ends.

tool_choice "required" / a named function: `call_grammar` builds the grammar engine's tagged JSON
(serve/grammar.py) in the template's own markup, one alternative per allowed function, each the
object {name: that name, arguments: its parameters' schema}, so every call parses and validates.
"required" means one call or more (OpenAI's meaning) where several are allowed (parallel_tool_calls
true or absent, and a template that writes several in a markup with an opening): 1 to MAX_CALLS calls
written as the template writes two (each wrapped, joined by the text the template puts between them,
or one list joined by its separator); the model ends the reply after any complete call. With
parallel_tool_calls false, a named function or a template that takes one call: exactly one.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmforge.data.chat_template import ChatTemplate, TemplateError
from lmforge.data.chat_tools import MAX_DEPTH
from lmforge.errors import LmforgeError

MAX_TOOLS = 128  # OpenAI's limit on the functions of one request
MAX_CALLS = 16  # calls of one reply under tool_choice "required" (the grammar ends the reply there)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
MAX_DESCRIPTION_CHARS = 4096
_JSON = json.JSONDecoder()
_PROBE_ARGS = {"probe_arg": "lmforge_value"}
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": name, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string"}},
                   "required": ["probe_arg"]}}}
    for name in ("lmforge_probe", "lmforge_probe_b")]
_PROBE_REPLY = "lmforge probe reply"
_PROBE_IDS = ("lmforge01", "lmforge02")  # 9 alphanumerics: Mistral's templates refuse other ids
_MAX_TAG = 256  # an opening or closing longer than this is not markup we learned


def _decode(text: str, k: int) -> tuple[Any, int]:
    """The JSON value at text[k:] and where it ends; ValueError also for nesting deeper than a call's
    arguments may be (MAX_DEPTH, as in a request): a model can write "[[[[..." until max_tokens, and
    whether json can read that depends on the process's recursion limit, the verdict must not."""
    try:
        value, end = _JSON.raw_decode(text, k)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if _too_deep(value):
        raise ValueError("nested too deep")
    return value, end


def _too_deep(value: Any) -> bool:
    """Whether `value` holds something more than MAX_DEPTH levels down (as ToolBudget counts; iterative)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(v, (dict, list)):
            stack.extend((item, depth + 1) for item in (v.values() if isinstance(v, dict) else v))
    return False


@dataclass(frozen=True)
class Markup:
    """How a template writes tool calls: `begin` {name_key: ..., args_key: {...}} `end`; several calls
    each wrapped (sep None; `gap` between one's end and the next's begin) or inside one begin/end joined
    by `sep`; `parallel`: more than one at all."""

    family: str
    begin: str
    end: str
    name_key: str = "name"
    args_key: str = "arguments"
    sep: str | None = None
    parallel: bool = True
    gap: str = "\n"


HERMES = Markup("hermes", "<tool_call>\n", "\n</tool_call>")


class ToolsRefused(LmforgeError):
    """A request's tools that this server cannot honour; `param`: the request field to name."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are served: rendered into the prompt, and each reply parsed with `markup`.
    mode: "auto", "required" or "named" (`only` the function); parallel: more than one call kept."""

    markup: Markup
    tools: list[dict]
    mode: str
    only: str | None
    parallel: bool

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def plan_tools(tools: list[dict], mode: str, only: str | None, parallel_tool_calls: bool | None,
               markup: Markup | None, template_name: str) -> ToolPlan:
    """The plan for a request with `tools` under `mode`, or ToolsRefused saying why it cannot be served."""
    if markup is None:
        raise ToolsRefused(f"the served chat template ({template_name}) does not render 'tools', so the "
                           "model would never see them; serve a model whose chat template has tool support "
                           "(Qwen 2.5/3, Hermes, Llama 3.1+, Mistral, ...) or leave 'tools' out", "tools")
    if mode == "auto":
        for i, t in enumerate(tools):
            if t["function"].get("strict"):
                raise ToolsRefused(f"tools[{i}].function.strict: true is enforced only when a call is forced "
                                   "(tool_choice 'required' or a named function); with 'auto' the model "
                                   "writes free text or a call, unchecked: leave 'strict' out or force the "
                                   "call", f"tools.{i}.function.strict")
    return ToolPlan(markup, tools, mode, only, parallel_tool_calls is not False and markup.parallel)


class TemplateTools:
    """The served template's tool markup, learned on first use (a render in the template's worker) and
    kept: None when the template does not read `tools`."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self._lock = threading.Lock()
        self._done = False
        self._markup: Markup | None = None

    def markup(self) -> Markup | None:
        with self._lock:
            if not self._done:
                self._markup = detect_markup(self.template)
                self._done = True
            return self._markup


def detect_markup(template: ChatTemplate) -> Markup | None:
    """The markup `template` writes tool calls in (see the module docstring); None when it ignores tools."""
    user = [{"role": "user", "content": "lmforge probe"}]
    tools = _PROBE_TOOLS
    try:
        with_tools, without = template.render_batch([user, user], tools=[tools, None])
        prompt = template.render(user, add_generation_prompt=True, tools=tools)
    except TemplateError:
        return None  # it cannot even render a user's message with tools
    if with_tools.text == without.text and _PROBE_TOOLS[0]["function"]["name"] not in prompt:
        return None
    try:
        reply, called = template.render_batch(
            [user + [{"role": "assistant", "content": _PROBE_REPLY}],
             user + [{"role": "assistant", "tool_calls": [_call(0)]}]], tools=[tools, tools])
    except TemplateError:
        return HERMES  # it reads tools but cannot render a call our way: the common markup
    turn = _turn(prompt, called.text, reply.text)
    found = _find_call(turn, _PROBE_TOOLS[0]["function"]["name"]) if turn is not None else None
    if found is None:
        return HERMES
    start, end, name_key, args_key = found
    begin, close = turn[:start], turn[end:]
    if len(begin) > _MAX_TAG or len(close) > _MAX_TAG or "lmforge" in begin + close:
        return HERMES
    family = ("hermes" if "<tool_call>" in begin else "mistral" if "[TOOL_CALLS]" in begin
              else "json" if not begin.strip() else "template")
    sep, parallel, gap = _several(template, prompt, reply.text, begin, close)
    return Markup(family, begin, close, name_key, args_key, sep, parallel, gap)


def _call(i: int) -> dict:
    return {"id": _PROBE_IDS[i], "type": "function",
            "function": {"name": _PROBE_TOOLS[i]["function"]["name"], "arguments": dict(_PROBE_ARGS)}}


def _turn(prompt: str, called: str, reply: str) -> str | None:
    """The call's part of the assistant turn: `called` after the generation prompt, less what the
    template closes every reply with (what follows the probe reply's text)."""
    if not called.startswith(prompt) or not reply.startswith(prompt) or _PROBE_REPLY not in reply:
        return None
    closing = reply[reply.index(_PROBE_REPLY) + len(_PROBE_REPLY):]
    turn = called[len(prompt):]
    if closing and turn.endswith(closing):
        turn = turn[: -len(closing)]
    elif closing.strip() and turn.endswith(closing.rstrip()):
        turn = turn[: -len(closing.rstrip())]
    return turn


def _find_call(text: str, name: str) -> tuple[int, int, str, str] | None:
    """(start, end, name key, arguments key) of the first JSON object in `text` holding the probe call."""
    for m in re.finditer(r"\{", text):
        try:
            obj, end = _decode(text, m.start())
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        name_key = next((k for k, v in obj.items() if v == name), None)
        args_key = next((k for k, v in obj.items() if v == _PROBE_ARGS or v == json.dumps(_PROBE_ARGS)), None)
        if name_key is not None and args_key is not None:
            return m.start(), end, name_key, args_key
    return None


def _several(template: ChatTemplate, prompt: str, reply: str, begin: str, close: str
             ) -> tuple[str | None, bool, str]:
    """How two calls are written: (None, True, gap) each wrapped, `gap` between them; (sep, True, _) one
    list; (None, False, _) one only."""
    user = [{"role": "user", "content": "lmforge probe"}]
    gap = HERMES.gap
    try:
        called = template.render(user + [{"role": "assistant", "tool_calls": [_call(0), _call(1)]}],
                                 tools=_PROBE_TOOLS)
    except TemplateError:
        return None, False, gap
    turn = _turn(prompt, called, reply)
    if turn is None or not turn.startswith(begin):
        return None, False, gap
    first = _find_call(turn, _PROBE_TOOLS[0]["function"]["name"])
    second = _find_call(turn[first[1]:], _PROBE_TOOLS[1]["function"]["name"]) if first else None
    if second is None:
        return None, False, gap
    between = turn[first[1]: first[1] + second[0]]
    if close.strip() and between.strip().startswith(close.strip()):  # each call has its own opening
        inner = between[len(close): len(between) - len(begin)]
        exact = between.startswith(close) and between.endswith(begin) and len(between) >= len(close + begin)
        # What the template writes between two wrapped calls (a forced reply writes the same); text that
        # is not whitespace would be read back as content, so the common newline instead.
        return None, True, inner if exact and not inner.strip() else gap
    if between.strip() and not close.strip().startswith(between.strip()):
        return between, True, gap
    return None, False, gap


# -- parsing --------------------------------------------------------------------------------------------
@dataclass
class _Call:
    name: str | None
    args: str  # the arguments' JSON text as the model wrote it (so far, while streaming)
    complete: bool


@dataclass
class _Scan:
    content: str | None
    calls: list[_Call] = field(default_factory=list)
    malformed: bool = False
    resume: _Resume | None = None


def parse_reply(text: str, markup: Markup, names: Sequence[str], parallel: bool = True
                ) -> tuple[str | None, list[dict]]:
    """(content, tool_calls in OpenAI's shape) of a whole reply; no calls: (text, [])."""
    s = _scan(text, markup, frozenset(names), final=True)
    calls = s.calls if parallel else s.calls[:1]
    if not calls:
        return text, []
    return s.content, [_openai_call(c.name, c.args) for c in calls]


def _openai_call(name: str, args: str, id_: str | None = None) -> dict:
    return {"id": id_ or new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def new_call_id() -> str:
    import uuid

    return f"call_{uuid.uuid4().hex[:24]}"


def _scan(text: str, m: Markup, names: frozenset[str], final: bool, resume: _Resume | None = None) -> _Scan:
    """The reply's content and calls; not `final`: what is certain so far (a possible opening held back).
    resume: where an earlier scan of the start of `text` had its last complete call (a stream's next scan
    starts there, so the work per piece of text does not grow with the calls already read)."""
    btag = m.begin.strip()
    if not btag:
        return _scan_bare(text, m, names, final)
    pos, segments, calls = (resume.pos, list(resume.segments), list(resume.calls)) if resume else (0, [], [])
    opened = resume is not None
    while True:
        i = text.find(btag, pos)
        if i < 0:
            tail = text[pos:]
            if not final:
                tail = tail[: len(tail) - _held(tail, btag)]
            segments.append(tail)
            break
        segments.append(text[pos:i])
        opened = True
        group, k, state = _group(text, i + len(btag), m, names, final)
        calls.extend(group)
        if state == "bad":
            return _Scan(text if final else None, [], malformed=True)
        if state == "open":
            segments.append("")
            break
        pos = k
        resume = _Resume(pos, tuple(segments), tuple(calls))
    if final and not calls:
        return _Scan(text, [])
    if not opened:
        return _Scan("".join(segments), [])
    return _Scan(_join(segments, final) or None, calls, resume=resume)


@dataclass(frozen=True)
class _Resume:
    pos: int  # just after the last complete call's closing
    segments: tuple[str, ...]  # the content before it
    calls: tuple[_Call, ...]  # the calls up to it


def _join(segments: list[str], final: bool) -> str:
    """Content segments trimmed where they meet a call, the non-empty ones joined by newlines."""
    out = []
    for j, seg in enumerate(segments):
        if j > 0:
            seg = seg.lstrip()
        if j < len(segments) - 1 or not final:
            seg = seg.rstrip()
        if seg:
            out.append(seg)
    return "\n".join(out)


def _held(tail: str, btag: str) -> int:
    """Characters at the end of `tail` that may still become an opening (or trimmed whitespace before one)."""
    for n in range(min(len(btag) - 1, len(tail)), 0, -1):
        if btag.startswith(tail[-n:]):
            return n + (len(tail) - n - len(tail[: len(tail) - n].rstrip()))
    return len(tail) - len(tail.rstrip())


def _scan_bare(text: str, m: Markup, names: frozenset[str], final: bool) -> _Scan:
    """Llama 3.x's bare JSON: a reply that is a call (after an optional <|python_tag|>) and nothing else."""
    lead = text.lstrip()
    if lead.startswith("<|python_tag|>"):
        lead = lead[len("<|python_tag|>"):].lstrip()
    if not lead.startswith("{"):
        maybe = not lead or "<|python_tag|>".startswith(lead)
        return _Scan(text if final else ("" if maybe else text), [])
    if not final:  # a bare call has no closing to wait for: it is whole only once the reply ends
        return _Scan("", [])
    start = len(text) - len(lead)
    group, k, state = _group(text, start, m, names, final)
    if state != "done" or text[k:].strip():
        return _Scan(text, [], malformed=True)
    return _Scan(None, group)


def _group(text: str, k: int, m: Markup, names: frozenset[str], final: bool
           ) -> tuple[list[_Call], int, str]:
    """The calls of one opening at `k`, where it ends, and "done", "open" (more may come) or "bad"."""
    calls: list[_Call] = []
    sep = (m.sep or "").strip()
    while True:
        k = _skip(text, k)
        if k == len(text):
            return calls, k, "bad" if final else "open"
        if text[k] != "{":
            return calls, k, "bad"
        try:
            obj, e = _decode(text, k)
        except ValueError:
            if final:
                return calls, k, "bad"
            partial = _partial(text, k, m, names)
            return calls + ([partial] if partial else []), len(text), "open"
        call = _whole(text, k, e, obj, m, names)
        if call is None:
            return calls, k, "bad"
        calls.append(call)
        k = _skip(text, e)
        if sep and text.startswith(sep, k):
            k += len(sep)
            continue
        break
    etag = m.end.strip()
    if not etag or text.startswith(etag, k):
        return calls, k + len(etag), "done"
    if not final and etag.startswith(text[k:]):
        return calls, len(text), "open"
    return calls, k, "bad"


def _skip(text: str, k: int) -> int:
    while k < len(text) and text[k].isspace():
        k += 1
    return k


def _whole(text: str, k: int, e: int, obj: Any, m: Markup, names: frozenset[str]) -> _Call | None:
    """A complete call object, its arguments as the exact text the model wrote; None if it is not one."""
    if not isinstance(obj, dict) or obj.get(m.name_key) not in names:
        return None
    args = obj.get(m.args_key)
    if isinstance(args, str):  # arguments given as JSON text (some templates write them so)
        try:
            decoded = json.loads(args)
        except (ValueError, RecursionError):
            return None
        if _too_deep(decoded):
            return None
        return _Call(obj[m.name_key], args, True) if isinstance(decoded, dict) else None
    if not isinstance(args, dict):
        return None
    for a in re.finditer(_key(m.args_key), text[k:e]):
        try:
            value, end = _decode(text, k + a.end())
        except ValueError:
            continue
        if value == args:
            return _Call(obj[m.name_key], text[k + a.end(): end], True)
    return _Call(obj[m.name_key], json.dumps(args, ensure_ascii=False), True)


def _key(key: str) -> str:
    """The pattern of `"key": ` in a JSON object."""
    return '"' + re.escape(key) + r'"\s*:\s*'


def _partial(text: str, k: int, m: Markup, names: frozenset[str]) -> _Call | None:
    """An unfinished call object: its name once written in full, and its arguments so far."""
    body = text[k:]
    a = re.search(_key(m.args_key), body)
    n = re.search(_key(m.name_key) + r'("(?:[^"\\]|\\.)*")', body)
    if n is None or (a is not None and a.start() < n.start()):
        return None
    name = json.loads(n.group(1))
    if name not in names or a is None:
        return None  # sent once its arguments have begun as an object: fewer calls sent that fail later
    start = k + a.end()
    if not text.startswith("{", start):
        return None
    try:
        value, end = _decode(text, start)
    except ValueError:
        return _Call(name, text[start:], False)
    return _Call(name, text[start:end], False) if isinstance(value, dict) else None


class StreamParser:
    """One streamed choice: text in, OpenAI chat deltas out ({"content": ...} or {"tool_calls": [...]})."""

    def __init__(self, markup: Markup, names: Sequence[str], parallel: bool = True) -> None:
        self.markup, self.names, self.parallel = markup, frozenset(names), parallel
        self.text = ""
        self.sent = ""  # content sent
        self.calls: list[str] = []  # the arguments text sent, per call begun
        self.parsed = False  # after finish(): the whole reply holds calls (finish_reason "tool_calls")
        self._resume: _Resume | None = None

    def feed(self, text: str) -> list[dict]:
        self.text += text
        s = _scan(self.text, self.markup, self.names, final=False, resume=self._resume)
        self._resume = s.resume
        return self._deltas(s)

    def finish(self) -> list[dict]:
        """The last deltas, once the reply has ended."""
        s = _scan(self.text, self.markup, self.names, final=True)
        self.parsed = bool(s.calls)
        if s.malformed and self.calls:
            return []  # a call already sent cannot be taken back: it stays as sent (cut, for "length")
        return self._deltas(s)

    @property
    def called(self) -> bool:
        """Calls were sent (some perhaps cut off)."""
        return bool(self.calls)

    def _deltas(self, s: _Scan) -> list[dict]:
        out = []
        content = s.content or ""
        if content.startswith(self.sent) and len(content) > len(self.sent):
            out.append({"content": content[len(self.sent):]})
            self.sent = content
        for i, c in enumerate(s.calls if self.parallel else s.calls[:1]):
            if i == len(self.calls):
                self.calls.append("")
                out.append({"tool_calls": [{"index": i, "id": new_call_id(), "type": "function",
                                            "function": {"name": c.name, "arguments": ""}}]})
            sent = self.calls[i]
            if len(c.args) > len(sent) and c.args.startswith(sent):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": c.args[len(sent):]}}]})
                self.calls[i] = c.args
        return out


# -- forcing a call -------------------------------------------------------------------------------------
def call_schemas(markup: Markup, tools: Sequence[dict], only: str | None = None) -> list[dict]:
    """One call's JSON schema per tool (or for `only`): {name_key: its name, args_key: its parameters}."""
    out = []
    for t in tools:
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "object", "properties": {markup.name_key: {"const": fn["name"]},
                                                     markup.args_key: params},
                    "required": [markup.name_key, markup.args_key], "additionalProperties": False})
    return out


def call_grammar(tokenizer, plan: ToolPlan):
    """The grammar that makes a reply calls in the template's markup: one of `plan.only`, or 1 to
    MAX_CALLS of any of the tools ("required"; one where the plan keeps one), their arguments valid
    against the function's parameters (every tool strict)."""
    from lmforge.serve.grammar import GrammarError, tagged_json_grammar

    m = plan.markup
    # A markup without an opening (Llama's bare JSON) is read back as one call: never write more.
    several = plan.mode == "required" and plan.parallel and bool(m.begin.strip())
    try:
        return tagged_json_grammar(tokenizer, m.begin, call_schemas(m, plan.tools, plan.only), m.end,
                                   max_items=MAX_CALLS if several else 1, sep=m.sep, gap=m.gap)
    except GrammarError as e:
        raise ToolsRefused(f"the tools' parameters cannot be enforced: {e}", "tools") from None
    except LmforgeError as e:  # llguidance is not installed
        raise ToolsRefused(f"tool_choice '{plan.mode}' forces the call by constrained decoding: {e}",
                           "tool_choice") from None
