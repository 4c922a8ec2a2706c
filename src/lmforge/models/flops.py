"""Exact parameter counts and training FLOPs per token, from the config alone (no model needed)."""

from __future__ import annotations

from lmforge.config.schema import ModelConfig


def _layer_matmul_params(cfg: ModelConfig, active: bool = False) -> int:
    """Weights of the Linear layers in one block (the parameters that take part in matmuls); with
    `active`, of a mixture of experts only the top_k experts one token runs through."""
    d, q_dim, kv_dim, ff = (
        cfg.d_model,
        cfg.n_heads * cfg.resolved_head_dim,
        cfg.resolved_kv_heads * cfg.resolved_head_dim,
        cfg.resolved_d_ff,
    )
    attn = d * q_dim + 2 * d * kv_dim + q_dim * d
    if cfg.moe is not None:
        m = cfg.moe
        ff_e = m.d_ff_expert or ff
        shared = m.n_shared_experts * (m.shared_d_ff or ff_e)
        experts = m.top_k if active else m.n_experts
        # router gate + routed SwiGLU experts + shared SwiGLU experts (+ their sigmoid gate)
        return attn + d * m.n_experts + experts * 3 * d * ff_e + 3 * d * shared + (d if m.shared_gate else 0)
    mlp = (3 if cfg.mlp in ("swiglu", "geglu") else 2) * d * ff
    return attn + mlp


def _layer_other_params(cfg: ModelConfig) -> int:
    """Biases and norm weights of one block."""
    d, q_dim, kv_dim, ff = (
        cfg.d_model,
        cfg.n_heads * cfg.resolved_head_dim,
        cfg.resolved_kv_heads * cfg.resolved_head_dim,
        cfg.resolved_d_ff,
    )
    n = 0
    if cfg.bias or cfg.qkv_bias:
        n += q_dim + 2 * kv_dim
    if cfg.bias or cfg.attn_out_bias:
        n += d  # wo
    if cfg.bias:
        if cfg.moe is None:  # experts have no biases
            n += (2 if cfg.mlp in ("swiglu", "geglu") else 1) * ff + d  # w_gate/w_up, w_down
    if cfg.qk_norm:
        n += 2 * cfg.resolved_head_dim if cfg.qk_norm_scope == "head" else q_dim + kv_dim
    norms = 4 if cfg.norm_placement == "sandwich" else 2  # sandwich: a pre and a post norm per sub-layer
    return n + norms * _norm_params(cfg)


def _norm_params(cfg: ModelConfig) -> int:
    return cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def _require_vocab(cfg: ModelConfig) -> int:
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size is not set; parameter and FLOP counts need it")
    return cfg.vocab_size


def count_params(cfg: ModelConfig, *, exclude_embeddings: bool = False, active: bool = False) -> int:
    """Number of parameters of `Transformer(cfg)`, tied weights counted once.

    Equal to `sum(p.numel() for p in model.parameters())`. With exclude_embeddings=True the token
    and position tables are left out but the output projection is counted, also when it is tied to
    the token table: it is a matmul, and this is the count that scaling laws and FLOPs use.
    With active=True a mixture of experts counts only the top_k routed experts a token runs through
    (its active parameters; the router and shared experts in full); a dense model is unchanged.
    """
    vocab = _require_vocab(cfg)
    blocks = cfg.n_layers * (_layer_matmul_params(cfg, active) + _layer_other_params(cfg))
    head = vocab * cfg.d_model  # output projection, or the token table it is tied to
    n = blocks + _norm_params(cfg) + head
    if exclude_embeddings:
        return n
    n += cfg.max_seq_len * cfg.d_model if cfg.pos_embedding == "learned" else 0
    return n + (0 if cfg.tie_embeddings else vocab * cfg.d_model)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`.

    = 6 * N + 6 * n_layers * n_heads * head_dim * seq_len, where

    - N is the number of parameters in matmuls: all Linear weights of the blocks plus the output
      projection (counted once, tied or not). A matmul costs 2 FLOPs per weight per token forward
      and 4 backward (input and weight gradients): 6 * N. Embedding lookups, norms and biases are
      not matmuls and are left out. A mixture of experts counts its active weights (the top_k
      routed experts, router and shared experts): MFU is measured against the FLOPs a token needs.
    - Attention scores QK^T and the weighted sum AV each cost 2 * head_dim FLOPs per head per
      (query, key) pair forward, i.e. 4 * H * D * T per token per layer over T keys; times 3 for
      training gives 12 * L * H * D * T. With causal masking a query sees on average T/2 keys, so
      only half is counted: 6 * L * H * D * T.
    """
    n_matmul = count_params(cfg, exclude_embeddings=True, active=True) - _non_matmul_params(cfg)
    attn = 6 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len
    return float(6 * n_matmul + attn)


def adapter_flops_per_token(cfg: ModelConfig, seq_len: int, adapter_params: int) -> float:
    """Training FLOPs per token with the base frozen and `adapter_params` low-rank adapter weights
    training (LoRA / DoRA / QLoRA): the base's matmuls need no weight gradients, so they cost 4 FLOPs
    per weight (2 forward, 2 for the input gradient) instead of 6; the adapters cost the full 6.
    Dequantising a 4-bit base is overhead, not model FLOPs, and is not counted. Autograd also skips
    the input gradient of block 0's q/k/v projections (nothing before them trains): under 1/n_layers
    of their share, left in the count."""
    n_matmul = count_params(cfg, exclude_embeddings=True, active=True) - _non_matmul_params(cfg)
    return flops_per_token(cfg, seq_len) - 2.0 * n_matmul + 6.0 * adapter_params


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward-only FLOPs per token: a third of `flops_per_token` (2 of its 6 FLOPs per weight)."""
    return flops_per_token(cfg, seq_len) / 3.0


def _non_matmul_params(cfg: ModelConfig) -> int:
    return cfg.n_layers * _layer_other_params(cfg) + _norm_params(cfg)
