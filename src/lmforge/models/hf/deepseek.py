"""Adapter for transformers' DeepSeek-V3 (`deepseek_v3`): multi-head latent attention (our model.mla)
and a sigmoid-scored, group-limited mixture of experts with shared experts after a few dense blocks.

    attention   self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm,
                kv_b_proj, o_proj  ->  attn.{wq | wq_a, q_a_norm, wq_b}, wkv_a, kv_a_norm, wkv_b, wo
    dense MLP   mlp.{gate,up,down}_proj (the first first_k_dense_replace blocks, of intermediate_size)
    MoE         mlp.gate.weight (router, sigmoid scores), mlp.gate.e_score_correction_bias (our
                moe.router.expert_bias: added to the scores for the choice only, as bias balancing does),
                mlp.experts.{j}.{gate,up,down}_proj (or transformers 5's fused gate_up_proj / down_proj),
                mlp.shared_experts.{gate,up,down}_proj (n_shared_experts * moe_intermediate_size wide)

RoPE is plain or yarn-extended (DeepSeek-V3's own config: factor 40 over 4096 positions); with yarn's
mscale_all_dim, MLA also scales its softmax (models/common/mla.py). Names are the same with and without
rope_interleave: the flag becomes mla.rope_interleave, which rotates
interleaved pairs as the checkpoint expects, so no row is permuted. The multi-token-prediction layers a
DeepSeek-V3 checkpoint carries past num_hidden_layers are not part of the causal LM: they are skipped on
import, as transformers skips them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import llama, rope
from lmforge.models.hf.keymap import KeyMap, unsupported

MODEL_TYPES = ("deepseek_v3",)
ARCHITECTURE = "DeepseekV3ForCausalLM"

# transformers' DeepseekV3Config defaults (5.x) for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_interleave": True, "attention_bias": False,
}
# transformers' DeepseekV3RMSNorm over the q and kv latents is built with its default epsilon.
LATENT_NORM_EPS = 1e-6

KEYS = KeyMap([  # (ours, HF) of every tensor but the routed experts
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attn.wq_a.{p}", "model.layers.{i}.self_attn.q_a_proj.{p}"),
    ("layers.{i}.attn.q_a_norm.weight", "model.layers.{i}.self_attn.q_a_layernorm.weight"),
    ("layers.{i}.attn.wq_b.weight", "model.layers.{i}.self_attn.q_b_proj.weight"),
    ("layers.{i}.attn.wkv_a.{p}", "model.layers.{i}.self_attn.kv_a_proj_with_mqa.{p}"),
    ("layers.{i}.attn.kv_a_norm.weight", "model.layers.{i}.self_attn.kv_a_layernorm.weight"),
    ("layers.{i}.attn.wkv_b.weight", "model.layers.{i}.self_attn.kv_b_proj.weight"),
    ("layers.{i}.attn.wo.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
    ("layers.{i}.mlp.w_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.w_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.w_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.moe.router.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    ("layers.{i}.moe.router.expert_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias"),
    ("layers.{i}.moe.shared.w_gate.weight", "model.layers.{i}.mlp.shared_experts.gate_proj.weight"),
    ("layers.{i}.moe.shared.w_up.weight", "model.layers.{i}.mlp.shared_experts.up_proj.weight"),
    ("layers.{i}.moe.shared.w_down.weight", "model.layers.{i}.mlp.shared_experts.down_proj.weight"),
])
_PROJ = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


# ---------------------------------------------------------------------------------------- config


def _get(hf: dict[str, Any], key: str) -> Any:
    return hf[key] if key in hf else _DEFAULTS[key]


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a DeepSeek-V3 config.json dict."""
    if hf.get("hidden_act", "silu") != "silu":
        unsupported("hidden_act", hf["hidden_act"], "silu (SwiGLU MLPs and experts)")
    if float(hf.get("attention_dropout") or 0.0) > 0:
        unsupported("attention_dropout", hf["attention_dropout"], "0.0 (set model.dropout instead)")
    # Keys of DeepSeek's own config.json that transformers does not read: a value other than V3's
    # would describe a model that neither transformers nor lmforge computes.
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if key in hf and hf[key] != want:
            unsupported(key, hf[key], f"{want!r} (DeepSeek-V3's)")
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_kv = hf.get("num_key_value_heads")
    if n_kv is not None and int(n_kv) != n_heads:
        unsupported("num_key_value_heads", n_kv, f"num_attention_heads={n_heads} (multi-head latent "
                    "attention expands keys and values for every head)")
    max_pos = int(_get(hf, "max_position_embeddings"))
    theta, scaling, long_len = llama._rope_from_hf(hf, max_pos)
    if scaling is not None and scaling["type"] != "yarn":
        # DeepSeek-V3 extends its context with yarn; transformers' MLA would also rescale its softmax by
        # another type's mscale_all_dim, which our RopeScalingConfig keeps for yarn only.
        unsupported("rope_scaling.rope_type", scaling["type"], "default or yarn for deepseek_v3")
    n_shared = int(_get(hf, "n_shared_experts") or 0)
    if n_shared < 1:
        unsupported("n_shared_experts", n_shared, "at least 1 (transformers always builds shared experts)")
    n_layers = int(hf["num_hidden_layers"])
    q_rank = _get(hf, "q_lora_rank")
    mla = dict(
        q_lora_rank=None if q_rank is None else int(q_rank), kv_lora_rank=int(_get(hf, "kv_lora_rank")),
        qk_nope_head_dim=int(_get(hf, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_get(hf, "qk_rope_head_dim")),
        v_head_dim=int(_get(hf, "v_head_dim")), rope_interleave=bool(_get(hf, "rope_interleave")),
        attention_bias=bool(_get(hf, "attention_bias")), latent_norm_eps=LATENT_NORM_EPS,
    )
    moe = dict(
        n_experts=int(_get(hf, "n_routed_experts")), top_k=int(_get(hf, "num_experts_per_tok")),
        d_ff_expert=int(_get(hf, "moe_intermediate_size")), n_shared_experts=n_shared, router_score="sigmoid",
        norm_topk_prob=bool(_get(hf, "norm_topk_prob")), n_group=int(_get(hf, "n_group") or 1),
        topk_group=int(_get(hf, "topk_group") or 1), routed_scaling=float(_get(hf, "routed_scaling_factor")),
        dense_layers=min(int(_get(hf, "first_k_dense_replace") or 0), n_layers),
        # DeepSeek-V3 balances its experts with the routing bias (e_score_correction_bias), not an
        # auxiliary loss (transformers' DeepseekV3 computes none): the bias is loaded and, while
        # training, moved by moe.bias_update_rate.
        bias_balancing=True, aux_loss_coef=0.0,
    )
    return dict(
        vocab_size=int(hf["vocab_size"]), d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        d_ff=int(_get(hf, "intermediate_size")), max_seq_len=long_len or max_pos, norm="rmsnorm",
        norm_eps=float(_get(hf, "rms_norm_eps")), pos_embedding="rope", rope_theta=theta,
        rope_scaling=scaling, mlp="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0, mla=mla, moe=moe,
    )


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """"deepseek_v3" when `cfg` is expressible as one; LmforgeError naming what is not."""
    requested = requested or "deepseek_v3"
    m, a = cfg.moe, cfg.mla
    problems = []
    if a is None:
        problems.append("model.mla is unset (DeepSeek-V3's attention is multi-head latent attention)")
    elif a.latent_norm_eps != LATENT_NORM_EPS:
        problems.append(f"mla.latent_norm_eps={a.latent_norm_eps} (transformers uses {LATENT_NORM_EPS})")
    if m is None:
        problems.append("model.moe is unset (DeepSeek-V3 is a mixture of experts; moe.dense_layers=n_layers "
                        "keeps every block dense)")
    else:
        if m.router_score != "sigmoid":
            problems.append(f"moe.router_score={m.router_score} (needs sigmoid)")
        if m.n_shared_experts < 1 or m.shared_gate or m.shared_d_ff not in (None, m.d_ff_expert):
            problems.append("DeepSeek-V3's shared experts are n_shared_experts >= 1 ungated experts as wide "
                            "as the routed ones (moe.shared_gate=false, shared_d_ff unset)")
    for key, value, want in (("norm", cfg.norm, "rmsnorm"), ("mlp", cfg.mlp, "swiglu")):
        if value != want:
            problems.append(f"{key}={value} (needs {want})")
    if cfg.rope_scaling is not None and cfg.rope_scaling.type != "yarn":
        problems.append(f"rope_scaling.type={cfg.rope_scaling.type} (DeepSeek-V3 takes yarn or none)")
    if cfg.score_head:
        problems.append("score_head (no DeepSeek-V3 reward model class here)")
    if requested not in MODEL_TYPES:
        problems.append(f"model_type {requested!r} is not a DeepSeek-V3 type")
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested!r}: "
                           + "; ".join(problems))
    return requested


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of DeepSeek-V3 (checked by `model_type_for`)."""
    from lmforge.models.moe import expert_d_ff

    m, a = cfg.moe, cfg.mla
    rope_dict, max_pos = rope.scaling_to_hf(cfg)
    return {
        "architectures": [ARCHITECTURE], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.resolved_d_ff,
        "moe_intermediate_size": expert_d_ff(cfg), "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "n_shared_experts": m.n_shared_experts, "n_routed_experts": m.n_experts,
        "routed_scaling_factor": m.routed_scaling, "kv_lora_rank": a.kv_lora_rank,
        "q_lora_rank": a.q_lora_rank,
        "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim,
        "qk_nope_head_dim": a.qk_nope_head_dim, "n_group": m.n_group, "topk_group": m.topk_group,
        "num_experts_per_tok": m.top_k, "first_k_dense_replace": m.dense_layers,
        "norm_topk_prob": m.norm_topk_prob, "hidden_act": "silu", "max_position_embeddings": max_pos,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {**rope_dict, "rope_theta": cfg.rope_theta},
        "rope_interleave": a.rope_interleave, "attention_bias": a.attention_bias, "attention_dropout": 0.0,
        # No multi-token-prediction module: the causal LM alone.
        "num_nextn_predict_layers": 0,
    }


# --------------------------------------------------------------------------------------- weights


def _canonical(hf_name: str) -> str:
    return hf_name if hf_name.startswith(("model.", "lm_head.")) else "model." + hf_name


def import_names(hf_name: str, cfg: ModelConfig) -> list | None:
    """Our parameters filled by HF tensor `hf_name`: names, or (name, expert) for one expert's row of a
    stacked parameter; [] for tensors deliberately skipped, None if unknown."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return []
    name = _canonical(hf_name)
    if name == "lm_head.weight" and cfg.tie_embeddings:
        return []
    if (layer := _LAYER.match(name)) and int(layer[1]) >= cfg.n_layers:
        return []  # a multi-token-prediction layer
    if m := _EXPERT.fullmatch(name):
        ours = {hf: o for o, hf in _PROJ.items()}[m[3]]
        return [(f"layers.{m[1]}.moe.experts.{ours}", int(m[2]))]
    if m := _FUSED.fullmatch(name):
        prefix = f"layers.{m[1]}.moe.experts."
        return [prefix + "w_gate", prefix + "w_up"] if m[2] == "gate_up_proj" else [prefix + "w_down"]
    ours = KEYS.to_ours(name)
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
        return f"model.layers.{m[1]}.mlp.experts.<j>.{_PROJ[m[2]]}.weight (one tensor per expert)"
    return KEYS.to_hf(our_name) or our_name


def export_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter in the per-expert layout; the tied head is not written. A
    router without a balancing bias gets a zero e_score_correction_bias (what it routes by)."""
    model_type_for(cfg)
    for ours, tensor in state.items():
        if ours.startswith("value."):
            continue  # PPO's value head is training machinery, not part of the model
        if m := re.fullmatch(r"layers\.(\d+)\.moe\.experts\.(w_gate|w_up|w_down)", ours):
            for j in range(tensor.shape[0]):
                yield f"model.layers.{m[1]}.mlp.experts.{j}.{_PROJ[m[2]]}.weight", tensor[j]
            continue
        name = KEYS.to_hf(ours)
        assert name is not None, f"no HF name for {ours}"
        yield name, tensor
        if (m := re.fullmatch(r"layers\.(\d+)\.moe\.router\.gate\.weight", ours)) and \
                f"layers.{m[1]}.moe.router.expert_bias" not in state:
            yield f"model.layers.{m[1]}.mlp.gate.e_score_correction_bias", torch.zeros(
                tensor.shape[0], dtype=torch.float32, device=tensor.device)


# ------------------------------------------------------------------------------------------ PEFT


def adapter_module(our_module: str) -> str:
    """The transformers module a LoRA adapter on our linear layer `our_module` belongs to (PEFT's name);
    LmforgeError for a layer whose adapter PEFT cannot hold."""
    targetable = ("the attention projections: wq (q_proj) or wq_a / wq_b (q_a_proj / q_b_proj), wkv_a "
                  "(kv_a_proj_with_mqa), wkv_b (kv_b_proj), wo (o_proj)")
    if re.fullmatch(r"layers\.\d+\.moe\.router\.gate", our_module):
        raise LmforgeError(
            f"{our_module}: DeepSeek-V3's router is no linear layer in transformers, so a PEFT adapter file "
            f"has no place for its adapter; the PEFT-targetable layers are {targetable}")
    if re.fullmatch(r"layers\.\d+\.(mlp|moe\.shared)\.w_(gate|up|down)", our_module):
        # PEFT (0.19) maps every gate_proj / up_proj / down_proj target of a deepseek_v3 model onto the
        # routed experts' fused parameters (transformers 5's layout), so the dense and shared MLPs'
        # adapters would land on other weights.
        raise LmforgeError(
            f"{our_module}: PEFT reads gate_proj / up_proj / down_proj targets of a deepseek_v3 model as its "
            f"routed experts' stacked weights, so this MLP adapter has no PEFT form; the PEFT-targetable "
            f"layers are {targetable} (or fold the adapters in with lmforge merge and export the model)")
    hf = KEYS.to_hf(our_module + ".weight")
    if hf is None:
        raise LmforgeError(f"{our_module} has no Hugging Face name, so its adapter has no PEFT name")
    return hf.removesuffix(".weight")
