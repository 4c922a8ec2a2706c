"""Rotary position embedding in the Llama "rotate_half" convention.

The same maths as transformers' `LlamaRotaryEmbedding` + `apply_rotary_pos_emb`: the head dimension
is split into two halves (not interleaved pairs), so HF Llama/Qwen2/Mistral weights load without
permuting q/k rows.
"""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, max_len: int, theta: float, device: torch.device | str | None = None):
    """cos and sin tables, each (max_len, head_dim), computed in float32.

    inv_freq[i] = theta^(-2i/head_dim) for i < head_dim/2; the angle table is duplicated along the
    last dimension so that `x * cos + rotate_half(x) * sin` rotates the pairs (i, i + head_dim/2).
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (D/2,)
    t = torch.arange(max_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by the angles of its positions; cos/sin are (T, D) for those positions."""
    # Cast like HF (tables stay float32 in buffers; under bf16 compute q/k are bf16).
    cos = cos.to(x.dtype)[:, None, :]  # (T, 1, D)
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin
