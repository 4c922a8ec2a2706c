"""RoPE settings of a Hugging Face config.json <-> ModelConfig's rope_theta, rope_scaling and
rotary_fraction, for every family (Llama-style ones through `llama._rope_from_hf`, Phi-3 directly).

transformers 4.x writes top-level `rope_theta` + `rope_scaling`; 5.x writes `rope_parameters` (with
rope_theta and partial_rotary_factor inside). 5.x reads `rope_scaling` first, then `rope_parameters`,
and takes rope_theta / partial_rotary_factor from inside the dict, else from the top level: the same
precedence here. A key transformers does not know is refused; a known key that the given type does
not read (say original_max_position_embeddings on a linear scaling) changes nothing in transformers'
maths, so it changes nothing here either.
"""

from __future__ import annotations

from typing import Any

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf.keymap import unsupported

# The keys each type's maths reads in transformers 5.24 (modeling_rope_utils.py), beside the common ones.
TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings",
                 "attention_factor"),
}
COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
KNOWN_KEYS = frozenset(COMMON_KEYS).union(*TYPE_KEYS.values())


def rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The flat RoPE parameter dict of a config.json (empty without one); LmforgeError for a
    per-layer-type (nested) dict or a key transformers does not know."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise LmforgeError(f"config.json: rope_scaling / rope_parameters must be a mapping, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        unsupported("rope_parameters", "per-layer-type RoPE parameters", "one flat rope_parameters dict")
    unknown = sorted(set(params) - KNOWN_KEYS)
    if unknown:
        raise LmforgeError(
            f"unsupported Hugging Face config: rope_scaling / rope_parameters has the unknown key(s) "
            f"{', '.join(unknown)}; known keys: {', '.join(sorted(KNOWN_KEYS))}"
        )
    return params


def rope_kind(params: dict[str, Any]) -> str:
    """The rope type, as transformers reads it (rope_type, else the 4.x `type`, else default)."""
    return params.get("rope_type", params.get("type", "default"))


def rope_theta(hf: dict[str, Any], params: dict[str, Any]) -> float:
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def rotary_fraction(hf: dict[str, Any], params: dict[str, Any]) -> float:
    """partial_rotary_factor (1.0: RoPE over the whole head)."""
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return 1.0 if value is None else float(value)


def scaling_from_hf(
    params: dict[str, Any], max_pos: int, *, original: int | None = None, kinds: tuple[str, ...] | None = None
) -> tuple[dict[str, Any] | None, int | None]:
    """(rope_scaling kwargs or None, max_seq_len override or None) for the rope dict `params`.

    original: the family's top-level original_max_position_embeddings, which then wins over the dict's
    (Phi-3; transformers gives its config attribute priority). kinds: the types the family accepts.
    """
    kind = rope_kind(params)
    allowed = kinds or tuple(TYPE_KEYS)
    if kind not in allowed:
        unsupported("rope_scaling.rope_type", kind, ", ".join(allowed))
    if kind == "default":
        return None, None
    if original is None:
        original = params.get("original_max_position_embeddings") or max_pos
    original = int(original)
    factor = params.get("factor")
    if kind in ("yarn", "longrope") and factor is None:
        factor = max_pos / original  # transformers: the extended over the original context length
    if factor is None:
        raise LmforgeError(f"config.json: rope_scaling of type {kind} needs a 'factor'")
    scaling: dict[str, Any] = {"type": kind, "factor": float(factor)}
    if kind == "dynamic":
        # transformers' dynamic NTK is relative to max_position_embeddings (it ignores any
        # original_max_position_embeddings in the dict), and stretches the usable context by `factor`.
        scaling["original_max_position_embeddings"] = max_pos
        return scaling, int(max_pos * factor)
    if kind == "linear":
        return scaling, None
    scaling["original_max_position_embeddings"] = original
    if kind == "llama3":
        scaling["low_freq_factor"] = float(params["low_freq_factor"])
        scaling["high_freq_factor"] = float(params["high_freq_factor"])
    elif kind == "yarn":
        # transformers reads `x or default`: a 0 or null beta is the default, a 0 mscale is no mscale.
        scaling["beta_fast"] = float(params.get("beta_fast") or 32)
        scaling["beta_slow"] = float(params.get("beta_slow") or 1)
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if params.get(key) is not None:
                scaling[key] = float(params[key])
        scaling["truncate"] = bool(params.get("truncate", True))
    else:  # longrope
        for key in ("short_factor", "long_factor"):
            values = params.get(key)
            if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
                raise LmforgeError(f"config.json: rope_scaling.{key} must be a list of numbers, got "
                                   f"{values!r}")
            scaling[key] = [float(v) for v in values]
        if params.get("attention_factor") is not None:
            scaling["attention_factor"] = float(params["attention_factor"])
        # factor only sets the attention factor, which is 1.0 for any factor <= 1: keep it valid (>= 1).
        scaling["factor"] = max(scaling["factor"], 1.0)
    return scaling, None


def scaling_to_hf(cfg: ModelConfig) -> tuple[dict[str, Any], int]:
    """(rope dict without rope_theta, max_position_embeddings) that make transformers compute our RoPE."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return {"rope_type": "default"}, cfg.max_seq_len
    original = scaling.original_max_position_embeddings or cfg.max_seq_len
    rope: dict[str, Any] = {"rope_type": scaling.type, "factor": scaling.factor}
    if scaling.type == "dynamic":
        # transformers' dynamic NTK takes max_position_embeddings as the original length.
        return rope, original
    if scaling.type == "llama3":
        rope.update(original_max_position_embeddings=original, low_freq_factor=scaling.low_freq_factor,
                    high_freq_factor=scaling.high_freq_factor)
    elif scaling.type == "yarn":
        rope.update(original_max_position_embeddings=original, beta_fast=scaling.beta_fast,
                    beta_slow=scaling.beta_slow, truncate=scaling.truncate)
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(scaling, key) is not None:
                rope[key] = getattr(scaling, key)
    elif scaling.type == "longrope":
        rope.update(original_max_position_embeddings=original, short_factor=list(scaling.short_factor),
                    long_factor=list(scaling.long_factor))
        if scaling.attention_factor is not None:
            rope["attention_factor"] = scaling.attention_factor
    return rope, cfg.max_seq_len
