"""Rotary position embedding in the Llama "rotate_half" convention, with optional context scaling.

The same maths as transformers' `LlamaRotaryEmbedding` + `apply_rotary_pos_emb`: the head dimension
is split into two halves (not interleaved pairs), so HF Llama/Qwen2/Mistral weights load without
permuting q/k rows. The scaled variants (`linear`, `dynamic` NTK, `llama3`) reproduce transformers'
`_compute_*_parameters` op for op, so that the float32 tables are bit-identical to theirs.

`scaling` arguments are anything with the fields of `RopeScalingConfig` (type, factor,
original_max_position_embeddings, low_freq_factor, high_freq_factor); `original` is the resolved
original context length (the config's value, or the model's max_seq_len when unset).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _exponents(head_dim: int, device: torch.device | str | None) -> torch.Tensor:
    # 2i / head_dim for i < head_dim/2, computed exactly as transformers does (int64 arange, then float).
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


def inv_frequencies(
    head_dim: int,
    theta: float,
    scaling: Any | None = None,
    original: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in float32 for positions up to the original length.

    For `dynamic` this is the unscaled table: NTK scaling only starts past `original`
    (see `dynamic_inv_frequencies`).
    """
    if scaling is None:
        return 1.0 / (theta ** _exponents(head_dim, device))
    kind, factor = scaling.type, scaling.factor
    if kind == "linear":
        inv_freq = 1.0 / (theta ** _exponents(head_dim, device))
        # Dividing the frequencies equals dividing the positions: angle = (pos / factor) * inv_freq.
        return inv_freq / factor
    if kind == "dynamic":
        # transformers evaluates its NTK formula at seq_len = original at init (in Python floats),
        # which normally leaves the base unchanged; do the same so the tables agree bit for bit.
        base = theta * ((factor * original / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** _exponents(head_dim, device))
    if kind == "llama3":
        return _llama3_inv_frequencies(head_dim, theta, scaling, original, device)
    raise ValueError(f"unknown RoPE scaling type {kind!r}; valid: linear, dynamic, llama3")


def _llama3_inv_frequencies(head_dim, theta, scaling, original, device) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly between."""
    inv_freq = 1.0 / (theta ** _exponents(head_dim, device))
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    low_freq_wavelen = original / low
    high_freq_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def dynamic_inv_frequencies(
    head_dim: int, theta: float, factor: float, original: int, seq_len: int, device=None
) -> torch.Tensor:
    """Dynamic NTK inverse frequencies for a forward whose largest position is seq_len - 1.

    base = theta * ((factor * seq_len / original) - (factor - 1)) ** (D / (D - 2)) for seq_len > original.
    transformers computes this at run time from a 0-d int64 tensor (so the base is a float32 tensor),
    and so do we: a Python-float base would round differently.
    """
    seq = torch.maximum(
        torch.tensor(seq_len, dtype=torch.int64, device=device),
        torch.tensor(original, dtype=torch.int64, device=device),
    )
    base = theta * ((factor * seq / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** _exponents(head_dim, device))


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (*positions.shape, head_dim), for integer positions of any shape."""
    freqs = positions[..., None].float() * inv_freq  # (..., D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., D)
    return emb.cos(), emb.sin()


def rope_tables(
    head_dim: int,
    max_len: int,
    theta: float,
    device: torch.device | str | None = None,
    scaling: Any | None = None,
    original: int | None = None,
):
    """cos and sin tables, each (max_len, head_dim), computed in float32.

    inv_freq[i] = theta^(-2i/head_dim) for i < head_dim/2 (rescaled per `scaling`); the angle table is
    duplicated along the last dimension so that `x * cos + rotate_half(x) * sin` rotates the pairs
    (i, i + head_dim/2).
    """
    inv_freq = inv_frequencies(head_dim, theta, scaling, original, device)  # (D/2,)
    t = torch.arange(max_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by the angles of its positions.

    cos/sin are (T, D) when every row shares positions, or (B, T, D) for per-row positions.
    """
    # Cast like HF (tables stay float32 in buffers; under bf16 compute q/k are bf16).
    cos = cos.to(x.dtype).unsqueeze(-2)  # (T, 1, D) or (B, T, 1, D)
    sin = sin.to(x.dtype).unsqueeze(-2)
    return x * cos + rotate_half(x) * sin
