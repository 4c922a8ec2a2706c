"""Which Llama-layout family expresses a model whose config sets the block flags of Qwen3, Granite or
SmolLM3, and the check that keeps every other family from silently dropping those flags on export.

Each flag is off at its ModelConfig default; a family lists the ones it writes into its config.json
(QWEN3_FLAGS, ...) and refuses the rest by name.
"""

from __future__ import annotations

from lmforge.config.schema import ModelConfig

# The ModelConfig fields of the qwen3-granite-smollm3 area: no family outside it writes them.
AREA_FLAGS = ("qk_norm_scope", "attn_out_bias", "embedding_multiplier", "residual_multiplier",
              "attention_multiplier", "logits_scaling", "nope_layers")
# The flags each family's config.json expresses.
QWEN3_FLAGS = ("qk_norm_scope", "attn_out_bias")
GRANITE_FLAGS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
SMOLLM3_FLAGS = ("nope_layers",)


def extra_flags(cfg: ModelConfig, allowed: tuple[str, ...] = ()) -> list[str]:
    """`key=value` of each area flag set away from its default and not in `allowed`."""
    out = []
    for key in AREA_FLAGS:
        default = ModelConfig.model_fields[key].get_default(call_default_factory=True)
        if key not in allowed and getattr(cfg, key) != default:
            out.append(f"{key}={getattr(cfg, key)!r}")
    return out


def dense_model_type(cfg: ModelConfig) -> str | None:
    """The dense model_type whose config.json holds the flags `cfg` sets, or None (the Llama family)."""
    if cfg.nope_layers:
        return "smollm3"
    if extra_flags(cfg, QWEN3_FLAGS + SMOLLM3_FLAGS):
        return "granite"
    if cfg.qk_norm and cfg.qk_norm_scope == "head":
        return "qwen3"
    return None
