"""Adapter for transformers' Gemma 2 (gemma2) and Gemma 3 text (gemma3_text) decoders.

Both are RoPE decoders whose differences from Llama are flags of our blocks:
  RMSNorm as x * (1 + w) in float32 (norm_weight_offset=1), around both sub-layers (norm_placement
      sandwich: `input_layernorm` / `post_attention_layernorm` around attention,
      `pre_feedforward_layernorm` / `post_feedforward_layernorm` around the MLP);
  GeGLU MLP with GELU's tanh approximation (mlp=geglu); embeddings times sqrt(d_model) (embed_scale);
  attention scaled by query_pre_attn_scalar ** -0.5; sliding-window and full layers as `layer_types`
      says (transformers' default: every other layer slides in Gemma 2, five of six in Gemma 3);
  Gemma 2: attention scores and final logits soft-capped (attn_logit_softcap, final_logit_softcap).
  Gemma 3: per-head q/k RMSNorm ((1 + w) form); the sliding layers' RoPE base is
      rope_local_base_freq (our rope_local_theta) without scaling, the full layers' rope_theta with
      rope_scaling. transformers' Gemma 3 ignores attn_logit_softcapping, so a config that sets it is
      refused rather than built differently.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import llama
from lmforge.models.hf.blockflags import (
    OTHER_FLAGS_OFF,
    attention_bias,
    attention_bias_problems,
    attention_dropout_of,
    feature_problems,
    refuse_common,
    shape_kwargs,
)
from lmforge.models.hf.keymap import KeyMap, unsupported

MODEL_TYPES = ("gemma2", "gemma3_text")
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# transformers' config defaults for keys a config.json may leave out (5.x).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"max_position_embeddings": 8192, "num_key_value_heads": 4, "head_dim": 256,
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0, "rope_theta": 10000.0},
    "gemma3_text": {"max_position_embeddings": 131072, "num_key_value_heads": 4, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                    "sliding_window_pattern": 6},
}
_GELU_TANH = ("gelu_pytorch_tanh",)

KEYS = KeyMap([
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attn_post_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    ("layers.{i}.mlp_post_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
    ("layers.{i}.attn.wq.{p}", "model.layers.{i}.self_attn.q_proj.{p}"),
    ("layers.{i}.attn.wk.{p}", "model.layers.{i}.self_attn.k_proj.{p}"),
    ("layers.{i}.attn.wv.{p}", "model.layers.{i}.self_attn.v_proj.{p}"),
    ("layers.{i}.attn.wo.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.mlp.w_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.w_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.w_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
])


def _get(hf: dict[str, Any], key: str) -> Any:
    return hf[key] if key in hf else _DEFAULTS[hf["model_type"]].get(key)


# ---------------------------------------------------------------------------------------- config


def _layer_types(hf: dict[str, Any], n_layers: int) -> list[str]:
    """transformers' layer_types: the config's, else its family default pattern."""
    types = hf.get("layer_types")
    if types is None:
        # Gemma 2 slides on even layers; Gemma 3 on all but every sliding_window_pattern-th.
        pattern = 2 if hf["model_type"] == "gemma2" else int(_get(hf, "sliding_window_pattern"))
        if pattern < 1:
            unsupported("sliding_window_pattern", pattern, "a positive integer (every n-th layer is full)")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad or len(types) != n_layers:
        unsupported("layer_types", types, f"one of sliding_attention / full_attention per layer ({n_layers})")
    return list(types)


def _gemma3_rope(hf: dict[str, Any], max_pos: int) -> tuple[float, float, dict[str, Any] | None, int | None]:
    """(full layers' theta, sliding layers' theta, full layers' scaling kwargs, max_seq_len override)
    from transformers 5's per-layer-type rope_parameters or 4.x's rope_theta / rope_local_base_freq /
    rope_scaling (which applied to the full layers only)."""
    params = hf.get("rope_parameters")
    if params and all(isinstance(v, dict) for v in params.values()):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        full = {"rope_theta": _get(hf, "rope_theta"), **full}
        local_theta = local.get("rope_theta", _get(hf, "rope_local_base_freq"))
        local_kind = local.get("rope_type", local.get("type", "default"))
    elif params:
        unsupported("rope_parameters", params, "per-layer-type rope_parameters (full_attention / "
                    "sliding_attention), as transformers 5 writes Gemma 3's")
    else:
        full = {"rope_type": "default", **(hf.get("rope_scaling") or {})}
        full["rope_theta"] = _get(hf, "rope_theta")
        local_theta, local_kind = _get(hf, "rope_local_base_freq"), "default"
    if local_kind != "default":
        unsupported("rope_parameters.sliding_attention.rope_type", local_kind,
                    "default (RoPE scaling on the full-attention layers only)")
    theta, scaling, long_len = llama._rope_from_hf({"rope_parameters": full}, max_pos)
    return theta, float(local_theta), scaling, long_len


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a Gemma 2 / Gemma 3 text config.json dict."""
    model_type = hf["model_type"]
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        unsupported("hidden_activation", act, "gelu_pytorch_tanh (GeGLU with GELU's tanh approximation)")
    refuse_common(hf)
    shapes = shape_kwargs(hf, _DEFAULTS[model_type])
    n_layers = shapes["n_layers"]
    max_pos = int(_get(hf, "max_position_embeddings"))
    types = _layer_types(hf, n_layers)
    window = _get(hf, "sliding_window")
    if window is None and "sliding_attention" in types:
        unsupported("sliding_window", None, "an integer window for layer_types' sliding_attention layers")
    local_theta = None
    if model_type == "gemma2":
        rope_hf = {"rope_theta": _get(hf, "rope_theta"), **hf}
        theta, scaling, long_len = llama._rope_from_hf(rope_hf, max_pos)
    else:
        theta, local_theta, scaling, long_len = _gemma3_rope(hf, max_pos)
        if hf.get("attn_logit_softcapping") is not None:
            unsupported("attn_logit_softcapping", hf["attn_logit_softcapping"],
                        "null for gemma3_text (transformers' Gemma 3 attention does not apply it)")
        if "sliding_attention" not in types:
            local_theta = None  # no layer would use it
    attn_cap, final_cap = _get(hf, "attn_logit_softcapping"), _get(hf, "final_logit_softcapping")
    return dict(
        **shapes,
        max_seq_len=long_len or max_pos, norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        pos_embedding="rope", rope_theta=theta, rope_scaling=scaling, mlp="geglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), dropout=0.0,
        attention_dropout=attention_dropout_of(hf),
        sliding_window=int(window) if "sliding_attention" in types else None,
        norm_placement="sandwich", norm_weight_offset=1.0, embed_scale=True,
        query_pre_attn_scalar=int(_get(hf, "query_pre_attn_scalar")),
        attn_logit_softcap=None if attn_cap is None else float(attn_cap),
        final_logit_softcap=None if final_cap is None else float(final_cap),
        layer_types=types, rope_local_theta=local_theta,
        **_qk_norm_kwargs(model_type), **attention_bias(hf),
    )


def _qk_norm_kwargs(model_type: str) -> dict[str, Any]:
    """Gemma 3 normalises each head of q and k (the (1 + w) form, as all its norms); Gemma 2 does not."""
    return dict(qk_norm=True, qk_norm_scope="head") if model_type == "gemma3_text" else {}


def claims(cfg: ModelConfig) -> bool:
    """Whether an export without a model_type is a Gemma: the (1 + w) norms say so."""
    return cfg.norm_weight_offset == 1.0 and cfg.moe is None and cfg.arch == "decoder"


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """gemma2 or gemma3_text (by the q/k norm, unless requested), after checking that `cfg` is one."""
    requested = requested or ("gemma3_text" if cfg.qk_norm else "gemma2")
    gemma3 = requested == "gemma3_text"
    allowed = {"norm_placement": "sandwich", "norm_weight_offset": 1.0, "embed_scale": True,
               "query_pre_attn_scalar": any, "layer_types": any, "final_logit_softcap": any,
               "attn_logit_softcap": None if gemma3 else any, "rope_local_theta": any if gemma3 else None}
    problems = feature_problems(cfg, allowed) + attention_bias_problems(cfg)
    wants = (("norm", "rmsnorm"), ("mlp", "geglu"), ("pos_embedding", "rope"), ("qk_norm", gemma3),
             ("moe", None), ("score_head", False),
             *OTHER_FLAGS_OFF)
    if gemma3:
        wants += (("qk_norm_scope", "head"),)
    for key, want in wants:
        if getattr(cfg, key) != want:
            problems.append(f"{key}={getattr(cfg, key)} (Gemma has {key}={want})")
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested!r}: "
                           + "; ".join(problems))
    return requested


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of Gemma 2 / Gemma 3 text."""
    out = llama.config_to_hf(cfg, "llama")
    for key in ("attention_bias", "mlp_bias", "hidden_act"):
        out.pop(key, None)
    types = cfg.layer_types or [
        "sliding_attention" if cfg.sliding_window is not None else "full_attention"] * cfg.n_layers
    out.update(
        architectures=[ARCHITECTURES[model_type]], model_type=model_type,
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=cfg.qkv_bias, use_bidirectional_attention=False, layer_types=types,
        sliding_window=cfg.sliding_window,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.resolved_head_dim,
        attn_logit_softcapping=cfg.attn_logit_softcap, final_logit_softcapping=cfg.final_logit_softcap,
    )
    if model_type == "gemma3_text":
        full = out.pop("rope_parameters")
        out.pop("rope_scaling", None)
        # Without a base of their own, the sliding layers share the full layers' RoPE, scaling included.
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta} if cfg.rope_local_theta else full
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": dict(local)}
    return out


# --------------------------------------------------------------------------------------- weights


def import_names(hf_name: str, cfg: ModelConfig) -> list[str] | None:
    """Our parameter names filled by HF tensor `hf_name`: [] for known non-weights, None if unknown."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return []
    name = hf_name if hf_name.startswith(("model.", "lm_head.")) else "model." + hf_name
    if name == "lm_head.weight" and cfg.tie_embeddings:
        return []
    ours = KEYS.to_ours(name)
    return None if ours is None else [ours]


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    return [(ours, tensor) for ours in import_names(hf_name, cfg) or []]


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    return KEYS.to_hf(our_name) or our_name


def export_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter; the tied head is not written, nor PPO's value head."""
    for ours, tensor in state.items():
        if ours.startswith("value."):
            continue
        name = KEYS.to_hf(ours)
        assert name is not None, f"no HF name for {ours}"
        yield name, tensor
