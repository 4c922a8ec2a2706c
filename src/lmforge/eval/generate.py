"""Autoregressive generation with a KV cache, and temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.errors import LmforgeError
from lmforge.models.common.attention import KVCache


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
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    num_samples: int = 1,
    seed: int = 0,
    eos_id: int | list[int] | None = None,
    device: torch.device | str | None = None,
) -> list[list[int]]:
    """Continue `prompt_ids`; returns the new tokens of each of `num_samples` samples.

    Samples run as one batch through a KV cache. A sample stops after emitting `eos_id` (or one of a
    list of them; which is
    included in its output). The total length (prompt + new tokens) is capped at the model's
    max_seq_len. Sampling uses its own generator seeded with `seed` (the global RNG is untouched),
    so the same seed gives the same tokens. The model runs in eval mode; its mode is restored after.
    """
    max_len = model.cfg.max_seq_len
    if not prompt_ids:
        raise LmforgeError("generate needs a non-empty prompt (at least one token id, e.g. a BOS token)")
    if len(prompt_ids) >= max_len:
        raise LmforgeError(
            f"prompt of {len(prompt_ids)} tokens leaves no room to generate: model.max_seq_len={max_len}; "
            "shorten the prompt"
        )
    param = next(model.parameters())
    device = torch.device(device) if device is not None else param.device
    steps = min(max_new_tokens, max_len - len(prompt_ids))
    if steps <= 0:
        return [[] for _ in range(num_samples)]

    stop_set = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    stops = torch.as_tensor(sorted(stop_set), dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        gen = torch.Generator(device=device).manual_seed(seed)
        cache = KVCache(model, num_samples, len(prompt_ids) + steps, device=device, dtype=param.dtype)
        ids = torch.tensor([prompt_ids] * num_samples, dtype=torch.long, device=device)  # (N, P)
        out = torch.empty(num_samples, steps, dtype=torch.long, device=device)
        done = torch.zeros(num_samples, dtype=torch.bool, device=device)
        n = 0
        for n in range(1, steps + 1):
            logits = model(ids, cache=cache)[:, -1, :]  # (N, V)
            ids = sample_next(logits, temperature, top_k, top_p, gen)[:, None]  # (N, 1)
            out[:, n - 1] = ids[:, 0]
            if eos_id is not None:
                done |= torch.isin(ids[:, 0], stops)
                if bool(done.all()):
                    break
    finally:
        model.train(was_training)

    result = []
    for row in out[:, :n].tolist():
        cut = next((k for k, t in enumerate(row) if t in stop_set), None)
        if cut is not None:
            row = row[: cut + 1]
        result.append(row)
    return result
