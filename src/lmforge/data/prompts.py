"""Prompts for RL: records -> the conversation a completion is sampled for, and what the completion's
reward is checked against, in the shape TRL's GRPOTrainer reads.

  {"prompt": str | [messages], "answer": str, ...}      TRL's shape: extra fields go to the rewards
  {"messages": [..., assistant answer], "answer": str}  a chat record (`lmforge tasks` writes these):
                                                        the prompt is everything before the final
                                                        assistant message

`answer` is what the exact-match reward compares with; `task` (a shipped task family's name) picks
that family's checker. Other string / number / bool fields are kept with the prompt (`info`). Files
are read as for SFT (JSONL, Parquet, a saved `datasets` dir; bad records skipped and counted with
file:line, or fatal with on_bad="fail").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lmforge.data.chat import BadRecord, BadRow, ChatStats, parse_messages, parse_sources
from lmforge.data.instruct_tasks import TASKS

__all__ = ["PromptRecord", "read_prompts", "to_prompt"]


@dataclass(frozen=True)
class PromptRecord:
    messages: tuple[dict[str, str], ...]  # the conversation so far; the assistant speaks next
    info: dict[str, Any]  # answer, task, ...: what rewards check the completion against
    where: str


def to_prompt(record: Any, where: str) -> PromptRecord:
    """The prompt of one record, or BadRecord saying what is wrong with it."""
    if isinstance(record, BadRow):
        raise BadRecord(record.why)
    if not isinstance(record, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    if record.get("prompt") is not None:
        value = record["prompt"]
        if isinstance(value, str):
            messages: tuple[dict[str, str], ...] = ({"role": "user", "content": value},)
        else:
            messages = parse_messages(value, "prompt", "role", "content", None, need_assistant=False)
    elif record.get("messages") is not None:
        messages = parse_messages(record["messages"], "messages", "role", "content", None,
                                  need_assistant=False)
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise BadRecord("'messages' holds only an assistant message: no prompt to reply to")
    else:
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise BadRecord(f"an RL prompt record needs 'prompt' (or 'messages') and 'answer' (keys: {keys})")
    if messages[-1]["role"] == "assistant":
        raise BadRecord("the prompt ends with an assistant message; it must end where the assistant replies")
    answer = record.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        raise BadRecord(f"'answer' must be a non-empty string (what the reward checks against), got "
                        f"{answer!r}")
    task = record.get("task")
    if task is not None and task not in TASKS:
        raise BadRecord(f"'task' is {task!r}, not a shipped task ({', '.join(sorted(TASKS))}); leave it out "
                        "to compare answers as plain strings")
    info = {k: v for k, v in record.items()
            if k not in ("prompt", "messages") and isinstance(k, str)
            and (v is None or isinstance(v, (str, int, float, bool)))}
    return PromptRecord(messages, info, where)


def read_prompts(sources: list[str], on_bad: str = "skip", stats: ChatStats | None = None
                 ) -> Iterator[PromptRecord]:
    """Every RL prompt of `sources`, in a fixed order; bad records skipped and counted in `stats`, or
    raising with on_bad="fail"."""
    return parse_sources(sources, to_prompt, on_bad, stats)
