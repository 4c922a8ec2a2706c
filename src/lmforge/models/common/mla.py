"""Multi-head latent attention (DeepSeek-V2 / V3): every head's keys and values are expanded from one
compressed latent per token, and a small key part carrying RoPE is shared by all heads.

    q        = wq(x), or wq_b(q_a_norm(wq_a(x)))                   (B, T, H, nope + rope)
    c, k_pe  = split(wkv_a(x)); c = kv_a_norm(c)                    (B, T, kv_lora_rank), (B, T, rope)
    k, v     = split(wkv_b(c)) per head; k = [k_nope, rope(k_pe)]   (B, H, S, nope + rope), (B, H, S, v)
    out      = wo(softmax(q k^T * scale) v)

softmax scale = (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 with yarn RoPE scaling.
The KV cache holds what MLA is for: the normalised latent c and the rotated k_pe, kv_lora_rank +
qk_rope_head_dim numbers per token and layer, whatever the head count; keys and values are expanded
from them on every forward (transformers' DeepseekV3Attention caches the same two tensors).
Parameter names are the checkpoint format: `wq` or `wq_a`, `q_a_norm`, `wq_b`; `wkv_a`, `kv_a_norm`,
`wkv_b`, `wo`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.models.common.attention import LayerKV, flex
from lmforge.models.common.linear import project
from lmforge.models.common.norm import RMSNorm
from lmforge.models.common.rope import apply_rope


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by pairs (x0, x1), (x2, x3), ...; the result lists the rotated first
    members, then the rotated second members (the layout transformers' interleaved RoPE returns: q and
    k get the same order, so their products are those of the interleaved rotation)."""
    half = cos.shape[-1] // 2  # the tables repeat their D/2 angles: the first half holds each pair's
    cos = cos[..., :half].to(x.dtype).unsqueeze(-2)  # (T, 1, D/2) or (B, T, 1, D/2)
    sin = sin[..., :half].to(x.dtype).unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def kv_cache_bytes_per_token(cfg: ModelConfig, itemsize: int = 2) -> int:
    """Bytes of KV cache one token takes over all layers (itemsize: bytes per number, 2 for bf16):
    kv_lora_rank + qk_rope_head_dim per layer with MLA, 2 * n_kv_heads * head_dim without."""
    per_layer = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim if cfg.mla is not None
                 else 2 * cfg.resolved_kv_heads * cfg.resolved_head_dim)
    return cfg.n_layers * per_layer * itemsize


def expanded_kv_bytes_per_token(cfg: ModelConfig, itemsize: int = 2) -> int:
    """What an MLA model's cache would take per token holding the expanded per-head keys and values
    (n_heads keys of nope + rope, n_heads values of v_head_dim per layer): the cache MLA avoids."""
    m = cfg.mla
    assert m is not None
    return cfg.n_layers * cfg.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * itemsize


def yarn_softmax_factor(cfg: ModelConfig) -> float:
    """DeepSeek's MLA also scales the softmax when its RoPE is yarn-extended with mscale_all_dim:
    by mscale(factor, mscale_all_dim)^2, mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1)."""
    sc = cfg.rope_scaling
    if sc is None or sc.type != "yarn" or not sc.mscale_all_dim or sc.factor <= 1:
        return 1.0
    m = 0.1 * sc.mscale_all_dim * math.log(sc.factor) + 1.0
    return m * m


class MLA(nn.Module):
    """Causal multi-head latent attention; `forward` takes the arguments of `Attention.forward`, with
    rope the (cos, sin) of width qk_rope_head_dim and kv a cache view of (latent, k_pe) buffers."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.n_heads, self.nope, self.rope_dim = cfg.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
        self.v_dim, self.kv_rank = m.v_head_dim, m.kv_lora_rank
        qk_dim = self.nope + self.rope_dim
        d, bias = cfg.d_model, m.attention_bias
        if m.q_lora_rank is None:
            self.wq = nn.Linear(d, self.n_heads * qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(d, m.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(m.q_lora_rank, eps=m.latent_norm_eps)
            self.wq_b = nn.Linear(m.q_lora_rank, self.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_norm = RMSNorm(self.kv_rank, eps=m.latent_norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, d, bias=bias)
        self.low_rank_q = m.q_lora_rank is not None
        self.rotate = apply_rope_interleaved if m.rope_interleave else apply_rope
        self.scale = qk_dim**-0.5 * yarn_softmax_factor(cfg)
        self.dropout = cfg.resolved_attention_dropout

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None = None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model); see `Attention.forward` for rope, mask and kv."""
        assert rope is not None, "MLA needs RoPE"
        B, T, _ = x.shape
        H = self.n_heads
        if self.low_rank_q:
            q_a, ckv = project(x, (self.wq_a, self.wkv_a))  # (B, T, q_rank), (B, T, kv_rank + rope)
            q = self.wq_b(self.q_a_norm(q_a))
        else:
            q, ckv = project(x, (self.wq, self.wkv_a))
        q_nope, q_pe = q.view(B, T, H, self.nope + self.rope_dim).split([self.nope, self.rope_dim], -1)
        c, k_pe = ckv.split([self.kv_rank, self.rope_dim], -1)
        c = self.kv_a_norm(c)  # (B, T, kv_rank)
        q_pe = self.rotate(q_pe, *rope)  # (B, T, H, rope)
        k_pe = self.rotate(k_pe.view(B, T, 1, self.rope_dim), *rope)[:, :, 0]  # (B, T, rope)
        if kv is not None:
            c_buf, pe_buf, pos = kv  # (B, 1, max_len, kv_rank), (B, 1, max_len, rope)
            c_buf[:, 0, pos : pos + T] = c
            pe_buf[:, 0, pos : pos + T] = k_pe
            c, k_pe = c_buf[:, 0, : pos + T], pe_buf[:, 0, : pos + T]  # (B, S, kv_rank), (B, S, rope)
        S = c.shape[1]
        k_nope, v = self.wkv_b(c).view(B, S, H, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(B, S, H, self.rope_dim)], -1).transpose(1, 2)
        q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)  # (B, H, T, nope + rope)
        v = v.transpose(1, 2)  # (B, H, S, v)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask (packed rows)
            out = flex(q, k, v, mask, False, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                is_causal=mask is None and T > 1, scale=self.scale,
            )  # (B, H, T, v)
        return self.wo(out.transpose(1, 2).reshape(B, T, H * self.v_dim))
