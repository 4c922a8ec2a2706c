"""Chatting with a model: prompts rendered by its chat template, batched greedy replies, and the
exact-match accuracy of replies to verifiable instruction tasks (lmforge.data.instruct_tasks).

A batch of prompts of different lengths is left-padded: padding keys are masked out and positions
count real tokens only (as transformers' generate does), so each reply equals the one its prompt
gets alone. A reply stops at the template's end-of-turn token (or EOS)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lmforge.data.chat_template import ChatTemplate
from lmforge.data.instruct_tasks import accuracy_by_task
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import LmforgeError
from lmforge.models.common.attention import KVCache


def chat_prompt_ids(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of `messages` followed by the template's generation prompt (the assistant's turn)."""
    ids, _ = tokenizer.encode_chat(template.render(list(messages), add_generation_prompt=True))
    return ids


def stop_ids(template: ChatTemplate, tokenizer: Tokenizer) -> set[int]:
    """Ids a reply ends at: the template's end-of-turn token and the tokenizer's EOS."""
    ids = {tokenizer.eos_id}
    if template.end_of_turn and tokenizer.token_id(template.end_of_turn) is not None:
        ids.add(tokenizer.token_id(template.end_of_turn))
    return ids


@torch.no_grad()
def greedy_replies(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    stops: set[int],
    device: torch.device | str | None = None,
) -> list[list[int]]:
    """The greedy continuation of each prompt, up to and excluding its first stop token."""
    if not prompts or any(not p for p in prompts):
        raise LmforgeError("every prompt needs at least one token")
    max_len = model.cfg.max_seq_len
    longest = max(map(len, prompts))
    steps = min(max_new_tokens, max_len - longest)
    if steps <= 0:
        raise LmforgeError(
            f"a prompt of {longest} tokens leaves no room to reply within model.max_seq_len={max_len}"
        )
    param = next(model.parameters())
    device = torch.device(device) if device is not None else param.device
    n = len(prompts)
    ids = torch.zeros(n, longest, dtype=torch.long, device=device)
    mask = torch.zeros(n, longest + steps, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.as_tensor(p)
        mask[i, longest - len(p) : longest] = 1
    positions = (mask[:, :longest].cumsum(1) - 1).clamp(min=0)  # (N, P): real tokens count from 0
    was = model.training
    model.eval()
    try:
        dtype = param.dtype if param.is_floating_point() else torch.float32
        cache = KVCache(model, n, longest + steps, device=device, dtype=dtype)
        stop = torch.as_tensor(sorted(stops), device=device)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        out = []
        for t in range(steps):
            end = longest + t
            logits = model(ids, cache=cache, attention_mask=mask[:, :end], position_ids=positions)[:, -1]
            nxt = logits.argmax(-1)  # (N,)
            out.append(nxt)
            done |= torch.isin(nxt, stop)
            if bool(done.all()):
                break
            mask[:, end] = 1
            ids, positions = nxt[:, None], positions[:, -1:] + 1
    finally:
        model.train(was)
    replies = []
    for row in torch.stack(out, 1).tolist():
        cut = next((k for k, tok in enumerate(row) if tok in stops), len(row))
        replies.append(row[:cut])
    return replies


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
    prompts = [chat_prompt_ids(template, tokenizer, _before_answer(r)) for r in records]
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
