"""Adapter for transformers' OLMo 2 (model_type olmo2).

A Llama-style decoder (SwiGLU, RoPE, RMSNorm) with two differences, both flags of our blocks:
  post-norm blocks, x + norm(attn(x)) and x + norm(mlp(x)), with no norm on the inputs
      (our norm_placement=post: `post_attention_layernorm` / `post_feedforward_layernorm`);
  one RMSNorm over the whole q and k projections before RoPE (our qk_norm, as OLMoE).
attention_bias puts biases on q/k/v/o and none in the MLP: our qkv_bias + attn_out_bias (as in Gemma).
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

MODEL_TYPES = ("olmo2",)
# transformers' Olmo2Config defaults for keys a config.json may leave out (5.x).
_DEFAULTS: dict[str, Any] = {"max_position_embeddings": 2048, "num_key_value_heads": None,
                             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

KEYS = KeyMap([
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attn_post_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
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


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for an OLMo 2 config.json dict."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        unsupported("hidden_act", act, "silu (SwiGLU)")
    refuse_common(hf)
    max_pos = int(hf.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"]))
    theta, scaling, long_len = llama._rope_from_hf(hf, max_pos)
    return dict(
        **shape_kwargs(hf, _DEFAULTS),
        max_seq_len=long_len or max_pos, norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", _DEFAULTS["rms_norm_eps"])),
        pos_embedding="rope", rope_theta=theta, rope_scaling=scaling, mlp="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", _DEFAULTS["tie_word_embeddings"])),
        dropout=0.0, attention_dropout=attention_dropout_of(hf), norm_placement="post", qk_norm=True,
        **attention_bias(hf),
    )


def claims(cfg: ModelConfig) -> bool:
    """Whether an export without a model_type is OLMo 2's: post-norm blocks say so."""
    return cfg.norm_placement == "post" and cfg.moe is None and cfg.arch == "decoder"


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """'olmo2', after checking that `cfg` is an OLMo 2; LmforgeError naming what is not."""
    requested = requested or "olmo2"
    problems = feature_problems(cfg, {"norm_placement": "post"}) + attention_bias_problems(cfg)
    for key, want in (("norm", "rmsnorm"), ("mlp", "swiglu"), ("pos_embedding", "rope"), ("qk_norm", True),
                      ("sliding_window", None), ("moe", None),
                      ("score_head", False), ("qk_norm_scope", "all"), *OTHER_FLAGS_OFF):
        if getattr(cfg, key) != want:
            problems.append(f"{key}={getattr(cfg, key)} (OLMo 2 has {key}={want})")
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested!r}: "
                           + "; ".join(problems))
    return requested


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of OLMo 2: Llama's shape and RoPE keys, attention_bias for q/k/v/o biases."""
    out = llama.config_to_hf(cfg, "llama")
    for key in ("attention_bias", "mlp_bias"):
        out.pop(key, None)
    out.update(architectures=["Olmo2ForCausalLM"], model_type="olmo2", attention_bias=cfg.qkv_bias)
    return out


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
