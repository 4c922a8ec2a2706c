"""Instruction and chat data: records in the common shapes, read from JSONL, Parquet or a saved
`datasets` dir, and turned into one form, a list of messages (`{"role", "content"}`).

Shapes (`sft.format`, or "auto" to tell them apart record by record):

    messages           {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
                       with tool use: a record-level "tools" list, assistant "tool_calls" and role "tool"
                       messages (lmforge.data.chat_tools)
    prompt_completion  {"prompt": "...", "completion": "..."} (strings, or lists of messages as TRL has)
    alpaca             {"instruction": "...", "input": "..." (optional), "output": "..."}
    sharegpt           {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}

A record that is not one of them (a missing key, an unknown role, an empty conversation, no assistant
turn, a non-string content) is skipped and counted, or with `sft.on_bad_record=fail` an error naming
the file and line (JSONL) or row (Parquet, datasets). So is a JSONL line that is not JSON text: malformed,
nested too deeply to read, or holding a lone surrogate escape (lmforge.utils.jsontext); a UTF-8 byte
order mark opening a file is not part of its first line. Records keep where they came from, so every
later error (a template that fails, a conversation that does not fit) can name it too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.data import chat_tools
from lmforge.data.sources import JSONL_EXTENSIONS, MAX_EXAMPLES, PARQUET_EXTENSIONS, check_source, walk_files
from lmforge.errors import DataError
from lmforge.utils.jsontext import BOM, BadJSON, loads

FORMATS = ("auto", "messages", "prompt_completion", "alpaca", "sharegpt")
ROLES = ("system", "user", "assistant")
TOOL_ROLES = (*ROLES, "tool")  # the "messages" shape, where records may use tools
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
_ARROW_EXTENSIONS = (".arrow",)


@dataclass(frozen=True)
class Conversation:
    """One example: its messages, and where it came from (`file:line` or `file:row N`)."""

    messages: tuple[dict[str, Any], ...]
    where: str
    completion_start: int | None = None  # prompt/completion records: index of the first completion message
    tools: tuple[dict, ...] | None = None  # the record's function definitions (None: it has none)


@dataclass
class ChatStats:
    """What was read and skipped."""

    files: int = 0
    records: int = 0
    skipped: int = 0
    examples: list[str] = field(default_factory=list)  # where and why, the first few

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {why}")

    def summary(self) -> str:
        line = f"{self.records:,} conversations from {self.files:,} files"
        if self.skipped:
            line += f"; skipped {self.skipped:,} bad records (e.g. {'; '.join(self.examples[:2])})"
        return line


class BadRecord(DataError):
    """A record that is not a conversation of any known shape."""


def to_conversation(record: Any, where: str, fmt: str = "auto") -> Conversation:
    """The conversation of one record, or BadRecord saying what is wrong with it."""
    if isinstance(record, BadRow):
        raise BadRecord(record.why)
    if not isinstance(record, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    if fmt == "auto":
        fmt = _detect(record)
    if fmt == "messages":
        budget = chat_tools.new_budget()
        try:
            tools = record.get("tools")
            if tools is not None:
                tools = chat_tools.parse_tools(tools, budget)
            msgs = parse_messages(record.get("messages"), "messages", "role", "content", None, budget=budget)
        except chat_tools.BadTools as e:
            raise BadRecord(str(e)) from None
        return Conversation(msgs, where, tools=tools)
    if record.get("tools") is not None:  # never dropped unread
        raise BadRecord(f"the record has 'tools', which the {fmt} shape cannot carry; tool use is read "
                        "from records of the 'messages' shape (tools, assistant tool_calls, role \"tool\" "
                        "messages)")
    if fmt == "sharegpt":
        msgs = parse_messages(record.get("conversations"), "conversations", "from", "value", _SHAREGPT_ROLES)
        return Conversation(msgs, where)
    if fmt == "alpaca":
        instruction, output = _text(record, "instruction"), _text(record, "output")
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise BadRecord(f"'input' is a {type(extra).__name__}, not a string")
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        msgs = ({"role": "user", "content": prompt}, {"role": "assistant", "content": output})
        return Conversation(msgs, where, completion_start=1)
    if fmt == "prompt_completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if prompt is None or completion is None:
            raise BadRecord("a prompt/completion record needs both 'prompt' and 'completion'")
        if isinstance(prompt, str) and isinstance(completion, str):
            msgs = ({"role": "user", "content": prompt}, {"role": "assistant", "content": completion})
            return Conversation(msgs, where, completion_start=1)
        head = parse_messages(prompt, "prompt", "role", "content", None, need_assistant=False)
        tail = parse_messages(completion, "completion", "role", "content", None)
        return Conversation(head + tail, where, completion_start=len(head))
    raise BadRecord(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")


def _detect(record: dict) -> str:
    for key, fmt in (
        ("messages", "messages"),
        ("conversations", "sharegpt"),
        ("instruction", "alpaca"),
        ("prompt", "prompt_completion"),
    ):
        if record.get(key) is not None:  # columnar files give every row every column, None where absent
            return fmt
    raise BadRecord(
        f"no conversation in the record (keys: {', '.join(sorted(map(str, record))[:8]) or 'none'}); "
        "expected 'messages', 'conversations', 'instruction'/'output' or 'prompt'/'completion'"
    )


def _text(record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise BadRecord(
            f"{key!r} is missing" if value is None else f"{key!r} is a {type(value).__name__}, not a string"
        )
    return value


def parse_messages(
    turns: Any,
    key: str,
    role_key: str,
    content_key: str,
    role_names: dict[str, str] | None,
    need_assistant: bool = True,
    budget: chat_tools.ToolBudget | None = None,
) -> tuple[dict[str, Any], ...]:
    """The messages of `turns`; with a `budget` (the "messages" shape) also tool use: role "tool" and
    the messages' tool fields (BadTools when they are wrong)."""
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"{key!r} must be a non-empty list of messages")
    roles = ROLES if budget is None else TOOL_ROLES
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRecord(f"{key}[{i}] is a {type(turn).__name__}, not an object")
        role, content = turn.get(role_key), turn.get(content_key)
        if role_names is not None and isinstance(role, str):
            role = role_names.get(role.lower(), role)
        if role not in roles:
            raise BadRecord(
                f"{key}[{i}] has role {role!r}; valid roles: {', '.join(roles)}"
                + (f" (ShareGPT: {', '.join(sorted(role_names))})" if role_names else "")
            )
        extra = {} if budget is None else chat_tools.tool_fields(turn, role, f"{key}[{i}]", budget)
        if content is None and "tool_calls" in extra:  # a call without words: no content key, as transformers
            out.append({"role": role, **extra})
            continue
        if not isinstance(content, str):
            raise BadRecord(
                f"{key}[{i}].{content_key} is "
                + ("missing" if content is None else f"a {type(content).__name__}, not a string")
            )
        if "\x00" in content:
            raise BadRecord(f"{key}[{i}].{content_key} contains a NUL character")
        out.append({"role": role, "content": content, **extra})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise BadRecord(f"{key!r} has no assistant turn: there is nothing to learn from it")
    return tuple(out)


# -- reading ------------------------------------------------------------------------------------------
def read_conversations(
    sources: list[str], fmt: str = "auto", on_bad: str = "skip", stats: ChatStats | None = None
) -> Iterator[Conversation]:
    """Every conversation of `sources` (files or folders of .jsonl / .parquet, or a saved `datasets`
    dir), in a fixed order. Bad records are skipped and counted in `stats`, or raise with on_bad="fail"."""
    return parse_sources(sources, lambda record, where: to_conversation(record, where, fmt), on_bad, stats)


def parse_sources(sources: list[str], parse: Callable[[Any, str], Any], on_bad: str = "skip",
                  stats: ChatStats | None = None) -> Iterator[Any]:
    """parse(record, where) of every record of `sources`, in a fixed order; a BadRecord is skipped and
    counted in `stats`, or raised naming its file and line with on_bad="fail"."""
    stats = stats if stats is not None else ChatStats()
    for src in sources:
        check_source(src)
    for src in sources:
        for _, records in iter_records(Path(src), stats):
            for where, record in records:
                try:
                    item = parse(record, where)
                except BadRecord as e:
                    if on_bad == "fail":
                        raise BadRecord(
                            f"{where}: {e}; fix the record or set sft.on_bad_record=skip"
                        ) from None
                    stats.skip(where, str(e))
                    continue
                stats.records += 1
                yield item


def iter_records(path: Path, stats: ChatStats) -> Iterator[tuple[Path, Iterator[tuple[str, Any]]]]:
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            yield from ((f, _iter_arrow(f, stats)) for f in _dataset_files(path))
            return
        for f in walk_files(path):
            if f.suffix.lower() in JSONL_EXTENSIONS + PARQUET_EXTENSIONS:
                yield f, _iter_file(f, stats)
        return
    yield path, _iter_file(path, stats)


def _iter_file(path: Path, stats: ChatStats) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix in PARQUET_EXTENSIONS:
        return _iter_parquet(path, stats)
    if suffix in _ARROW_EXTENSIONS:
        return _iter_arrow(path, stats)
    if suffix in JSONL_EXTENSIONS or suffix == ".json":
        return _iter_jsonl(path, stats)
    raise DataError(
        f"{path}: chat data must be .jsonl, .parquet or a saved datasets dir (got {suffix or 'no extension'})"
    )


def _iter_jsonl(path: Path, stats: ChatStats) -> Iterator[tuple[str, Any]]:
    from lmforge.data.sources import _open_regular, _unreadable

    stats.files += 1
    lineno = 0
    try:
        with _open_regular(path) as f:
            while raw := f.readline():
                lineno += 1
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield where, BadRow(f"not valid UTF-8 at byte {e.start} of the line")
                    continue
                if lineno == 1:  # a byte order mark, as editors on Windows write them
                    line = line.removeprefix(BOM)
                if line.isspace() or not line:
                    continue
                try:
                    yield where, loads(line)
                except BadJSON as e:
                    yield where, BadRow(e.why)
    except OSError as e:
        raise _unreadable(path, e) from None


class BadRow(dict):
    """A line that could not be parsed: to_conversation rejects it with its reason (a dict subclass
    is never mistaken for a record: _detect finds none of the keys)."""

    def __init__(self, why: str) -> None:
        super().__init__()
        self.why = why


def _iter_parquet(path: Path, stats: ChatStats) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    stats.files += 1
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    row = 0
    for i in range(pf.num_row_groups):
        for record in pf.read_row_group(i).to_pylist():
            yield f"{path}:row {row}", record
            row += 1


def _dataset_files(path: Path) -> list[Path]:
    """The .arrow files of a `datasets` save_to_disk dir, in order (state.json lists them)."""
    state = path / "state.json"
    if state.is_file():
        try:
            files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise DataError(f"{state}: not a datasets state.json ({e})") from None
        for f in files:
            if f.resolve().parent != path.resolve() or not f.is_file():
                raise DataError(f"{state} names {f.name!r}, which is not a file in {path}")
        return files
    return sorted(path.glob("*.arrow"))


def _iter_arrow(path: Path, stats: ChatStats) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa

    stats.files += 1
    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            row = 0
            for batch in reader:
                for record in batch.to_pylist():
                    yield f"{path}:row {row}", record
                    row += 1
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: not a readable Arrow file of a saved datasets dir ({e})") from None
