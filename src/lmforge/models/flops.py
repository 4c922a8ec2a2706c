"""Exact parameter counts and training FLOPs per token, from the config alone (no model needed)."""

from __future__ import annotations

from lmforge.config.schema import ModelConfig


def _per_layers(cfg: ModelConfig, count) -> int:
    """Sum of count(dense) over the blocks: the first moe.dense_layers of a mixture stay dense."""
    dense = cfg.n_layers if cfg.moe is None else cfg.moe.dense_layers
    return dense * count(True) + (cfg.n_layers - dense) * count(False)


def _mla_params(cfg: ModelConfig) -> tuple[int, int]:
    """(linear weights, norm weights and biases) of one multi-head latent attention."""
    a, d, H = cfg.mla, cfg.d_model, cfg.n_heads
    qk, qr, r = a.qk_nope_head_dim + a.qk_rope_head_dim, a.q_lora_rank, a.kv_lora_rank
    q = d * H * qk if qr is None else d * qr + qr * H * qk
    kv = d * (r + a.qk_rope_head_dim) + r * H * (a.qk_nope_head_dim + a.v_head_dim)
    weights = q + kv + H * a.v_head_dim * d
    other = r + (qr or 0)  # the latents' norms
    if a.attention_bias:  # on q_a, kv_a and the output projection
        other += (qr or 0) + r + a.qk_rope_head_dim + d
    return weights, other


def _layer_matmul_params(cfg: ModelConfig, active: bool = False, dense: bool = False) -> int:
    """Weights of the Linear layers in one block (the parameters that take part in matmuls); with
    `active`, of a mixture of experts only the top_k experts one token runs through; `dense`: a block
    with a dense MLP in a mixture-of-experts model."""
    d, q_dim, kv_dim, ff = (
        cfg.d_model,
        cfg.n_heads * cfg.resolved_head_dim,
        cfg.resolved_kv_heads * cfg.resolved_head_dim,
        cfg.resolved_d_ff,
    )
    attn = d * q_dim + 2 * d * kv_dim + q_dim * d if cfg.mla is None else _mla_params(cfg)[0]
    if cfg.moe is not None and not dense:
        m = cfg.moe
        ff_e = m.d_ff_expert or ff
        shared = m.n_shared_experts * (m.shared_d_ff or ff_e)
        experts = m.top_k if active else m.n_experts
        # router gate + routed SwiGLU experts + shared SwiGLU experts (+ their sigmoid gate)
        return attn + d * m.n_experts + experts * 3 * d * ff_e + 3 * d * shared + (d if m.shared_gate else 0)
    mlp = (3 if cfg.mlp in ("swiglu", "geglu") else 2) * d * ff
    return attn + mlp


def _layer_other_params(cfg: ModelConfig, dense: bool = False) -> int:
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
        if cfg.moe is None or dense:  # experts have no biases
            n += (2 if cfg.mlp in ("swiglu", "geglu") else 1) * ff + d  # w_gate/w_up, w_down
    if cfg.qk_norm:
        n += 2 * cfg.resolved_head_dim if cfg.qk_norm_scope == "head" else q_dim + kv_dim
    if cfg.mla is not None:
        n += _mla_params(cfg)[1]
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
    if cfg.arch == "t5":  # the output projection stays counted when tied, as below
        return t5_count_params(cfg) - (vocab * cfg.d_model if exclude_embeddings and not cfg.tie_embeddings
                                       else 0)
    blocks = _per_layers(
        cfg, lambda dense: _layer_matmul_params(cfg, active, dense) + _layer_other_params(cfg, dense))
    head = vocab * cfg.d_model  # output projection, or the token table it is tied to
    n = blocks + _norm_params(cfg) + head
    if exclude_embeddings:
        return n
    n += cfg.max_seq_len * cfg.d_model if cfg.pos_embedding == "learned" else 0
    return n + (0 if cfg.tie_embeddings else vocab * cfg.d_model)


def flops_per_token(cfg: ModelConfig, seq_len: int, objective=None) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len` (a T5: per token the
    run counts, of the rows its `objective` makes: `t5_run_flops_per_token`).

    = 6 * N + 3 * n_layers * n_heads * (qk_dim + v_dim) * seq_len, where

    - N is the number of parameters in matmuls: all Linear weights of the blocks plus the output
      projection (counted once, tied or not). A matmul costs 2 FLOPs per weight per token forward
      and 4 backward (input and weight gradients): 6 * N. Embedding lookups, norms and biases are
      not matmuls and are left out. A mixture of experts counts its active weights (the top_k
      routed experts, router and shared experts): MFU is measured against the FLOPs a token needs.
    - Attention scores QK^T and the weighted sum AV each cost 2 * head_dim FLOPs per head per
      (query, key) pair forward, i.e. 4 * H * D * T per token per layer over T keys; times 3 for
      training gives 12 * L * H * D * T. With causal masking a query sees on average T/2 keys, so
      only half is counted: 6 * L * H * D * T. With model.mla the scores use the query/key head size
      and the sum the value head size: 3 * L * H * (qk_dim + v_dim) * T.
    """
    if cfg.arch == "t5":
        return t5_run_flops_per_token(cfg, seq_len, objective)
    n_matmul = count_params(cfg, exclude_embeddings=True, active=True) - _non_matmul_params(cfg)
    v_dim = cfg.resolved_head_dim if cfg.mla is None else cfg.mla.v_head_dim
    attn = 3 * cfg.n_layers * cfg.n_heads * (cfg.resolved_head_dim + v_dim) * seq_len
    return float(6 * n_matmul + attn)


def adapter_flops_per_token(cfg: ModelConfig, seq_len: int, adapter_params: int, objective=None) -> float:
    """Training FLOPs per token with the base frozen and `adapter_params` low-rank adapter weights
    training (LoRA / DoRA / QLoRA): the base's matmuls need no weight gradients, so they cost 4 FLOPs
    per weight (2 forward, 2 for the input gradient) instead of 6; the adapters cost the full 6.
    Dequantising a 4-bit base is overhead, not model FLOPs, and is not counted. Autograd also skips
    the input gradient of block 0's q/k/v projections (nothing before them trains): under 1/n_layers
    of their share, left in the count."""
    if cfg.arch == "t5":
        return t5_run_flops_per_token(cfg, seq_len, objective, adapter_params)
    n_matmul = count_params(cfg, exclude_embeddings=True, active=True) - _non_matmul_params(cfg)
    return flops_per_token(cfg, seq_len) - 2.0 * n_matmul + 6.0 * adapter_params


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward-only FLOPs per token: a third of `flops_per_token` (2 of its 6 FLOPs per weight)."""
    return flops_per_token(cfg, seq_len) / 3.0


def _non_matmul_params(cfg: ModelConfig) -> int:
    return _per_layers(cfg, lambda dense: _layer_other_params(cfg, dense)) + _norm_params(cfg)


# ------------------------------------------------------------------------- encoder-decoder (T5)


def _t5_dims(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
    """(d_model, attention width H * D, feed-forward weights of a block, encoder and decoder blocks)."""
    d, inner = cfg.d_model, cfg.n_heads * cfg.resolved_head_dim
    ff = (3 if cfg.mlp == "geglu" else 2) * d * cfg.resolved_d_ff  # wi_0, wi_1, wo or wi, wo
    return d, inner, ff, cfg.n_layers, cfg.n_decoder_layers or cfg.n_layers


def t5_count_params(cfg: ModelConfig) -> int:
    """Parameters of models/t5.py's T5(cfg), tied weights once (`sum(p.numel() for p in
    model.parameters())`)."""
    d, inner, ff, n_enc, n_dec = _t5_dims(cfg)
    vocab = _require_vocab(cfg)
    rel = cfg.relative_attention_num_buckets * cfg.n_heads  # one bias table per stack
    enc = n_enc * (4 * d * inner + ff + 2 * d) + rel + d  # q k v o, feed-forward, 2 norms; final norm
    dec = n_dec * (8 * d * inner + ff + 3 * d) + rel + d  # self and cross attention, 3 norms
    return vocab * d * (1 if cfg.tie_embeddings else 2) + enc + dec


def t5_forward_flops(cfg: ModelConfig, enc_len: int, dec_len: int) -> float:
    """Forward FLOPs of one example of `enc_len` encoder and `dec_len` decoder tokens (2 per weight per
    token in each matmul; attention's two products 2 * H * D per query-key pair each):

    - encoder, per token and block: q, k, v, o and the feed-forward, and attention over all enc_len keys;
    - decoder, per token and block: self-attention's q, k, v, o, cross-attention's q and o, the
      feed-forward, causal self-attention (query i sees i + 1 keys: dec_len (dec_len + 1) / 2 pairs) and
      cross-attention over the enc_len encoder positions; cross-attention's k and v project each encoder
      position once per decoder block;
    - the head: d_model x vocab per decoder token (tied or not).
    Left out as no matmuls: embedding and relative-bias lookups, norms, activations, softmax, the tied
    head's d_model**-0.5 rescale."""
    d, inner, ff, n_enc, n_dec = _t5_dims(cfg)
    vocab = _require_vocab(cfg)
    S, L = enc_len, dec_len
    enc = n_enc * 2 * S * (4 * d * inner + ff)
    dec = n_dec * (2 * L * (6 * d * inner + ff) + 2 * S * 2 * d * inner)
    return float(enc + dec + 2 * L * d * vocab) + _t5_attention_flops(cfg, S, L)


def t5_flops_per_token(cfg: ModelConfig, enc_len: int, dec_len: int, tokens: int,
                       adapter_params: int | None = None) -> float:
    """Training FLOPs (forward + backward) of one example of (enc_len, dec_len) tokens, per one of the
    `tokens` that throughput counts for it (span corruption: the window's stream tokens, 64 for rows of
    58 and 14). Training is 3 forwards: each weight's input and weight gradients cost 2 FLOPs per token
    each, as do attention's two products' gradients. With `adapter_params` (LoRA / DoRA / QLoRA) the
    frozen base takes no weight gradient (2 of its 6 FLOPs per weight fall away) and the adapters cost 6
    per weight per token, counted at the mean of the two lengths (an encoder adapter sees enc_len tokens,
    a decoder one dec_len, cross-attention's k and v enc_len: not known from the count alone)."""
    forward = t5_forward_flops(cfg, enc_len, dec_len)
    total = 3 * forward
    if adapter_params is not None:
        weight_grads = forward - _t5_attention_flops(cfg, enc_len, dec_len)  # = the weights' forward FLOPs
        total = total - weight_grads + 6.0 * adapter_params * (enc_len + dec_len) / 2
    return total / tokens


def _t5_attention_flops(cfg: ModelConfig, enc_len: int, dec_len: int) -> float:
    """The forward FLOPs of attention's two products (no weights): what adapters leave unchanged."""
    _, inner, _, n_enc, n_dec = _t5_dims(cfg)
    S, L = enc_len, dec_len
    return float(n_enc * 4 * inner * S * S + n_dec * (2 * inner * L * (L + 1) + 4 * inner * L * S))


def t5_run_flops_per_token(cfg: ModelConfig, seq_len: int, objective=None,
                           adapter_params: int | None = None) -> float:
    """`t5_flops_per_token` of a run: an objective with `lengths(window)` (span corruption) makes rows of
    those lengths from windows of seq_len stream tokens; otherwise (rows of their own tokens) both rows
    are taken as seq_len long and the FLOPs counted per token read (2 * seq_len)."""
    lengths = getattr(objective, "lengths", None)
    if callable(lengths):
        enc, dec = lengths(seq_len)
        return t5_flops_per_token(cfg, enc, dec, seq_len, adapter_params)
    return t5_flops_per_token(cfg, seq_len, seq_len, 2 * seq_len, adapter_params)
