"""Sampling from lmforge's Transformer: temperature / top-k / top-p filtering (Hugging Face's order
and semantics) and batched generation through a KV cache.

`sample_replies` continues a batch of prompts of different lengths at once: they are left-padded,
padding keys are masked out and positions count real tokens only (as transformers' generate does),
so each continuation equals the one its prompt gets alone (greedy), and rows stop at a stop token.
Evaluation (exact match, `lmforge generate`) and RL rollouts share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lmforge.errors import LmforgeError
from lmforge.models.common.attention import KVCache
from lmforge.models.common.rope import stale_cache_length


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row of `logits` (B, V) -> LongTensor (B,).

    temperature 0 is greedy argmax. Otherwise logits / temperature, then top-k (keep the k largest,
    ties at the k-th value kept), then top-p (keep the smallest set of most likely tokens whose
    cumulative probability reaches top_p, at least one), in Hugging Face's order and semantics.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def filter_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """float32 scores (B, V): logits / temperature with the tokens that top-k / top-p drop set to -inf."""
    if temperature <= 0:
        raise LmforgeError(f"temperature must be > 0 to scale logits, got {temperature}")
    scores = logits.float() / temperature  # (B, V)
    if top_k is not None:
        if top_k < 1:
            raise LmforgeError(f"top_k must be >= 1, got {top_k}")
        kth = torch.topk(scores, min(top_k, scores.size(-1)), dim=-1).values[..., -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        if top_p <= 0:
            raise LmforgeError(f"top_p must lie in (0, 1], got {top_p}")
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1)  # ascending
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # (B, V)
        # Drop the least likely tokens while their total mass stays <= 1 - top_p; the most likely
        # token (last) is always kept.
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores



@torch.no_grad()
def sample_replies(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stops: set[int] | frozenset[int],
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    is_done: Callable[[list[int]], bool] | None = None,
) -> list[list[int]]:
    """The continuation of each prompt, up to and including its first stop token (a row that reaches
    max_new_tokens, or the model's max_seq_len, without one ends there). temperature 0 is greedy;
    otherwise tokens are drawn with `generator`. The model runs in eval mode; its mode is restored.

    is_done: a further test of a row's tokens so far (stop strings): sampling ends once every row
    has a stop token or passes it; such a row is returned whole (the caller cuts it)."""
    if not prompts or any(len(p) == 0 for p in prompts):
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
        ids[i, longest - len(p) :] = torch.as_tensor(list(p), device=device)
        mask[i, longest - len(p) : longest] = 1
    positions = (mask[:, :longest].cumsum(1) - 1).clamp(min=0)  # (N, P): real tokens count from 0
    was = model.training
    model.eval()
    try:
        dtype = param.dtype if param.is_floating_point() else torch.float32
        cache = KVCache(model, n, longest + steps, device=device, dtype=dtype)
        # Every token and position so far, to recompute the cache where RoPE's frequencies switch.
        all_ids = torch.zeros(n, longest + steps, dtype=torch.long, device=device)
        all_pos = torch.zeros(n, longest + steps, dtype=torch.long, device=device)
        all_ids[:, :longest], all_pos[:, :longest] = ids, positions
        stale_at = stale_cache_length(model.cfg.rope_scaling)
        stop = torch.as_tensor(sorted(stops), dtype=torch.long, device=device)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        out = []
        for t in range(steps):
            end = longest + t
            if stale_at is not None and end > stale_at >= cache.pos > 0:
                # longrope: this forward crosses the original length, so its frequencies switch to the
                # long factors for all positions; the cached keys were rotated with the short ones.
                # Recompute them, as transformers' generate does at this step.
                cache.reset()
                ids, positions = all_ids[:, :end], all_pos[:, :end]
            logits = model(ids, cache=cache, attention_mask=mask[:, :end], position_ids=positions)[:, -1]
            nxt = sample_next(logits, temperature, top_k, top_p, generator)  # (N,)
            out.append(nxt)
            done |= torch.isin(nxt, stop)
            if is_done is not None:
                rows = torch.stack(out, 1).tolist()
                for i in (~done).nonzero().flatten().tolist():
                    if is_done(rows[i]):
                        done[i] = True
            if bool(done.all()):
                break
            mask[:, end] = 1
            all_ids[:, end], all_pos[:, end] = nxt, positions[:, -1] + 1
            ids, positions = nxt[:, None], all_pos[:, end : end + 1]
    finally:
        model.train(was)
    replies = []
    for row in torch.stack(out, 1).tolist():
        cut = next((k + 1 for k, tok in enumerate(row) if tok in stops), len(row))
        replies.append(row[:cut])
    return replies
