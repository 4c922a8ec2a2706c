"""Adapter for transformers' gpt-oss (model_type gpt_oss).

A Llama-shaped decoder (RMSNorm, rotate-half RoPE, grouped-query attention, q/k/v/o biases with
attention_bias) with two differences our blocks express as flags:
  attention  `self_attn.sinks` (H,): one learned logit per query head inside every softmax
             (ModelConfig.attn_sinks);
  MoE        `mlp.router.{weight, bias}`: a router with a bias, top-k of the logits, softmax over the
             chosen ones (= our softmax scores renormalised over the top-k); experts with biases and
             the clamped SwiGLU (MoEConfig.router_bias, experts_bias, expert_act=clamped_swiglu).
The checkpoint stores the experts fused and transposed: `mlp.experts.gate_up_proj` (E, d, 2 * d_ff) with
gate in the even columns and up in the odd ones, `gate_up_proj_bias` (E, 2 * d_ff) interleaved alike,
`down_proj` (E, d_ff, d) and `down_proj_bias` (E, d). The same layout is written back.

RoPE is YaRN in the released models (`truncate: false`), or any type models/hf/rope.py reads. Layers
alternate sliding-window and full attention there (layer_types; transformers' default starts with a
sliding layer): our ModelConfig.layer_types with sliding_window; a model whose layers are all
full_attention imports with neither set.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import llama, rope
from lmforge.models.hf.blockflags import OTHER_FLAGS_OFF, feature_problems
from lmforge.models.hf.keymap import KeyMap, unsupported

MODEL_TYPES = ("gpt_oss",)
ARCHITECTURE = "GptOssForCausalLM"

# transformers' GptOssConfig defaults (5.x) for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001,
    "attention_bias": True, "tie_word_embeddings": False, "sliding_window": 128,
}
# GptOssConfig's RoPE when config.json has none (its rope_theta default is 150000).
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_DEFAULT_THETA = 150000.0

KEYS = KeyMap([
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.attn.wq.{p}", "model.layers.{i}.self_attn.q_proj.{p}"),
    ("layers.{i}.attn.wk.{p}", "model.layers.{i}.self_attn.k_proj.{p}"),
    ("layers.{i}.attn.wv.{p}", "model.layers.{i}.self_attn.v_proj.{p}"),
    ("layers.{i}.attn.wo.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
    ("layers.{i}.attn.sinks", "model.layers.{i}.self_attn.sinks"),
    ("layers.{i}.moe.router.gate.{p}", "model.layers.{i}.mlp.router.{p}"),
    ("layers.{i}.moe.experts.w_down", "model.layers.{i}.mlp.experts.down_proj"),
    ("layers.{i}.moe.experts.b_down", "model.layers.{i}.mlp.experts.down_proj_bias"),
])
# The fused, interleaved gate/up tensors: each fills two of our parameters.
_GATE_UP = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj(_bias)?")


# ---------------------------------------------------------------------------------------- config


def _get(hf: dict[str, Any], key: str) -> Any:
    value = hf.get(key)
    return _DEFAULTS[key] if value is None else value


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a gpt_oss config.json dict."""
    if float(hf.get("attention_dropout") or 0.0) > 0:
        unsupported("attention_dropout", hf["attention_dropout"], "0.0 (set model.dropout instead)")
    n_layers = int(hf["num_hidden_layers"])
    # transformers' default alternates sliding_attention and full_attention, starting with sliding.
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(n_layers)]
    if len(types) != n_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        unsupported("layer_types", types, f"{n_layers} entries, each full_attention or sliding_attention")
    # sliding_window is read only by sliding_attention layers: without any, the model has neither.
    window = None
    if "sliding_attention" in types:
        window = hf.get("sliding_window", _DEFAULTS["sliding_window"])
        if window is None:
            unsupported("sliding_window", None, "a window for the sliding_attention layers of layer_types")
        window = int(window)
    rope_hf = dict(hf)
    if not (hf.get("rope_scaling") or hf.get("rope_parameters")):
        rope_hf["rope_parameters"] = _DEFAULT_ROPE  # what GptOssConfig builds without one
    rope_hf.setdefault("rope_theta", _DEFAULT_THETA)
    max_pos = int(_get(hf, "max_position_embeddings"))
    theta, scaling, long_len = llama._rope_from_hf(rope_hf, max_pos)
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    # GptOssConfig: an absent key takes the class default (8 kv heads, head_dim 64), an explicit null
    # the derived value (n_heads, d_model // n_heads).
    n_kv = hf.get("num_key_value_heads", _DEFAULTS["num_key_value_heads"])
    n_kv = n_heads if n_kv is None else int(n_kv)
    head_dim = hf.get("head_dim", _DEFAULTS["head_dim"])
    head_dim = d_model // n_heads if head_dim is None else int(head_dim)
    n_experts = int(hf.get("num_local_experts", hf.get("num_experts", 128)))
    # hidden_act is not read: transformers' gpt-oss experts apply their clamped SwiGLU whatever it says.
    moe = dict(
        n_experts=n_experts, top_k=int(_get(hf, "num_experts_per_tok")), router_score="softmax",
        norm_topk_prob=True,  # a softmax over the chosen logits is the renormalised full softmax
        aux_loss_coef=float(_get(hf, "router_aux_loss_coef")), aux_loss_scope="model",
        router_bias=True, experts_bias=True, expert_act="clamped_swiglu",
        swiglu_alpha=float(_get(hf, "swiglu_alpha")), swiglu_limit=float(_get(hf, "swiglu_limit")),
    )
    return dict(
        vocab_size=int(hf["vocab_size"]), d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv if n_kv != n_heads else None,
        head_dim=None if d_model % n_heads == 0 and head_dim == d_model // n_heads else head_dim,
        d_ff=int(hf["intermediate_size"]), max_seq_len=long_len or max_pos, norm="rmsnorm",
        norm_eps=float(_get(hf, "rms_norm_eps")), pos_embedding="rope", rope_theta=theta,
        rope_scaling=scaling, mlp="swiglu", bias=bool(_get(hf, "attention_bias")), qkv_bias=False,
        tie_embeddings=bool(_get(hf, "tie_word_embeddings")), dropout=0.0, attn_sinks=True, moe=moe,
        sliding_window=window, layer_types=list(types) if window is not None else None,
    )


def foreign_features(cfg: ModelConfig) -> list[str]:
    """The settings of `cfg` that only gpt_oss expresses (another family's export must refuse them)."""
    m = cfg.moe
    out = ["attn_sinks"] if cfg.attn_sinks else []
    if m is not None:
        out += [f"moe.{k}" for k in ("router_bias", "experts_bias") if getattr(m, k)]
        out += ["moe.expert_act=clamped_swiglu"] if m.expert_act == "clamped_swiglu" else []
    return out


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """'gpt_oss' when `cfg` is expressible as one (LmforgeError naming what is not)."""
    requested = requested or "gpt_oss"
    m = cfg.moe
    problems = []
    for key, value, want in (("norm", cfg.norm, "rmsnorm"), ("pos_embedding", cfg.pos_embedding, "rope")):
        if value != want:
            problems.append(f"{key}={value} (needs {want})")
    if m is None:
        problems.append("model.moe unset (gpt-oss's MLPs are mixtures of experts)")
    else:
        if m.expert_act != "clamped_swiglu":
            problems.append(f"moe.expert_act={m.expert_act} (gpt-oss's experts use clamped_swiglu)")
        if m.router_score != "softmax" or not m.norm_topk_prob:
            problems.append("the router must be a softmax renormalised over the top-k (router_score=softmax, "
                            "norm_topk_prob=true)")
        if m.n_shared_experts:
            problems.append("shared experts (gpt-oss has none)")
        if m.bias_balancing:
            problems.append("moe.bias_balancing (gpt-oss has no place for a balancing bias)")
    if not cfg.attn_sinks:
        problems.append("attn_sinks=false (gpt-oss's attention has sink logits)")
    if cfg.qkv_bias and not cfg.bias:
        problems.append("qkv_bias without bias (gpt-oss's attention_bias covers q/k/v/o)")
    if cfg.qk_norm:
        problems.append("qk_norm (gpt-oss has none)")
    if cfg.rotary_fraction != 1.0:
        problems.append(f"rotary_fraction={cfg.rotary_fraction} (gpt-oss rotates whole heads)")
    problems += feature_problems(cfg, {"layer_types": any})  # Gemma / OLMo 2 block features
    problems += [f"{key}={getattr(cfg, key)!r} (gpt-oss has no such setting)" for key, off in OTHER_FLAGS_OFF
                 if getattr(cfg, key) != off]
    if cfg.score_head:
        problems.append("score_head (no gpt-oss reward-model class here)")
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested!r}: "
                           + "; ".join(problems))
    return requested


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of a gpt_oss model (checked by `model_type_for`)."""
    m = cfg.moe
    rope_dict, max_pos = rope.scaling_to_hf(cfg)
    every = "sliding_attention" if cfg.sliding_window else "full_attention"
    kinds = cfg.layer_types or [every] * cfg.n_layers
    return {
        "architectures": [ARCHITECTURE], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": m.d_ff_expert or cfg.resolved_d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.resolved_kv_heads, "head_dim": cfg.resolved_head_dim,
        "num_local_experts": m.n_experts, "num_experts_per_tok": m.top_k,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.bias, "attention_dropout": 0.0, "hidden_act": "silu",
        "swiglu_alpha": m.swiglu_alpha, "swiglu_limit": m.swiglu_limit,
        "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": False,
        # Without sliding layers no layer reads sliding_window, but transformers builds the sliding mask
        # whatever the layer types: it needs a value.
        "layer_types": kinds, "sliding_window": cfg.sliding_window or _DEFAULTS["sliding_window"],
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {**rope_dict, "rope_theta": cfg.rope_theta},
    }


# --------------------------------------------------------------------------------------- weights


def _canonical(hf_name: str) -> str:
    return hf_name if hf_name.startswith(("model.", "lm_head.")) else "model." + hf_name


def import_names(hf_name: str, cfg: ModelConfig) -> list | None:
    """Our parameters filled by HF tensor `hf_name`; [] for known non-weights, None if unknown."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return []
    name = _canonical(hf_name)
    if name == "lm_head.weight" and cfg.tie_embeddings:
        return []
    if m := _GATE_UP.fullmatch(name):
        kind = "b" if m[2] else "w"
        return [f"layers.{m[1]}.moe.experts.{kind}_gate", f"layers.{m[1]}.moe.experts.{kind}_up"]
    ours = KEYS.to_ours(name)
    return None if ours is None else [ours]


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[Any, torch.Tensor]]:
    """(our name, tensor) pairs for one HF tensor: the fused experts de-interleaved and transposed to
    our (E, out, in) layout."""
    names = import_names(hf_name, cfg) or []
    if len(names) == 2:  # gate_up_proj (E, d, 2 * d_ff) or its bias (E, 2 * d_ff): gate even, up odd
        gate, up = tensor[..., 0::2], tensor[..., 1::2]
        if tensor.dim() == 3:
            gate, up = gate.transpose(1, 2), up.transpose(1, 2)  # (E, d_ff, d)
        return [(names[0], gate), (names[1], up)]
    if names and names[0].endswith("experts.w_down"):
        return [(names[0], tensor.transpose(1, 2))]  # (E, d_ff, d) -> (E, d, d_ff)
    return [(n, tensor) for n in names]


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    """The HF name holding our parameter (for messages)."""
    if m := re.fullmatch(r"layers\.(\d+)\.moe\.experts\.([wb])_(gate|up)", our_name):
        suffix, columns = "_bias" if m[2] == "b" else "", "even" if m[3] == "gate" else "odd"
        return f"model.layers.{m[1]}.mlp.experts.gate_up_proj{suffix} ({m[3]}: its {columns} columns)"
    return KEYS.to_hf(our_name) or our_name


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(..., n) twice -> (..., 2n) with gate in the even and up in the odd columns."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def export_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter in gpt-oss's fused layout; absent biases (router_bias or
    experts_bias off) are written as zeros, which is the same model. The tied head is not written."""
    model_type_for(cfg)
    m = cfg.moe
    for ours, tensor in state.items():
        if ours.startswith("value."):
            continue  # PPO's value head is training machinery, not part of the model
        layer = re.fullmatch(r"layers\.(\d+)\.moe\.(.+)", ours)
        if layer is None:
            name = KEYS.to_hf(ours)
            assert name is not None, f"no HF name for {ours}"
            yield name, tensor
            continue
        i, rest, prefix = layer[1], layer[2], f"model.layers.{layer[1]}.mlp."
        if rest in ("experts.w_up", "experts.b_up"):
            continue  # written with its gate, interleaved
        if rest == "experts.w_gate":
            up = state[f"layers.{i}.moe.experts.w_up"]
            yield prefix + "experts.gate_up_proj", _interleave(tensor.transpose(1, 2), up.transpose(1, 2))
            if not m.experts_bias:
                E, d_ff = tensor.shape[:2]
                yield prefix + "experts.gate_up_proj_bias", tensor.new_zeros(E, 2 * d_ff)
        elif rest == "experts.b_gate":
            up = state[f"layers.{i}.moe.experts.b_up"]
            yield prefix + "experts.gate_up_proj_bias", _interleave(tensor, up)
        elif rest == "experts.w_down":
            yield prefix + "experts.down_proj", tensor.transpose(1, 2)
            if not m.experts_bias:
                yield prefix + "experts.down_proj_bias", tensor.new_zeros(tensor.shape[:2])
        else:
            yield KEYS.to_hf(ours), tensor
            if rest == "router.gate.weight" and not m.router_bias:
                yield prefix + "router.bias", tensor.new_zeros(tensor.shape[0])
