"""Rotary position embedding in the Llama "rotate_half" convention, with optional context scaling.

The same maths as transformers' `LlamaRotaryEmbedding` + `apply_rotary_pos_emb`: the head dimension
is split into two halves (not interleaved pairs), so HF Llama/Qwen2/Mistral weights load without
permuting q/k rows. The scaled variants (`linear`, `dynamic` NTK, `llama3`, `yarn`, `longrope`)
reproduce transformers' `_compute_*_parameters` op for op, so that the float32 tables are bit-identical
to theirs. yarn and longrope also scale cos and sin by an attention factor (baked into the tables).
Two kinds depend on the length of the forward: `dynamic` (past `original`, the base grows) and
`longrope` (past `original`, the long factors replace the short ones for every position);
`length_dependent_inv_frequencies` gives what such a forward needs.

`head_dim` arguments are the rotated dims of a head (`ModelConfig.rotary_dim`: all of them, or the
first fraction with partial rotary). `scaling` arguments are anything with the fields of
`RopeScalingConfig`; `original` is the resolved original context length (the config's value, or the
model's max_seq_len when unset).
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
    if kind == "yarn":
        return _yarn_inv_frequencies(head_dim, theta, scaling, original, device)
    if kind == "longrope":
        return _longrope_inv_frequencies(head_dim, theta, scaling.short_factor, device)
    raise ValueError(f"unknown RoPE scaling type {kind!r}; valid: linear, dynamic, llama3, yarn, longrope")


def attention_factor(scaling: Any | None, original: int | None = None) -> float:
    """The scale of cos and sin (1.0 except for yarn and longrope), in Python floats as transformers."""
    if scaling is None or scaling.type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    factor = scaling.factor
    if scaling.type == "longrope":
        # LongRoPE: sqrt(1 + ln(factor) / ln(original)), factor = extended / original length.
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:  # DeepSeek-V3's ratio form (falsy 0 as transformers)
        return float(mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim))
    return mscale(factor)


def _yarn_inv_frequencies(head_dim, theta, scaling, original, device) -> torch.Tensor:
    """YaRN (NTK-by-parts): frequencies that turn fewer than beta_slow times over the original context
    are divided by factor, those turning more than beta_fast times kept, a linear ramp in between."""
    factor = scaling.factor
    pos_freqs = theta ** _exponents(head_dim, device)  # (D/2,)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp.to(device=device)  # 1: extrapolate (keep), 0: interpolate (divide by factor)
    return interpolated * (1 - keep) + extrapolated * keep


def _longrope_inv_frequencies(head_dim, theta, factors, device) -> torch.Tensor:
    """LongRoPE: inv_freq[i] = 1 / (factors[i] * theta^(2i/D))."""
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    return 1.0 / (ext * theta ** _exponents(head_dim, device))


def length_dependent_inv_frequencies(
    head_dim: int, theta: float, scaling: Any | None, original: int, seq_len: int, device=None
) -> torch.Tensor | None:
    """The inverse frequencies for a forward whose largest position is seq_len - 1 where they differ
    from the precomputed tables (dynamic or longrope past `original`), else None."""
    if scaling is None or seq_len <= original:
        return None
    if scaling.type == "dynamic":
        return dynamic_inv_frequencies(head_dim, theta, scaling.factor, original, seq_len, device)
    if scaling.type == "longrope":
        return _longrope_inv_frequencies(head_dim, theta, scaling.long_factor, device)
    return None


def stale_cache_length(scaling: Any | None) -> int | None:
    """The length past which keys cached by shorter forwards were rotated differently and must be
    recomputed, as transformers' generate does (longrope: the switch to the long factors), else None."""
    if scaling is None or scaling.type != "longrope":
        return None
    return scaling.original_max_position_embeddings


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


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (*positions.shape, head_dim), for integer positions of any shape."""
    freqs = positions[..., None].float() * inv_freq  # (..., D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., D)
    if scale != 1.0:
        return emb.cos() * scale, emb.sin() * scale
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
    (i, i + head_dim/2). yarn and longrope tables include their attention factor.
    """
    inv_freq = inv_frequencies(head_dim, theta, scaling, original, device)  # (D/2,)
    t = torch.arange(max_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    scale = attention_factor(scaling, original)
    if scale != 1.0:
        return emb.cos() * scale, emb.sin() * scale
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by the angles of its positions.

    cos/sin are (T, R) when every row shares positions, or (B, T, R) for per-row positions; R < D
    (partial rotary) rotates the first R dims of each head and passes the others through.
    """
    # Cast like HF (tables stay float32 in buffers; under bf16 compute q/k are bf16).
    cos = cos.to(x.dtype).unsqueeze(-2)  # (T, 1, R) or (B, T, 1, R)
    sin = sin.to(x.dtype).unsqueeze(-2)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
