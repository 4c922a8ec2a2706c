"""Multi-head / grouped-query causal self-attention through `F.scaled_dot_product_attention`
(or, for packed rows on a GPU, flex attention with a block mask), and the preallocated key/value
cache used for generation."""

from __future__ import annotations

import warnings
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.models.common.linear import project
from lmforge.models.common.norm import RMSNorm
from lmforge.models.common.rope import apply_rope

# (k_buffer, v_buffer, pos): one layer's view of a KVCache; buffers are (B, n_kv_heads, max_len, D).
LayerKV = tuple[torch.Tensor, torch.Tensor, int]


def cache_shapes(cfg: ModelConfig, batch_size: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's two cache buffers: keys and values (batch, n_kv_heads, length, head_dim),
    or with model.mla the compressed latent (batch, 1, length, kv_lora_rank) and the shared rotated
    key part (batch, 1, length, qk_rope_head_dim) (models/common/mla.py)."""
    if cfg.mla is not None:
        m = cfg.mla
        return (batch_size, 1, length, m.kv_lora_rank), (batch_size, 1, length, m.qk_rope_head_dim)
    shape = (batch_size, cfg.resolved_kv_heads, length, cfg.resolved_head_dim)
    return shape, shape


class KVCache:
    """Per-layer key/value buffers, each (batch_size, n_kv_heads, max_len, head_dim), and `pos`,
    the number of positions already written. With model.mla the two buffers of a layer hold the
    compressed latent (batch_size, 1, max_len, kv_lora_rank) and the shared rotated key part
    (batch_size, 1, max_len, qk_rope_head_dim) instead.

    `model(ids, cache=cache)` writes the keys/values of `ids` at pos..pos+T-1 and advances `pos`.
    `model_or_cfg` is a Transformer (anything with a `.cfg`) or a ModelConfig.
    """

    def __init__(
        self,
        model_or_cfg,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        cfg: ModelConfig = getattr(model_or_cfg, "cfg", model_or_cfg)
        if max_len > cfg.max_seq_len:
            raise ValueError(
                f"KVCache max_len={max_len} exceeds model.max_seq_len={cfg.max_seq_len}; "
                "use a shorter cache or raise model.max_seq_len"
            )
        k_shape, v_shape = cache_shapes(cfg, batch_size, max_len)
        self.batch_size, self.max_len, self.pos = batch_size, max_len, 0
        self.k = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]

    def layer(self, i: int) -> LayerKV:
        """Layer i's buffers and the current position, as the attention module takes them."""
        return self.k[i], self.v[i], self.pos

    def reset(self) -> None:
        """Forget the cached positions (the buffers are overwritten on the next use)."""
        self.pos = 0


# Packed rows (several sequences per row, attention kept within each): how the block-diagonal causal
# attention is computed. "mask": SDPA with a dense (B, 1, T, T) boolean mask, what the CPU runs
# fastest. "flex": flex attention with a BlockMask built from the segment ids, which skips the
# 128 x 128 tiles that are fully masked. Measured on an H100 (bench/packed_attention.py: Llama-1B
# attention, batch 4 x 2048 packed with log-normal documents, bf16, forward + backward of 16 layers):
# SDPA + mask 29.5 ms, flex 19.5 ms inside a compiled model (20.6 eager), FlashAttention-2 varlen
# 25.3 ms (it needs cu_seqlens, a host sync); "auto" takes flex on CUDA and the mask elsewhere.
PACKED_KERNELS = ("auto", "mask", "flex")


def packed_kernel(choice: str, device: torch.device, dropout: float, head_dim: int) -> str:
    """The kernel `choice` ("auto", "mask" or "flex") resolves to on `device`. Flex attention has no
    dropout, and its GPU kernel wants a power-of-two head size of at least 16: the mask otherwise."""
    if choice not in PACKED_KERNELS:
        raise ValueError(f"packed attention kernel must be one of {PACKED_KERNELS}, got {choice!r}")
    if choice == "auto":
        choice = "flex" if device.type == "cuda" else "mask"
    gpu_sized = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    flex_fits = dropout == 0 and (device.type != "cuda" or gpu_sized)
    return choice if choice == "mask" or flex_fits else "mask"


@cache
def _compiled_flex():
    """flex_attention compiled once per process: uncompiled, it materialises every score."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_block_mask(segment_ids: torch.Tensor, window: int | None = None):
    """BlockMask of block-diagonal causal attention for packed rows: query i sees key j when both lie
    in the same segment and j <= i (and i - j < window with a sliding window). segment_ids (B, T)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (segment_ids[b, q_idx] == segment_ids[b, kv_idx]) & (kv_idx <= q_idx)
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    B, T = segment_ids.shape
    # Inside a compiled model the builder is traced with it; called eagerly, it is compiled itself.
    compile_it = not torch.compiler.is_compiling() and segment_ids.device.type == "cuda"
    return create_block_mask(mask_mod, B, None, T, T, device=segment_ids.device, _compile=compile_it)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, enable_gqa: bool,
         scale: float | None = None) -> torch.Tensor:
    """flex_attention over (B, H, T, D) tensors; compiled where the caller is not (on CUDA). scale:
    of the scores (None: 1/sqrt(D))."""
    from torch.nn.attention.flex_attention import flex_attention

    kw = dict(block_mask=block_mask, enable_gqa=enable_gqa, scale=scale)
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, **kw)
    if q.device.type == "cuda":
        return _compiled_flex()(q, k, v, **kw)
    # Elsewhere (tests of this path on a CPU) the reference implementation, which warns that it is one.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(q, k, v, **kw)


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float,
    dropout: float, causal: bool,
) -> torch.Tensor:
    """Attention whose scores are soft-capped, cap * tanh(s / cap), before the mask (Gemma 2): no fused
    kernel takes a score transform, so the scores exist whole. q (B, H, T, D), k/v (B, Hkv, S, D); mask
    as SDPA's (boolean, True = attend) or None (causal, top-left aligned, when `causal` and T > 1)."""
    T, S = q.size(-2), k.size(-2)
    if k.size(1) != q.size(1):
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, S, D)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, T, S)
    scores = torch.tanh(scores / cap) * cap
    if mask is None and causal and T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=dropout) if dropout > 0 else weights
    return torch.matmul(weights, v)  # (B, H, T, D)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None, causal: bool, dropout: float,
                   scale: float | None = None) -> torch.Tensor:
    """Attention whose softmax has one more logit per query head, `sinks` (H,), which takes weight but
    contributes no value: softmax([q.k * scale for each key, sink]) without the sink's column (scale
    None: 1 / sqrt(D), as SDPA's).

    q (B, H, T, D), k and v (B, Hkv, S, D), mask as Attention.forward takes it (a tensor or None) ->
    (B, H, T, D). SDPA has no place for the extra logit, so the scores are materialised; they are
    softmaxed in float32 (also under bf16), where an all-masked row is well defined (all weight on the sink).
    """
    assert mask is None or isinstance(mask, torch.Tensor), "a dense mask, not a BlockMask"
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    # Query heads grouped by the kv head they share (head h reads kv head h // G, as SDPA's enable_gqa).
    scores = q.view(B, Hkv, G, T, D) @ k.unsqueeze(2).transpose(-2, -1)  # (B, Hkv, G, T, S)
    scores = scores.float() * (D**-0.5 if scale is None else scale)
    if mask is None and causal and T > 1:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()  # SDPA's is_causal (top-left)
    if mask is not None:
        mask = mask if mask.dim() == 2 else mask.unsqueeze(2)  # (T, S) or (B, 1, 1, T, S)
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, Hkv, G, 1, 1).expand(B, Hkv, G, T, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :S]  # (B, Hkv, G, T, S)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout)
    out = probs.to(v.dtype) @ v.unsqueeze(2)  # (B, Hkv, G, T, D)
    return out.view(B, H, T, D)


class Attention(nn.Module):
    """Causal self-attention with optional RoPE, grouped-query heads and biases.

    Parameter names are part of the checkpoint format: `wq`, `wk`, `wv`, `wo`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.resolved_kv_heads
        self.head_dim = cfg.resolved_head_dim
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.wq = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=cfg.bias or cfg.attn_out_bias)
        # "all" (OLMoE / OLMo-2): one RMSNorm over the whole q (and k) projection; "head" (Qwen3): each
        # head's q and k normalised on their own, one weight of head_dim shared by the heads.
        self.qk_norm = cfg.qk_norm and cfg.qk_norm_scope == "all"
        self.qk_head_norm = cfg.qk_norm and cfg.qk_norm_scope == "head"
        if cfg.qk_norm:
            per_head = self.qk_head_norm
            offset = cfg.norm_weight_offset  # Gemma 3's per-head norms are (1 + w) norms too
            self.q_norm = RMSNorm(self.head_dim * (1 if per_head else self.n_heads), cfg.norm_eps, offset)
            self.k_norm = RMSNorm(self.head_dim * (1 if per_head else self.n_kv_heads), cfg.norm_eps, offset)
        # None: SDPA's default 1/sqrt(head_dim).
        self.scale = cfg.attention_multiplier
        # gpt-oss: one learned softmax logit per query head (see sink_attention); None costs nothing.
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if cfg.attn_sinks else None
        self.dropout = cfg.resolved_attention_dropout
        # Gemma: scores scaled by query_pre_attn_scalar ** -0.5, and optionally soft-capped (then
        # `softcapped_attention` replaces SDPA).
        if cfg.query_pre_attn_scalar is not None:
            self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcap
        # An encoder (BERT) attends both ways: mask None then means "every key", not "causal".
        self.causal = cfg.arch != "encoder"
        # SDPA's enable_gqa shares kv heads without materialising copies: same result as
        # repeat_interleave and 7-16% faster forward+backward on CPU (measured, torch 2.13).
        self.gqa = self.n_kv_heads != self.n_heads

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None = None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model).

        rope: (cos, sin), each (T, head_dim) or (B, T, head_dim), for the positions of x; None
            without RoPE.
        mask: boolean (T, S), or (B, 1, T, S) for padded batches, True = attend, or a flex
            attention BlockMask (packed rows, see `document_block_mask`); None = plain causal
            (top-left aligned, so with a cache it is only right for T == 1 or an empty cache; the
            Transformer builds a mask otherwise).
        kv: this layer's cache view; keys/values of x are written at pos..pos+T-1.
        """
        B, T, _ = x.shape
        q, k, v = project(x, (self.wq, self.wk, self.wv))  # (B, T, H*D), (B, T, Hkv*D) twice
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        if self.qk_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if kv is not None:
            k_buf, v_buf, pos = kv
            k_buf[:, :, pos : pos + T] = k
            v_buf[:, :, pos : pos + T] = v
            k, v = k_buf[:, :, : pos + T], v_buf[:, :, : pos + T]  # (B, Hkv, S, D)
        if self.sinks is not None:  # the Transformer builds no BlockMask for a model with sinks
            p = self.dropout if self.training else 0.0
            out = sink_attention(q, k, v, self.sinks, mask, self.causal, p, self.scale)  # (B, H, T, D)
            return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask
            out = flex(q, k, v, mask, self.gqa, self.scale)
            out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
            return self.wo(out)
        if self.softcap is not None:
            scale = self.scale if self.scale is not None else self.head_dim**-0.5
            dropout = self.dropout if self.training else 0.0
            out = softcapped_attention(q, k, v, mask, scale, self.softcap, dropout, self.causal)
            return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and mask is None and T > 1,
            enable_gqa=self.gqa,
            scale=self.scale,
        )  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.wo(out)
