"""Autoregressive generation with a KV cache, and temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.errors import LmforgeError
from lmforge.models.common.attention import KVCache
from lmforge.models.common.rope import stale_cache_length
from lmforge.models.generation import filter_logits, sample_next

__all__ = ["filter_logits", "generate", "sample_next"]


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
        prompt = ids
        stale_at = stale_cache_length(model.cfg.rope_scaling)
        n = 0
        for n in range(1, steps + 1):
            if stale_at is not None and cache.pos + ids.shape[1] > stale_at >= cache.pos > 0:
                # longrope switches to its long factors here: recompute the keys cached with the short
                # ones, as transformers' generate does (see models/generation.py).
                cache.reset()
                ids = torch.cat([prompt, out[:, : n - 1]], dim=1)
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
