"""Attention masks of a bidirectional prefix followed by a causal part, per packed document (prefix LM;
GLM's part A / part B), as a dense boolean mask (what the CPU runs, SDPA with `attn_mask`) or a flex
attention BlockMask (GPU: it skips the 128 x 128 tiles that are fully masked, which a dense mask cannot).

One rule covers both objectives. `segment_ids` (B, T): the document each position belongs to (-1:
padding); `prefix_end` (B, T): for each position, the row index where its document's bidirectional part
ends (the document's first position + its prefix length). Query q sees key k when both lie in the same
document and k <= q (causal) or k < prefix_end[q] (k is in the document's prefix). So a prefix query
sees its whole prefix and nothing after it; a query after the prefix sees the prefix and the causal past.
"""

from __future__ import annotations

import torch


def prefix_dense_mask(segment_ids: torch.Tensor, prefix_end: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean mask, True = attend. Padding positions (segment -1) see themselves only, so
    that no softmax row is empty (an all-False row is NaN in some SDPA kernels)."""
    T = segment_ids.size(1)
    q = torch.arange(T, device=segment_ids.device)[:, None]  # (T, 1)
    k = torch.arange(T, device=segment_ids.device)[None, :]  # (1, T)
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] >= 0)  # (B, T, T)
    visible = (k <= q)[None] | (k[None] < prefix_end[:, :, None])  # (B, T, T)
    return ((same & visible) | (k == q)[None])[:, None]  # (B, 1, T, T)


def prefix_block_mask(segment_ids: torch.Tensor, prefix_end: torch.Tensor):
    """The same rule as a flex attention BlockMask (the padding's self-attention included)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        same = (segment_ids[b, q_idx] == segment_ids[b, kv_idx]) & (segment_ids[b, q_idx] >= 0)
        visible = (kv_idx <= q_idx) | (kv_idx < prefix_end[b, q_idx])
        return (same & visible) | (kv_idx == q_idx)

    B, T = segment_ids.shape
    # Inside a compiled model the builder is traced with it; called eagerly on a GPU it is compiled itself
    # (uncompiled, create_block_mask materialises the whole (B, T, T) mask).
    compile_it = not torch.compiler.is_compiling() and segment_ids.device.type == "cuda"
    return create_block_mask(mask_mod, B, None, T, T, device=segment_ids.device, _compile=compile_it)


def prefix_mask(segment_ids: torch.Tensor, prefix_end: torch.Tensor, kernel: str):
    """The mask for `kernel` ("mask": dense, "flex": BlockMask), as the model's packed-attention kernel
    resolves it (models/common/attention.py `packed_kernel`)."""
    if kernel == "flex":
        return prefix_block_mask(segment_ids, prefix_end)
    return prefix_dense_mask(segment_ids, prefix_end)


def check_prefix_inputs(B: int, T: int, segment_ids: torch.Tensor | None, prefix_end: torch.Tensor,
                        cache, attention_mask, cfg) -> None:
    """Refuse a prefix mask the forward cannot honour: it needs the segments, no cache or padding mask,
    and a model whose every layer takes the same mask (no sliding window, no per-layer attention kinds)."""
    if segment_ids is None or tuple(segment_ids.shape) != (B, T) or tuple(prefix_end.shape) != (B, T):
        raise ValueError(f"prefix_end needs segment_ids, both (batch, positions) = {(B, T)}")
    if cache is not None or attention_mask is not None:
        raise ValueError("prefix_end is for training rows: not with a cache or an attention_mask")
    if cfg.sliding_window is not None or cfg.layer_types is not None:
        raise ValueError(prefix_refusal(cfg))


def prefix_refusal(cfg) -> str | None:
    """Why a model of `cfg` (a ModelConfig) cannot take a bidirectional-prefix mask, or None."""
    if getattr(cfg, "arch", None) == "encoder":
        return ("model.arch=encoder attends both ways everywhere already; a bidirectional-prefix objective "
                "trains a decoder (model.arch=decoder)")
    if getattr(cfg, "sliding_window", None) is not None or getattr(cfg, "layer_types", None) is not None:
        return ("a model with sliding-window or per-layer attention kinds (model.sliding_window, "
                "model.layer_types) builds its own mask per layer kind, which a bidirectional prefix would "
                "bypass; train it with objective causal_lm, or unset model.sliding_window / layer_types")
    return None
