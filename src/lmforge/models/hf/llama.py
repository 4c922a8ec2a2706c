"""Adapter for transformers' Llama, Mistral and Qwen2: one decoder, three sets of config keys.

All three are pre-norm RMSNorm + SwiGLU + RoPE decoders in the same "rotate_half" convention as ours,
so q/k rows load without permutation. They differ only in config keys:
  llama    attention_bias (q/k/v/o) and mlp_bias (gate/up/down);
  mistral  sliding_window on every layer;
  qwen2    always-on q/k/v bias; sliding window only with use_sliding_window, on layers >= max_window_layers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import rope
from lmforge.models.hf.blockflags import attention_dropout_of, feature_problems
from lmforge.models.hf.keymap import KeyMap, unsupported

MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# transformers' class defaults for keys a config.json may leave out (5.x; same in 4.4x).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "sliding_window": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096},
}

KEYS = KeyMap(
    [  # (ours, HF); {i} is the layer index, {p} weight or bias
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("score.{p}", "score.{p}"),  # a tagger's and a reader's have a bias (task_heads.py)
        ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        ("layers.{i}.attn.wq.{p}", "model.layers.{i}.self_attn.q_proj.{p}"),
        ("layers.{i}.attn.wk.{p}", "model.layers.{i}.self_attn.k_proj.{p}"),
        ("layers.{i}.attn.wv.{p}", "model.layers.{i}.self_attn.v_proj.{p}"),
        ("layers.{i}.attn.wo.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
        ("layers.{i}.mlp.w_gate.{p}", "model.layers.{i}.mlp.gate_proj.{p}"),
        ("layers.{i}.mlp.w_up.{p}", "model.layers.{i}.mlp.up_proj.{p}"),
        ("layers.{i}.mlp.w_down.{p}", "model.layers.{i}.mlp.down_proj.{p}"),
    ]
)


# ---------------------------------------------------------------------------------------- config


def _rope_from_hf(hf: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None, int | None]:
    """(rope_theta, rope_scaling kwargs or None, max_seq_len override or None) from either form
    (`rope_scaling` / `rope_parameters`; see models/hf/rope.py)."""
    params = rope.rope_params(hf)
    partial = rope.rotary_fraction(hf, params)
    if partial != 1.0:  # transformers' Llama-style attention rotates whole heads
        unsupported("partial_rotary_factor", partial, "1.0 (RoPE over the whole head)")
    scaling, max_seq_len = rope.scaling_from_hf(params, max_pos)
    return rope.rope_theta(hf, params), scaling, max_seq_len


def _window_from_hf(hf: dict[str, Any], model_type: str, n_layers: int) -> int | None:
    """The one sliding window all layers share, or None; mixed full/sliding layers are rejected."""
    window = hf.get("sliding_window", _DEFAULTS[model_type]["sliding_window"])
    if model_type == "llama":
        return None  # Llama has no sliding window; the key is ignored by transformers too
    if model_type == "mistral":
        return window
    if not hf.get("use_sliding_window", False):
        return None  # transformers sets Qwen2's sliding_window to None in this case
    first_sliding = hf.get("max_window_layers", 28)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
        for i in range(n_layers)
    ]
    kinds = set(layer_types)
    if kinds == {"full_attention"} or window is None:
        return None
    if kinds == {"sliding_attention"}:
        return window
    unsupported(
        "use_sliding_window/max_window_layers (layer_types)",
        f"sliding window on only some layers ({layer_types.count('sliding_attention')} of {n_layers})",
        "the window on every layer (max_window_layers=0) or on none (use_sliding_window=false)",
    )
    return None  # unreachable: unsupported() raises


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a Llama / Mistral / Qwen2 config.json dict."""
    model_type = hf["model_type"]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        unsupported("hidden_act", act, "silu (SwiGLU)")
    bias = qkv_bias = False
    if model_type == "llama":
        attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            unsupported(
                "attention_bias/mlp_bias", f"{attn_bias}/{mlp_bias}",
                "both false, or both true (biases in every linear layer)",
            )
        bias = attn_bias
    elif model_type == "qwen2":
        qkv_bias = True
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_layers = int(hf["num_hidden_layers"])
    n_kv = hf.get("num_key_value_heads", _DEFAULTS[model_type]["num_key_value_heads"]) or n_heads
    head_dim = hf.get("head_dim")
    if head_dim is not None and d_model % n_heads == 0 and head_dim == d_model // n_heads:
        head_dim = None  # the default: keep configs minimal so that round trips compare equal
    max_pos = int(hf.get("max_position_embeddings", _DEFAULTS[model_type]["max_position_embeddings"]))
    theta, scaling, long_len = _rope_from_hf(hf, max_pos)
    return dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv) if n_kv != n_heads else None,
        head_dim=head_dim,
        d_ff=int(hf["intermediate_size"]),
        max_seq_len=long_len or max_pos,
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        pos_embedding="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        mlp="swiglu",
        bias=bias,
        qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dropout=0.0,
        # model.attention_dropout: the family has no residual or embedding dropout (hidden stays 0)
        attention_dropout=attention_dropout_of(hf),
        sliding_window=_window_from_hf(hf, model_type, n_layers),
    )


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """The family member that expresses `cfg` (or check `requested`); LmforgeError when none does."""
    problems = []
    if cfg.norm != "rmsnorm":
        problems.append(f"norm={cfg.norm} (needs rmsnorm)")
    if cfg.mlp != "swiglu":
        problems.append(f"mlp={cfg.mlp} (needs swiglu)")
    if cfg.pos_embedding != "rope":
        problems.append(f"pos_embedding={cfg.pos_embedding} (needs rope)")
    if cfg.rotary_fraction != 1.0:
        problems.append(f"rotary_fraction={cfg.rotary_fraction} (its attention rotates whole heads)")
    if cfg.mla is not None:  # [issue-34 area: deepseek-mla]
        problems.append("model.mla (multi-head latent attention exports as deepseek_v3)")
    if requested is None:
        if cfg.qkv_bias and not cfg.bias:
            requested = "qwen2"
        elif cfg.sliding_window is not None:
            requested = "mistral"
        else:
            requested = "llama"
    problems += feature_problems(cfg)  # norm placement, Gemma's features: not in these families
    if requested == "llama" and cfg.sliding_window is not None:
        problems.append("sliding_window is set (Llama has none: use mistral or qwen2)")
    if requested == "llama" and cfg.qkv_bias and not cfg.bias:
        problems.append("qkv_bias without bias (Llama's attention_bias also covers o_proj: use qwen2)")
    if requested == "mistral" and (cfg.bias or cfg.qkv_bias):
        problems.append("bias/qkv_bias is set (Mistral has no biases)")
    if requested == "qwen2" and (cfg.bias or not cfg.qkv_bias):
        problems.append("Qwen2 has q/k/v biases only: needs qkv_bias=true and bias=false")
    from lmforge.models.hf.variants import extra_flags  # (variants' families import this module)

    problems += [f"{f} (a setting of qwen3, granite or smollm3)" for f in extra_flags(cfg)]
    if cfg.qk_norm:
        problems.append("qk_norm (Llama, Mistral and Qwen2 do not normalise q and k)")
    if problems:
        raise LmforgeError(
            f"this model cannot be exported as Hugging Face {requested!r}: " + "; ".join(problems)
        )
    return requested


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of the family member `model_type` (checked by `model_type_for`)."""
    rope_dict, max_pos = rope.scaling_to_hf(cfg)
    arch = ARCHITECTURES[model_type]
    if cfg.score_head:  # a reward model: the backbone and its scalar head (sequence classification)
        arch = arch.replace("ForCausalLM", "ForSequenceClassification")
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.resolved_d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.resolved_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        # HF's Llama family has attention dropout only: model.attention_dropout where set (a set
        # hidden_dropout is refused by check_dropouts); model.dropout alone acts on residuals and
        # embeddings too, which the family cannot say, and exports as 0.0 as it always has.
        "attention_dropout": cfg.attention_dropout or 0.0,
        # Both RoPE forms: 4.x reads rope_theta + rope_scaling, 5.x rope_parameters (or rope_scaling).
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {**rope_dict, "rope_theta": cfg.rope_theta},
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(rope_dict)
    if cfg.score_head:
        n = cfg.num_labels  # transformers names the labels LABEL_i unless told
        out.update(num_labels=n, id2label={str(i): f"LABEL_{i}" for i in range(n)},
                   label2id={f"LABEL_{i}": i for i in range(n)})
    if model_type == "llama":
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    elif model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    else:
        window = cfg.sliding_window is not None
        out.update(
            use_sliding_window=window,
            sliding_window=cfg.sliding_window,
            max_window_layers=0 if window else cfg.n_layers,
            layer_types=[("sliding_attention" if window else "full_attention")] * cfg.n_layers,
        )
    return out


# --------------------------------------------------------------------------------------- weights


def _canonical(hf_name: str) -> str:
    # Base-model checkpoints (LlamaModel rather than LlamaForCausalLM) have no "model." prefix.
    if hf_name.startswith(("model.", "lm_head.", "score.")):  # score: a ...ForSequenceClassification head
        return hf_name
    return "model." + hf_name


def import_names(hf_name: str, cfg: ModelConfig) -> list[str] | None:
    """Our parameter names filled by HF tensor `hf_name`: [] for known non-weights, None if unknown."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return []  # a RoPE buffer some old checkpoints saved; ours is derived from the config
    name = _canonical(hf_name)
    if name == "lm_head.weight" and cfg.tie_embeddings:
        return []  # transformers also drops it in favour of the embedding when weights are tied
    ours = KEYS.to_ours(name)
    return None if ours is None else [ours]


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs for one HF tensor: a plain rename, no permutation needed."""
    return [(ours, tensor) for ours in import_names(hf_name, cfg) or []]


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    """The HF name holding our parameter (for messages)."""
    return KEYS.to_hf(our_name) or our_name


def export_tensors(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter, in our order; the tied head is not written, nor the
    output projection of a reward model (...ForSequenceClassification has the score head instead)."""
    for ours, tensor in state.items():
        if (ours == "output.weight" and cfg.score_head) or ours.startswith("value."):
            continue  # PPO's value head is training machinery, not part of the model
        name = KEYS.to_hf(ours)
        assert name is not None, f"no HF name for {ours}"
        yield name, tensor
