"""Helpers the OLMo 2 and Gemma adapters share: their config.json shape keys, the settings neither
can express, and the check that a ModelConfig uses no block feature a family lacks (norm placement,
Gemma's (1 + w) norms, embedding scale, soft-capping, query_pre_attn_scalar, per-layer attention
kinds): every exporter calls it, so such a model is never written as a family that would drop one."""

from __future__ import annotations

from typing import Any

from lmforge.config.schema import ModelConfig
from lmforge.models.hf.keymap import unsupported

# Our flag -> (its off value, how a problem reads).
_FEATURES: dict[str, tuple[Any, str]] = {
    "norm_placement": ("pre", "norm_placement={} (norms around the sub-layers)"),
    "norm_weight_offset": (0.0, "norm_weight_offset={} ((offset + w) RMSNorm)"),
    "embed_scale": (False, "embed_scale={} (embeddings times sqrt(d_model))"),
    "attn_logit_softcap": (None, "attn_logit_softcap={} (soft-capped attention scores)"),
    "final_logit_softcap": (None, "final_logit_softcap={} (soft-capped logits)"),
    "query_pre_attn_scalar": (None, "query_pre_attn_scalar={} (attention scale)"),
    "layer_types": (None, "layer_types={} (per-layer attention kinds)"),
    "rope_local_theta": (None, "rope_local_theta={} (a RoPE base for sliding layers)"),
}


# Other areas' block flags (issue 34: Qwen3 / Granite / SmolLM3) that OLMo 2 and Gemma do not have:
# (flag, its off value).
OTHER_FLAGS_OFF: tuple[tuple[str, Any], ...] = (
    ("embedding_multiplier", 1.0), ("residual_multiplier", 1.0),
    ("attention_multiplier", None), ("logits_scaling", 1.0), ("nope_layers", []),
)


def feature_problems(cfg: ModelConfig, allowed: dict[str, Any] | None = None) -> list[str]:
    """Problems for the block features `cfg` uses that a family cannot write. `allowed` maps a flag to
    the one value the family has (a set of values, or `any` for whatever the config says)."""
    allowed = allowed or {}
    problems = []
    for key, (off, text) in _FEATURES.items():
        value = getattr(cfg, key)
        want = allowed.get(key, off)
        ok = want is any or (value in want if isinstance(want, (set, frozenset)) else value == want)
        if not ok:
            problems.append(text.format(value if value is not None else "unset"))
    return problems


def shape_kwargs(hf: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """vocab_size, d_model, n_layers, heads, head_dim and d_ff from config.json keys; head_dim is kept
    only where it differs from d_model // n_heads, so round trips compare equal."""
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_kv = hf.get("num_key_value_heads", defaults.get("num_key_value_heads")) or n_heads
    head_dim = hf.get("head_dim", defaults.get("head_dim"))
    if head_dim is not None and d_model % n_heads == 0 and int(head_dim) == d_model // n_heads:
        head_dim = None
    return dict(
        vocab_size=int(hf["vocab_size"]), d_model=d_model, n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads, n_kv_heads=int(n_kv) if int(n_kv) != n_heads else None,
        head_dim=None if head_dim is None else int(head_dim), d_ff=int(hf["intermediate_size"]),
    )


def attention_bias(hf: dict[str, Any]) -> dict[str, Any]:
    """attention_bias: biases on q/k/v/o and none in the MLP, our qkv_bias + attn_out_bias."""
    on = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=on, attn_out_bias=on)


def attention_bias_problems(cfg: ModelConfig) -> list[str]:
    """What keeps `cfg`'s biases from being one attention_bias flag (q/k/v/o together, none elsewhere)."""
    if cfg.bias:
        return ["bias=true (biases in the MLP too; these families have attention biases only: set qkv_bias "
                "and attn_out_bias)"]
    if cfg.qkv_bias != cfg.attn_out_bias:
        return [f"qkv_bias={cfg.qkv_bias} with attn_out_bias={cfg.attn_out_bias} (attention_bias puts biases "
                "on q/k/v/o together)"]
    return []


def attention_dropout_of(hf: dict[str, Any]) -> float | None:
    """model.attention_dropout for a family whose only dropout is `attention_dropout` (None: none)."""
    return float(hf.get("attention_dropout") or 0.0) or None


def refuse_common(hf: dict[str, Any]) -> None:
    """The settings of both families that our blocks do not build."""
    if hf.get("use_bidirectional_attention"):
        unsupported("use_bidirectional_attention", hf["use_bidirectional_attention"], "false (causal)")
