"""Chatting with a model: prompts rendered by its chat template, batched greedy replies, and the
exact-match accuracy of replies to verifiable instruction tasks (lmforge.data.instruct_tasks).

A batch of prompts of different lengths is left-padded: padding keys are masked out and positions
count real tokens only (as transformers' generate does), so each reply equals the one its prompt
gets alone. A reply stops at the template's end-of-turn token (or EOS)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lmforge.data.chat_template import ChatTemplate, stop_ids
from lmforge.data.instruct_tasks import accuracy_by_task
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import LmforgeError
from lmforge.models.generation import sample_replies


class PromptTooLong(LmforgeError):
    """A conversation whose rendered text is longer than the model's context can hold."""


def chat_prompt_ids(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[dict],
                    max_len: int | None = None, tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of `messages` followed by the template's generation prompt (the assistant's turn);
    tools: the function definitions the template renders (None: no `tools` variable)."""
    return chat_prompts(template, tokenizer, [messages], max_len, tools=[tools])[0]


def chat_prompts(template: ChatTemplate, tokenizer: Tokenizer, conversations: Sequence[Sequence[dict]],
                 max_len: int | None = None, tools: Sequence[Sequence[dict] | None] | None = None
                 ) -> list[list[int]]:
    """`chat_prompt_ids` of each conversation, rendered in one batch. With `max_len` (the model's
    context), the render stops at the text that many tokens can hold and a conversation that goes on
    past it is PromptTooLong: the work is bounded by the context, not by the request."""
    limit = None if max_len is None else tokenizer.text_budget(max_len)
    out = []
    for i, r in enumerate(template.render_batch(conversations, add_generation_prompt=True, limit=limit,
                                                tools=tools)):
        if not r.complete:
            which = f"conversation {i}" if len(conversations) > 1 else "the conversation"
            room = f"the model's context of {max_len} tokens" if max_len else f"{len(r.text):,} characters"
            raise PromptTooLong(f"{which} rendered by {template.name} is longer than {room}; shorten the "
                                "messages")
        out.append(tokenizer.encode_chat(r.text)[0])
    return out


def greedy_replies(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    stops: set[int],
    device: torch.device | str | None = None,
) -> list[list[int]]:
    """The greedy continuation of each prompt, up to and excluding its first stop token."""
    replies = sample_replies(model, prompts, max_new_tokens, stops, temperature=0.0, device=device)
    return [r[:-1] if r and r[-1] in stops else r for r in replies]


def task_accuracy(
    model: nn.Module,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    records: list[dict],
    max_new_tokens: int = 24,
    batch_size: int = 32,
    device: torch.device | str | None = None,
) -> dict[str, tuple[int, int]]:
    """Exact-match accuracy per task of `model`'s greedy replies to `records` (instruct_tasks records:
    the reply to every message before the final assistant answer is scored against `answer`)."""
    stops = stop_ids(template, tokenizer)
    max_len = getattr(getattr(model, "cfg", None), "max_seq_len", None)
    prompts = chat_prompts(template, tokenizer, [_before_answer(r) for r in records], max_len)
    replies: list[str] = []
    for i in range(0, len(prompts), batch_size):
        for ids in greedy_replies(model, prompts[i : i + batch_size], max_new_tokens, stops, device):
            replies.append(tokenizer.decode(ids))
    return accuracy_by_task(records, replies)


def _before_answer(record: dict) -> list[dict]:
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise LmforgeError("a task record needs 'messages' (as lmforge.data.instruct_tasks writes them)")
    return messages[:-1] if messages[-1].get("role") == "assistant" else messages
