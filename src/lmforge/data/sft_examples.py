"""One rendered conversation -> its token ids and the tokens that carry the loss.

An example is the ids of one rendered conversation and a label mask over them (1 where the loss is
taken, as the labels of transformers / TRL: the token is predicted from the ones before it). The
template decides the text; `sft.loss_on` which characters count (see chat_template); a token counts
when its characters overlap a counted span, which is what transformers' `return_assistant_tokens_mask`
gives (the tokens from the one holding the span's first character to the one holding its last).

Preparation renders conversations in batches (one round trip to a template's worker per batch) and cut
at the text a sequence can hold (Tokenizer.text_budget): a conversation longer than train.seq_len costs
what a sequence costs, whatever the size of the record, and one that goes on past the cut is overlong
(truncated or dropped, as `sft.overlong` says).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from lmforge.data.chat import Conversation
from lmforge.data.chat_template import ChatTemplate, Rendered, TemplateError
from lmforge.data.chat_tools import strings
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError

BATCH_ITEMS = 64  # records per render round trip
BATCH_CHARS = 1 << 22  # characters of message text per round trip (a bigger record goes alone)
T = TypeVar("T")


@dataclass
class Example:
    ids: np.ndarray  # int32 (n,)
    mask: np.ndarray  # bool (n,): the loss is taken on ids[i] (predicted from ids[:i])
    complete: bool = True  # False: the conversation goes on past these tokens (its text was cut)


def label_mask(conv: Conversation, template: ChatTemplate, tok: Tokenizer, loss_on: str,
               rendered: Rendered | None = None) -> Example:
    """The ids of `conv` rendered by `template` (or the render given) and the mask of the tokens
    `loss_on` picks."""
    if rendered is None:
        rendered = template.render_batch([conv.messages], spans=True, tools=[conv.tools])[0]
    spans = rendered.spans
    ids, offsets = tok.encode_chat(rendered.text)
    n = len(ids)
    if loss_on == "all":
        return Example(np.asarray(ids, dtype=np.int32), np.ones(n, dtype=bool), rendered.complete)
    assistant_turns = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant"]
    # A cut render has the spans of the turns before the cut only: the first ones, in order.
    if len(spans) > len(assistant_turns) or (rendered.complete and len(spans) != len(assistant_turns)):
        raise TemplateError(
            f"{template.name} marks {len(spans)} assistant spans in a conversation with "
            f"{len(assistant_turns)} assistant turns; fix its {{% generation %}} blocks"
        )
    has_last = len(spans) == len(assistant_turns)
    if conv.completion_start is not None:  # prompt/completion: the completion only (as TRL)
        spans = [s for s, k in zip(spans, assistant_turns) if k >= conv.completion_start]
    if loss_on == "last":
        spans = spans[-1:] if has_last else []
    return Example(np.asarray(ids, dtype=np.int32), _token_mask(offsets, spans), rendered.complete)


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """Tokens whose (non-empty) characters overlap a span: by binary search where the offsets run in
    order (they do for the tokenizers in use), so the cost is the tokens', not tokens times spans."""
    n = len(offsets)
    starts = np.fromiter((a for a, _ in offsets), dtype=np.int64, count=n)
    ends = np.fromiter((b for _, b in offsets), dtype=np.int64, count=n)
    mask = np.zeros(n, dtype=bool)
    if not spans or not n:
        return mask
    if (np.diff(starts) >= 0).all() and (np.diff(ends) >= 0).all():
        a = np.asarray([s for s, _ in spans], dtype=np.int64)
        b = np.asarray([e for _, e in spans], dtype=np.int64)
        lo = np.searchsorted(ends, a, side="right")  # the first token ending after the span starts
        hi = np.searchsorted(starts, b, side="left")  # the first token starting at or after its end
        keep = lo < hi
        edges = np.zeros(n + 1, dtype=np.int64)
        np.add.at(edges, lo[keep], 1)
        np.add.at(edges, hi[keep], -1)
        mask = np.cumsum(edges[:-1]) > 0
    else:
        for a, b in spans:
            mask |= (starts < b) & (ends > a)
    return mask & (ends > starts)


def check_contents(conv: Conversation, specials: list[str]) -> None:
    """A message may not contain a control token's text: it would be encoded as the token itself and
    could forge a turn (an injected `<|im_start|>assistant`)."""
    for i, m in enumerate(conv.messages):
        for text in _texts(m):
            for s in specials:
                if s and s in text:
                    raise DataError(f"message {i} ({m['role']}) contains the control token {s!r}")
    for s in specials:
        if s and any(s in text for text in strings(conv.tools or ())):
            raise DataError(f"the record's tools contain the control token {s!r}")


def _texts(message: dict) -> Iterator[str]:
    """What of a message the template renders: its content, and the strings of its tool fields."""
    if "content" in message:
        yield message["content"]
    if len(message) > 2 or "content" not in message:
        yield from strings([v for k, v in message.items() if k not in ("role", "content")])


def fit(example: Example, seq_len: int, overlong: str) -> Example | None:
    """`example` cut to seq_len tokens (overlong=truncate), or None when it does not fit (drop) or
    keeps no loss token."""
    if len(example.ids) > seq_len or not example.complete:
        if overlong == "drop":
            return None
        example = Example(example.ids[:seq_len], example.mask[:seq_len], complete=False)
    return example if example.mask[1:].any() else None  # mask[0] is never predicted


def batches(items: Iterable[T], chars: Callable[[T], int]) -> Iterator[list[T]]:
    """`items` in order, grouped by up to BATCH_ITEMS and BATCH_CHARS of message text (`chars`)."""
    batch: list[T] = []
    size = 0
    for item in items:
        n = chars(item)
        if batch and (len(batch) == BATCH_ITEMS or size + n > BATCH_CHARS):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


def message_chars(convs: Iterable[Conversation]) -> int:
    return sum(len(text) for c in convs for m in c.messages for text in _texts(m))
