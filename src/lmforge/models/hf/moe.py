"""Adapter for transformers' mixture-of-experts decoders: Mixtral, Qwen2-MoE and OLMoE.

Their attention, norms and RoPE are the Llama family's (same key names, no permutation); they differ
in the sparse MLP:
  mixtral    `block_sparse_moe.{gate, experts.{j}.w1/w3/w2}` (w1 gate, w3 up, w2 down); softmax router
             with renormalised top-k weights; optional sliding window on every layer.
  qwen2_moe  `mlp.{gate, experts.{j}.gate_proj/up_proj/down_proj}` plus one shared expert
             `mlp.shared_expert.*` scaled by sigmoid(`mlp.shared_expert_gate`); norm_topk_prob flag;
             q/k/v biases (qkv_bias).
  olmoe      the Qwen2-MoE expert names without a shared expert; RMSNorm over the whole q and k
             projections (`self_attn.q_norm` / `k_norm`, our qk_norm); norm_topk_prob flag.
  qwen3_moe  OLMoE's expert names; Qwen3's attention: RMSNorm over each head's q and k
             (qk_norm_scope=head), attention_bias on q/k/v/o; a sliding window on every layer or none.
transformers 5 keeps the experts as fused 3-D parameters `mlp.experts.gate_up_proj` (E, 2*d_ff, d) and
`mlp.experts.down_proj` (E, d, d_ff) in memory and converts to the per-expert names above when it saves;
both layouts are read here, the per-expert one is written (what 4.x and 5.x both load). Every router
computes its softmax in float32 over the logits of a bias-free gate, as ours does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import llama, qwen3
from lmforge.models.hf.blockflags import attention_dropout_of, feature_problems
from lmforge.models.hf.keymap import KeyMap, unsupported
from lmforge.models.hf.variants import extra_flags

MODEL_TYPES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# transformers' class defaults for keys a config.json may leave out (5.x).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "rope_theta": 1e6,
                "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.001},
    "qwen2_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 16, "rope_theta": 10000.0,
                  "rms_norm_eps": 1e-6, "router_aux_loss_coef": 0.001},
    "olmoe": {"max_position_embeddings": 4096, "num_key_value_heads": None, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.01},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "rope_theta": 10000.0,
                  "rms_norm_eps": 1e-6, "router_aux_loss_coef": 0.001},
}

_MOE = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp", "olmoe": "mlp", "qwen3_moe": "mlp"}
# Per-expert projection names: ours -> HF's, per family.
_PROJ = {
    "mixtral": {"w_gate": "w1", "w_up": "w3", "w_down": "w2"},
    "qwen2_moe": {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"},
    "olmoe": {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"},
    "qwen3_moe": {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"},
}

_COMMON = KeyMap([  # (ours, HF) of the non-expert tensors all three share
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.attn.wq.{p}", "model.layers.{i}.self_attn.q_proj.{p}"),
    ("layers.{i}.attn.wk.{p}", "model.layers.{i}.self_attn.k_proj.{p}"),
    ("layers.{i}.attn.wv.{p}", "model.layers.{i}.self_attn.v_proj.{p}"),
    ("layers.{i}.attn.wo.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.moe.shared.w_gate.weight", "model.layers.{i}.mlp.shared_expert.gate_proj.weight"),
    ("layers.{i}.moe.shared.w_up.weight", "model.layers.{i}.mlp.shared_expert.up_proj.weight"),
    ("layers.{i}.moe.shared.w_down.weight", "model.layers.{i}.mlp.shared_expert.down_proj.weight"),
    ("layers.{i}.moe.shared_gate.weight", "model.layers.{i}.mlp.shared_expert_gate.weight"),
])
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")


# ---------------------------------------------------------------------------------------- config


def _get(hf: dict[str, Any], key: str) -> Any:
    return hf.get(key, _DEFAULTS[hf["model_type"]].get(key))


def _window(hf: dict[str, Any], n_layers: int) -> int | None:
    model_type = hf["model_type"]
    if model_type == "olmoe":
        return None
    if model_type == "mixtral":
        return hf.get("sliding_window")
    if model_type == "qwen3_moe":  # the window (when used) is on every layer
        return hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    if not hf.get("use_sliding_window", False):
        return None
    # Qwen2-MoE's own default pattern slides on every other layer below max_window_layers.
    window = hf.get("sliding_window")
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < hf.get("max_window_layers", 28) else "full_attention"
        for i in range(n_layers)
    ]
    if set(types) == {"sliding_attention"} and window:
        return int(window)
    unsupported("use_sliding_window (layer_types)", types,
                "use_sliding_window=false, or a window on every layer")
    return None  # unreachable


def _check_every_layer_sparse(hf: dict[str, Any]) -> None:
    """Qwen3-MoE puts a dense MLP on the layers in mlp_only_layers and on those decoder_sparse_step
    skips: our blocks are all MoE or all dense, so only configs where every layer is sparse import."""
    step, dense = int(hf.get("decoder_sparse_step", 1)), hf.get("mlp_only_layers") or []
    if dense:
        unsupported("mlp_only_layers", dense, "[] (an MoE layer in every block)")
    if step != 1:
        unsupported("decoder_sparse_step", step, "1 (an MoE layer in every block)")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a Mixtral / Qwen2-MoE / OLMoE config.json dict."""
    model_type = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        unsupported("hidden_act", hf["hidden_act"], "silu (SwiGLU experts)")
    if float(hf.get("router_jitter_noise") or 0.0) > 0:
        unsupported("router_jitter_noise", hf["router_jitter_noise"], "0.0 (no router noise)")
    if hf.get("clip_qkv") is not None:
        unsupported("clip_qkv", hf["clip_qkv"], "null (unclipped q/k/v)")
    if model_type == "qwen3_moe":
        _check_every_layer_sparse(hf)
    if model_type == "qwen2_moe":
        if int(hf.get("decoder_sparse_step", 1)) != 1:
            unsupported("decoder_sparse_step", hf["decoder_sparse_step"], "1 (an MoE layer in every block)")
        if hf.get("mlp_only_layers"):
            unsupported("mlp_only_layers", hf["mlp_only_layers"], "[] (an MoE layer in every block)")
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_layers = int(hf["num_hidden_layers"])
    n_kv = _get(hf, "num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim")
    if head_dim is not None and d_model % n_heads == 0 and head_dim == d_model // n_heads:
        head_dim = None
    max_pos = int(_get(hf, "max_position_embeddings"))
    rope_hf = dict(hf)
    rope_hf.setdefault("rope_theta", _DEFAULTS[model_type]["rope_theta"])
    theta, scaling, long_len = llama._rope_from_hf(rope_hf, max_pos)
    # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts (its attribute_map): read both.
    n_experts = int(hf["num_local_experts"] if model_type == "mixtral" or "num_experts" not in hf
                    else hf["num_experts"])
    if n_experts < 1:
        unsupported("num_experts", n_experts, "at least 1 (a dense model is a llama / qwen2 model_type)")
    moe: dict[str, Any] = dict(
        n_experts=n_experts,
        top_k=int(hf["num_experts_per_tok"]),
        router_score="softmax",
        norm_topk_prob=True if model_type == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        # transformers pools f and P over layers before the product: the "model" scope.
        aux_loss_coef=float(_get(hf, "router_aux_loss_coef")),
        aux_loss_scope="model",
    )
    d_ff = int(hf["intermediate_size"])
    if model_type == "qwen2_moe":
        moe.update(d_ff_expert=int(hf["moe_intermediate_size"]), n_shared_experts=1,
                   shared_d_ff=int(hf["shared_expert_intermediate_size"]), shared_gate=True)
    if model_type == "qwen3_moe":  # intermediate_size is the width of mlp_only layers (refused above)
        moe.update(d_ff_expert=int(hf["moe_intermediate_size"]))
    bias = model_type == "olmoe" and bool(hf.get("attention_bias", False))
    out = dict(
        vocab_size=int(hf["vocab_size"]), d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(n_kv) if n_kv != n_heads else None, head_dim=head_dim, d_ff=d_ff,
        max_seq_len=long_len or max_pos, norm="rmsnorm", norm_eps=float(_get(hf, "rms_norm_eps")),
        pos_embedding="rope", rope_theta=theta, rope_scaling=scaling, mlp="swiglu", bias=bias,
        qkv_bias=model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)),
        qk_norm=model_type in ("olmoe", "qwen3_moe"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0,
        attention_dropout=attention_dropout_of(hf),
        sliding_window=_window(hf, n_layers), moe=moe,
    )
    if model_type == "qwen3_moe":  # Qwen3's attention: per-head q/k norm, attention_bias on q/k/v/o
        attn_bias = bool(hf.get("attention_bias", False))
        out.update(qk_norm_scope="head", qkv_bias=attn_bias, attn_out_bias=attn_bias)
    return out


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """The family member that expresses `cfg` (or check `requested`); LmforgeError when none does."""
    m = cfg.moe
    if m is None:
        raise LmforgeError("a dense model (model.moe unset) exports as llama, mistral, qwen2 or gpt2")
    per_head = cfg.qk_norm and cfg.qk_norm_scope == "head"
    if requested is None:
        requested = "qwen3_moe" if per_head else "olmoe" if cfg.qk_norm else (
            "qwen2_moe" if m.n_shared_experts else "mixtral")
    problems = [f"{f} (a setting {requested} does not have)"
                for f in extra_flags(cfg, qwen3.FLAGS if requested == "qwen3_moe" else ())]
    for key, value, want in (("norm", cfg.norm, "rmsnorm"), ("mlp", cfg.mlp, "swiglu"),
                             ("pos_embedding", cfg.pos_embedding, "rope"), ("moe.router_score",
                                                                           m.router_score, "softmax"),
                             ("rotary_fraction", cfg.rotary_fraction, 1.0)):
        if value != want:
            problems.append(f"{key}={value} (needs {want})")
    problems += feature_problems(cfg)  # norm placement, Gemma's features: not in these families
    if m.bias_balancing:
        problems.append("moe.bias_balancing routes with a learned per-expert bias that transformers' "
                        f"{requested} has no place for")
    # [issue-34 area: deepseek-mla] DeepSeek-V3's attention and routing (export as deepseek_v3)
    for key, value, off in (("model.mla", cfg.mla, None), ("moe.n_group", m.n_group, 1),
                            ("moe.routed_scaling", m.routed_scaling, 1.0),
                            ("moe.dense_layers", m.dense_layers, 0)):
        if value != off:
            problems.append(f"{key} is set ({requested} has no such setting; deepseek_v3 has)")
    if cfg.score_head:
        problems.append("score_head (a mixture-of-experts reward model has no transformers class here)")
    if requested not in ("olmoe", "qwen3_moe") and cfg.qk_norm:
        problems.append("qk_norm (only olmoe and qwen3_moe normalise q and k)")
    if requested != "qwen2_moe" and m.n_shared_experts:
        problems.append("shared experts (only qwen2_moe has one)")
    if requested == "mixtral":
        if cfg.bias or cfg.qkv_bias:
            problems.append("bias/qkv_bias (Mixtral has no biases)")
        if not m.norm_topk_prob:
            problems.append("moe.norm_topk_prob=false (Mixtral always renormalises the top-k weights)")
    elif requested == "qwen2_moe":
        if cfg.bias:
            problems.append("bias (Qwen2-MoE has q/k/v biases only: qkv_bias)")
        if not m.shared_gate or m.n_shared_experts == 0:
            problems.append("Qwen2-MoE has one shared expert with a sigmoid gate: needs "
                            "n_shared_experts >= 1 and moe.shared_gate=true")
        if cfg.sliding_window is not None:
            problems.append("sliding_window (export Qwen2-MoE without one)")
    elif requested == "olmoe":
        if not cfg.qk_norm:
            problems.append("qk_norm=false (OLMoE normalises q and k)")
        if cfg.qkv_bias and not cfg.bias:
            problems.append("qkv_bias without bias (OLMoE's attention_bias covers q/k/v/o)")
        if cfg.sliding_window is not None:
            problems.append("sliding_window (OLMoE has none)")
        if cfg.n_heads * cfg.resolved_head_dim != cfg.d_model:
            problems.append("n_heads * head_dim != d_model (OLMoE's q_norm has d_model weights)")
    elif requested == "qwen3_moe":
        if not per_head:
            problems.append("Qwen3-MoE normalises each head's q and k: needs qk_norm=true and "
                            "qk_norm_scope=head")
        if cfg.bias or cfg.qkv_bias != cfg.attn_out_bias:
            problems.append("Qwen3-MoE's attention_bias covers q/k/v/o: needs bias=false and qkv_bias = "
                            "attn_out_bias")
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested!r}: "
                           + "; ".join(problems))
    return requested


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of the family member `model_type` (checked by `model_type_for`)."""
    m = cfg.moe
    out = llama.config_to_hf(cfg, "mistral")  # the keys the Llama family shares (RoPE, sizes, eps)
    out.pop("sliding_window")
    out.update(architectures=[ARCHITECTURES[model_type]], model_type=model_type, num_experts_per_tok=m.top_k,
               router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False)
    if model_type == "mixtral":
        out.update(num_local_experts=m.n_experts, intermediate_size=m.d_ff_expert or cfg.resolved_d_ff,
                   sliding_window=cfg.sliding_window, router_jitter_noise=0.0)
    elif model_type == "qwen2_moe":
        out.update(num_experts=m.n_experts, moe_intermediate_size=m.d_ff_expert or cfg.resolved_d_ff,
                   shared_expert_intermediate_size=m.n_shared_experts * (m.shared_d_ff or m.d_ff_expert
                                                                         or cfg.resolved_d_ff),
                   norm_topk_prob=m.norm_topk_prob, qkv_bias=cfg.qkv_bias, decoder_sparse_step=1,
                   mlp_only_layers=[], use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.n_layers, layer_types=["full_attention"] * cfg.n_layers)
    elif model_type == "qwen3_moe":  # intermediate_size sizes only mlp_only layers: none here
        out.update(num_experts=m.n_experts, moe_intermediate_size=m.d_ff_expert or cfg.resolved_d_ff,
                   intermediate_size=cfg.resolved_d_ff, norm_topk_prob=m.norm_topk_prob,
                   attention_bias=cfg.qkv_bias, decoder_sparse_step=1, mlp_only_layers=[],
                   use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)
    else:
        out.update(num_experts=m.n_experts, intermediate_size=m.d_ff_expert or cfg.resolved_d_ff,
                   norm_topk_prob=m.norm_topk_prob, attention_bias=cfg.bias, clip_qkv=None)
    return out


# --------------------------------------------------------------------------------------- weights


def _canonical(hf_name: str) -> str:
    return hf_name if hf_name.startswith(("model.", "lm_head.")) else "model." + hf_name


def import_names(hf_name: str, cfg: ModelConfig) -> list | None:
    """Our parameters filled by HF tensor `hf_name`: names, or (name, expert) for one expert's row of a
    stacked parameter; [] for known non-weights, None if unknown."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return []
    name = _canonical(hf_name)
    if name == "lm_head.weight" and cfg.tie_embeddings:
        return []
    if m := _ROUTER.fullmatch(name):
        return [f"layers.{m[1]}.moe.router.gate.weight"]
    if m := _EXPERT.fullmatch(name):
        i, j, proj = m[1], int(m[2]), m[3]
        ours = {hf: o for family in _PROJ.values() for o, hf in family.items()}.get(proj)
        return None if ours is None else [(f"layers.{i}.moe.experts.{ours}", j)]
    if m := _FUSED.fullmatch(name):
        prefix = f"layers.{m[1]}.moe.experts."
        return [prefix + "w_gate", prefix + "w_up"] if m[2] == "gate_up_proj" else [prefix + "w_down"]
    ours = _COMMON.to_ours(name)
    return None if ours is None else [ours]


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[Any, torch.Tensor]]:
    """(our name or (name, expert), tensor) pairs for one HF tensor; a fused gate_up_proj splits in two."""
    names = import_names(hf_name, cfg) or []
    if len(names) == 2:  # gate_up_proj (E, 2 * d_ff, d): gate rows first, then up
        gate, up = tensor.chunk(2, dim=1)
        return [(names[0], gate), (names[1], up)]
    return [(n, tensor) for n in names]


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    """The HF name holding our parameter (for messages)."""
    if m := re.fullmatch(r"layers\.(\d+)\.moe\.experts\.(w_gate|w_up|w_down)", our_name):
        return f"model.layers.{m[1]}.<mlp>.experts.<j>.<{m[2]}> (one tensor per expert)"
    if m := re.fullmatch(r"layers\.(\d+)\.moe\.router\.gate\.weight", our_name):
        return f"model.layers.{m[1]}.<mlp>.gate.weight"
    return _COMMON.to_hf(our_name) or our_name


def export_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter in the per-expert layout; the tied head is not written."""
    model_type = model_type_for(cfg)
    block, proj = _MOE[model_type], _PROJ[model_type]
    for ours, tensor in state.items():
        if ours.startswith("value."):
            continue  # PPO's value head is training machinery, not part of the model
        if m := re.fullmatch(r"layers\.(\d+)\.moe\.router\.gate\.weight", ours):
            yield f"model.layers.{m[1]}.{block}.gate.weight", tensor
        elif m := re.fullmatch(r"layers\.(\d+)\.moe\.experts\.(w_gate|w_up|w_down)", ours):
            for j in range(tensor.shape[0]):
                yield f"model.layers.{m[1]}.{block}.experts.{j}.{proj[m[2]]}.weight", tensor[j]
        else:
            name = _COMMON.to_hf(ours)
            assert name is not None, f"no HF name for {ours}"
            yield name, tensor
