"""Tool use in chat records, in the OpenAI / transformers conventions:

    {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "...",
                                                  "parameters": {JSON schema}}}, ...],
     "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "" (or null, or left out),
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C in Paris."}]}

The fields reach the template as transformers' apply_chat_template(messages, tools=tools) passes them:
`tools` as given (a variable only when the record has tools, so that a record without them renders as
before), `arguments` unconverted (a dict or the JSON text the record holds: templates test `is string`
themselves), and a message key whose value is null left out (transformers drops them: templates handle a
missing key, not a None).

A record is untrusted: every tool and tool call is rendered into every prefix a long conversation needs,
so their number, nesting and size are bounded here, before any render (an iterative walk: no recursion
for a record nested as deep as JSON allows).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lmforge.errors import DataError
from lmforge.utils.bounds import whole
from lmforge.utils.jsontext import BadJSON, loads

MAX_TOOLS = 256  # function definitions of one record (agent datasets carry tens)
MAX_TOOL_CALLS = 64  # calls of one assistant message
MAX_DEPTH = 32  # nesting of a tool definition or a call's arguments (JSON schemas are a few levels deep)
MAX_VALUES = 50_000  # strings, numbers, lists and objects of a record's tools and tool calls together
MAX_CHARS = 1 << 20  # characters of the strings in them together


class BadTools(DataError):
    """A tool definition, tool call or tool message that is not one (chat.BadRecord wraps it)."""


class ToolBudget:
    """What one record's tool fields may hold in all: MAX_VALUES values and MAX_CHARS characters."""

    def __init__(self) -> None:
        self.values = 0
        self.chars = 0

    def walk(self, value: Any, key: str) -> None:
        """`value` checked as plain JSON data (no NUL character in a string), at most MAX_DEPTH deep,
        within this budget."""
        stack: list[tuple[str, Any, int]] = [(key, value, 0)]
        while stack:
            path, v, depth = stack.pop()
            self.values += 1
            if self.values > MAX_VALUES:
                raise BadTools(f"the tools and tool calls of the record hold more than {MAX_VALUES:,} values "
                               f"(at {path}); a record's tool fields are at most that")
            if depth > MAX_DEPTH:
                raise BadTools(f"{path} is nested more than {MAX_DEPTH} levels deep; a tool definition or "
                               "call's arguments are at most that")
            if isinstance(v, str):
                self.chars += len(v)
                if "\x00" in v:
                    raise BadTools(f"{path} contains a NUL character")
                if self.chars > MAX_CHARS:
                    raise BadTools(f"the tools and tool calls of the record hold more than {MAX_CHARS:,} "
                                   f"characters (at {path}); a record's tool fields are at most that")
            elif isinstance(v, dict):
                for k, item in v.items():
                    if not isinstance(k, str):
                        raise BadTools(f"{path} has a key {k!r} that is not a string")
                    self.chars += len(k)
                    stack.append((f"{path}.{k}", item, depth + 1))
            elif isinstance(v, list):
                stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(v))
            elif not (v is None or isinstance(v, (bool, int, float))):
                raise BadTools(f"{path} is a {type(v).__name__}, which is not JSON data")


def _count(items: Any, key: str, most: int, what: str) -> list:
    if not isinstance(items, list) or not items:
        raise BadTools(f"{key!r} must be a non-empty list of {what}, got "
                       + (f"a {type(items).__name__}" if not isinstance(items, list) else "an empty list")
                       + (" (a JSON text? decode it into a list)" if isinstance(items, str) else ""))
    why = whole(1, most).problem(len(items))
    if why is not None:
        raise BadTools(f"{key!r} holds {len(items):,} {what}; at most {most:,}")
    return items


def _function(entry: Any, key: str, want: str) -> dict:
    """The "function" object of a tool or tool call, checked to have a name."""
    if not isinstance(entry, dict):
        raise BadTools(f"{key} is a {type(entry).__name__}, not an object")
    kind = entry.get("type", "function")
    if kind != "function":
        raise BadTools(f"{key}.type is {kind!r}; only \"function\" {want} are supported")
    fn = entry.get("function")
    if not isinstance(fn, dict):
        raise BadTools(f"{key}.function must be an object {{\"name\", ...}}, got "
                       + ("nothing" if fn is None else f"a {type(fn).__name__}"))
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise BadTools(f"{key}.function.name must be a non-empty string, got {name!r}"[:200])
    return fn


def parse_tools(tools: Any, budget: ToolBudget) -> tuple[dict, ...]:
    """A record's `tools`: function definitions {"type": "function", "function": {"name", "description"?,
    "parameters"? (a JSON schema object)}}."""
    out = []
    for i, tool in enumerate(_count(tools, "tools", MAX_TOOLS, "function definitions")):
        key = f"tools[{i}]"
        fn = _function(tool, key, "tools")
        for field, kind in (("description", str), ("parameters", dict)):
            if fn.get(field) is not None and not isinstance(fn[field], kind):
                raise BadTools(f"{key}.function.{field} is a {type(fn[field]).__name__}, not "
                               + ("a string" if kind is str else "an object (a JSON schema)"))
        budget.walk(tool, key)
        out.append(tool)
    return tuple(out)


def parse_tool_calls(calls: Any, key: str, budget: ToolBudget) -> list[dict]:
    """An assistant message's `tool_calls`: [{"id"?, "type": "function", "function": {"name",
    "arguments": an object, or the JSON text of one}}]."""
    for i, call in enumerate(_count(calls, key, MAX_TOOL_CALLS, "tool calls")):
        where = f"{key}[{i}]"
        fn = _function(call, where, "tool calls")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise BadTools(f"{where}.id is a {type(call['id']).__name__}, not a string")
        args = fn.get("arguments")
        if isinstance(args, str):
            if len(args) > MAX_CHARS:
                raise BadTools(f"{where}.function.arguments is {len(args):,} characters; "
                               f"at most {MAX_CHARS:,}")
            try:
                decoded = loads(args)
            except BadJSON as e:
                raise BadTools(f"{where}.function.arguments is a string but not JSON text: {e.why}") from None
            if not isinstance(decoded, dict):
                raise BadTools(f"{where}.function.arguments is the JSON text of a {type(decoded).__name__}; "
                               "arguments are an object (or its JSON text)")
            budget.walk(decoded, f"{where}.function.arguments")
        elif not isinstance(args, dict):
            raise BadTools(f"{where}.function.arguments must be an object or its JSON text, got "
                           + ("nothing" if args is None else f"a {type(args).__name__}"))
        budget.walk(call, where)
    return calls


def tool_fields(turn: dict, role: str, key: str, budget: ToolBudget) -> dict:
    """The tool fields of one message (`tool_calls` of an assistant; `tool_call_id` and `name` of a tool
    result), checked; a field of the wrong role is an error, not dropped."""
    out: dict = {}
    calls = turn.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise BadTools(f"{key} has 'tool_calls' but role {role!r}; only an assistant calls tools")
        out["tool_calls"] = parse_tool_calls(calls, f"{key}.tool_calls", budget)
    for field in ("tool_call_id", "name"):
        value = turn.get(field)
        if value is None or role != "tool":
            continue  # a user's or assistant's `name` was never read, and is still not (as before)
        if not isinstance(value, str):
            raise BadTools(f"{key}.{field} is a {type(value).__name__}, not a string")
        if "\x00" in value:
            raise BadTools(f"{key}.{field} contains a NUL character")
        out[field] = value
    return out


def strings(value: Any) -> Iterator[str]:
    """Every string of a message or tool (keys included), for the checks on control tokens: a tool's
    text is rendered into the conversation like a message's."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            yield from (k for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)


def new_budget() -> ToolBudget:
    return ToolBudget()
