"""Gemma 2 and Gemma 3 (text) as llama.cpp's `gemma2` and `gemma3`.

What differs from a Llama, as llama.cpp's converter and graph (src/models/gemma2.cpp, gemma3.cpp) have it:
- every RMSNorm weight w is applied as (1 + w) by transformers and as w by llama.cpp: 1 + w is written
  (Gemma 3's per-head q/k norms included);
- the norms around both sub-layers (post_attention_norm, ffn_norm, post_ffw_norm), GeGLU with GELU's
  tanh approximation and the sqrt(d) embedding scale are built into the llama.cpp architectures;
- sliding-window layers: the window size and which layers slide (written as the per-layer
  sliding_window_pattern array, so any layer_types reads back as it is), and Gemma 3's local RoPE base;
- soft-capping of attention scores (Gemma 2) and of the final logits.

llama.cpp fixes some things Hugging Face configures, so those are refused by name (check, metadata):
the attention scale is 1/sqrt(head_dim) (1/sqrt(hidden/heads) at 46 layers for Gemma 2 and 62 for
Gemma 3: the 27B models), where transformers takes query_pre_attn_scalar; Gemma 2 always soft-caps
both and always ties the LM head to the embedding; neither has an o_proj bias."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, mapped, rope_keys

ARCHES = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
# llama.cpp's graphs take the 27B models' attention scale from hidden / heads, else from head_dim
_SCALE_BY_WIDTH_AT = {"gemma2": 46, "gemma3_text": 62}
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")


def _refuse(cfg: dict[str, Any], what: str) -> None:
    raise LmforgeError(f"GGUF export cannot write this {cfg['model_type']} model: {what}; llama.cpp's "
                       f"{ARCHES[cfg['model_type']]} architecture has no setting for it (use --format hf)")


def check(cfg: dict[str, Any]) -> None:
    model_type = cfg["model_type"]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        _refuse(cfg, f"hidden_activation={act!r} (llama.cpp's GeGLU uses GELU's tanh approximation)")
    if cfg.get("attention_bias"):
        _refuse(cfg, "attention_bias=true (llama.cpp's Gemma attention output has no bias)")
    if cfg.get("use_bidirectional_attention"):
        _refuse(cfg, "use_bidirectional_attention=true")
    n_layers, n_heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads)
    by_width = n_layers == _SCALE_BY_WIDTH_AT[model_type]
    theirs = cfg["hidden_size"] / n_heads if by_width else head_dim
    scalar = cfg.get("query_pre_attn_scalar", head_dim)
    if not math.isclose(float(scalar), float(theirs), rel_tol=1e-6):
        basis = (f"hidden_size / num_attention_heads = {theirs:g} at {n_layers} layers" if by_width
                 else f"head_dim = {head_dim}")
        _refuse(cfg, f"query_pre_attn_scalar={scalar} (llama.cpp scales attention by 1/sqrt({basis}))")
    if model_type == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is None:
                _refuse(cfg, f"{key}=null (llama.cpp's gemma2 always soft-caps)")
        if not cfg.get("tie_word_embeddings", True):
            _refuse(cfg, "tie_word_embeddings=false (llama.cpp's gemma2 reads its LM head from the "
                         "embedding)")
    else:
        if cfg.get("attn_logit_softcapping") is not None:
            _refuse(cfg, f"attn_logit_softcapping={cfg['attn_logit_softcapping']} (gemma3 does not soft-cap "
                         "attention)")
        _gemma3_rope_params(cfg)
    _sliding_layers(cfg)


def _sliding_layers(cfg: dict[str, Any]) -> list[bool]:
    """Which layers attend over the sliding window (the exported config.json always lists layer_types)."""
    types = cfg.get("layer_types")
    if types is None or len(types) != int(cfg["num_hidden_layers"]) or not set(types) <= {
            "sliding_attention", "full_attention"}:
        _refuse(cfg, f"layer_types={types!r} (one of sliding_attention / full_attention per layer)")
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and not cfg.get("sliding_window"):
        _refuse(cfg, "sliding_attention layers without a sliding_window")
    return sliding


def metadata(ctx: Context) -> None:
    w, cfg = ctx.writer, ctx.cfg
    w.add_context_length(int(cfg["max_position_embeddings"]))  # llama.cpp slides the window itself
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(ctx.n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(ctx.n_heads)
    w.add_head_count_kv(ctx.n_kv)
    w.add_key_length(ctx.head_dim)
    w.add_value_length(ctx.head_dim)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    sliding = _sliding_layers(cfg)
    if any(sliding) or ctx.arch == "gemma2":  # gemma2 always has a window: a pattern of no sliding layers
        w.add_sliding_window(int(cfg.get("sliding_window") or cfg["max_position_embeddings"]))
        w.add_sliding_window_pattern(sliding)
    if ctx.arch == "gemma2":
        w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        rope_keys(ctx)  # one RoPE for all layers; llama.cpp's gemma2 scales the sliding ones alike
        return
    if cfg.get("final_logit_softcapping") is not None:
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    _gemma3_rope(ctx)


def _gemma3_rope_params(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the full layers' RoPE parameters, the sliding layers' or None without sliding layers). llama.cpp
    applies no scaling to the sliding layers (as transformers' Gemma 3 with its default local RoPE) and
    the full layers' linear scaling to the others; its other scalings would reach the sliding layers."""
    from lmforge.models.hf import rope

    params = cfg.get("rope_parameters") or {}
    nested = bool(params) and all(isinstance(v, dict) for v in params.values())
    full = params.get("full_attention", {}) if nested else params
    local = params.get("sliding_attention", full) if nested else full
    if rope.rope_kind(full) not in ("default", "linear"):
        _refuse(cfg, f"RoPE scaling {rope.rope_kind(full)!r} on the full-attention layers (llama.cpp's "
                     "gemma3 takes linear only: its other scalings reach the sliding layers too)")
    if not any(_sliding_layers(cfg)):
        return full, None
    if rope.rope_kind(local) != "default":
        _refuse(cfg, f"RoPE scaling {rope.rope_kind(local)!r} on the sliding-window layers (llama.cpp's "
                     "gemma3 scales only the full-attention layers)")
    return full, local


def _gemma3_rope(ctx: Context) -> None:
    """The full layers' RoPE as the usual keys; the sliding layers' base as rope.freq_base_swa."""
    from lmforge.models.hf import rope

    full, local = _gemma3_rope_params(ctx.cfg)
    rope_keys(replace(ctx, cfg={**ctx.cfg, "rope_parameters": full}))
    if local is not None:
        ctx.writer.add_rope_freq_base_swa(rope.rope_theta(ctx.cfg, local))


def plan(ctx: Context):
    # transformers' Gemma norms multiply by (1 + w); llama.cpp's by the weight it reads
    return mapped(ctx, lambda name, t: t.float() + 1 if name.endswith("norm.weight") else t)
