"""Preference data: records -> (prompt, chosen, rejected) pairs, and unpaired (prompt, completion,
label) examples for KTO, in the shapes TRL's trainers read.

Paired records (DPO family, reward models):
  {"prompt": str, "chosen": str, "rejected": str}                       standard: one user turn
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}  conversational, explicit prompt
  {"chosen": [messages], "rejected": [messages]}                        implicit prompt: the longest
                                                                        shared leading run of messages
Unpaired records (KTO): {"prompt": str | [messages], "completion": str | [messages], "label": bool}.

The completions must end with an assistant message and the two sides of a pair must differ (a pair
whose sides are equal teaches nothing and is skipped as bad). Files are read as for SFT (JSONL,
Parquet, a saved `datasets` dir; bad records skipped and counted with file:line, or fatal with
on_bad="fail"). A pair becomes two `Conversation`s whose loss is taken on the completion only
(`completion_start`), so the SFT tokenisation and masking (data/sft.py) serve preference data as is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lmforge.data.chat import (
    BadRecord,
    BadRow,
    ChatStats,
    Conversation,
    parse_messages,
    parse_sources,
)

__all__ = ["PreferencePair", "UnpairedExample", "read_pairs", "read_unpaired", "to_pair", "to_unpaired"]

Messages = tuple[dict[str, str], ...]


@dataclass(frozen=True)
class PreferencePair:
    prompt: Messages  # may be empty (implicit prompt with nothing shared)
    chosen: Messages  # the completion only, ending with an assistant message
    rejected: Messages
    where: str
    margin: float | None = None  # how much higher the chosen one should score (reward models; TRL's field)

    def conversations(self) -> tuple[Conversation, Conversation]:
        """(prompt + chosen, prompt + rejected), each with its loss on the completion only."""
        start = len(self.prompt)
        return (Conversation(self.prompt + self.chosen, self.where, completion_start=start),
                Conversation(self.prompt + self.rejected, self.where, completion_start=start))


@dataclass(frozen=True)
class UnpairedExample:
    prompt: Messages
    completion: Messages
    desirable: bool
    where: str

    def conversation(self) -> Conversation:
        return Conversation(self.prompt + self.completion, self.where, completion_start=len(self.prompt))


def _prompt(value: Any, key: str = "prompt") -> Messages:
    if isinstance(value, str):
        return ({"role": "user", "content": value},)
    return parse_messages(value, key, "role", "content", None, need_assistant=False)


def _completion(value: Any, key: str) -> Messages:
    if isinstance(value, str):
        return ({"role": "assistant", "content": value},)
    msgs = parse_messages(value, key, "role", "content", None)
    if msgs[-1]["role"] != "assistant":
        raise BadRecord(
            f"{key!r} ends with a {msgs[-1]['role']} message; a completion ends with the assistant's"
        )
    return msgs


def to_pair(record: Any, where: str) -> PreferencePair:
    """The pair of one record, or BadRecord saying what is wrong with it."""
    if isinstance(record, BadRow):
        raise BadRecord(record.why)
    if not isinstance(record, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if chosen is None or rejected is None:
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise BadRecord(f"a preference record needs 'chosen' and 'rejected' (keys: {keys})")
    if record.get("prompt") is not None:
        prompt = _prompt(record["prompt"])
        pair = PreferencePair(prompt, _completion(chosen, "chosen"), _completion(rejected, "rejected"), where)
    else:
        if isinstance(chosen, str) or isinstance(rejected, str):
            raise BadRecord("'chosen'/'rejected' are plain strings but there is no 'prompt': give the "
                            "prompt, or whole conversations as message lists")
        full_c = parse_messages(chosen, "chosen", "role", "content", None)
        full_r = parse_messages(rejected, "rejected", "role", "content", None)
        shared = 0
        while shared < min(len(full_c), len(full_r)) and full_c[shared] == full_r[shared]:
            shared += 1
        if shared == len(full_c) or shared == len(full_r):
            raise BadRecord("one side of the pair is a prefix of the other: no completion to compare")
        pair = PreferencePair(full_c[:shared], _completion(list(full_c[shared:]), "chosen"),
                              _completion(list(full_r[shared:]), "rejected"), where)
    if pair.chosen == pair.rejected:
        raise BadRecord("'chosen' and 'rejected' are the same completion: the pair says nothing")
    margin = record.get("margin")
    if margin is not None:
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise BadRecord(f"'margin' must be a finite number, got {margin!r}")
        pair = dataclasses.replace(pair, margin=float(margin))
    return pair


def to_unpaired(record: Any, where: str) -> UnpairedExample:
    """The unpaired (KTO) example of one record, or BadRecord."""
    if isinstance(record, BadRow):
        raise BadRecord(record.why)
    if not isinstance(record, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    label = record.get("label")
    if not isinstance(label, bool):
        raise BadRecord("an unpaired record needs 'label': true (desirable) or false (undesirable), "
                        f"got {label!r}")
    if record.get("prompt") is None or record.get("completion") is None:
        raise BadRecord("an unpaired record needs 'prompt' and 'completion'")
    return UnpairedExample(_prompt(record["prompt"]), _completion(record["completion"], "completion"), label,
                           where)


def read_pairs(sources: list[str], on_bad: str = "skip", stats: ChatStats | None = None
               ) -> Iterator[PreferencePair]:
    """Every preference pair of `sources` (files or folders of .jsonl / .parquet, or a saved `datasets`
    dir), in a fixed order; bad records skipped and counted in `stats`, or raising with on_bad="fail"."""
    return parse_sources(sources, to_pair, on_bad, stats)


def read_unpaired(sources: list[str], on_bad: str = "skip", stats: ChatStats | None = None
                  ) -> Iterator[UnpairedExample]:
    """Every unpaired (KTO) example of `sources`, as `read_pairs`."""
    return parse_sources(sources, to_unpaired, on_bad, stats)
