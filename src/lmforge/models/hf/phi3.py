"""Adapter for transformers' Phi-3 (model_type phi3: Phi-3, Phi-3.5 and Phi-4, mini to medium).

The block is Llama's (pre-norm RMSNorm, SwiGLU, "rotate_half" RoPE, no biases) with three differences:
  * the checkpoint fuses q/k/v into `self_attn.qkv_proj` (rows q, then k, then v) and gate/up into
    `mlp.gate_up_proj` (rows gate, then up): split on import, concatenated on export;
  * RoPE may rotate only the first `partial_rotary_factor` of each head (our rotary_fraction) and use
    longrope scaling (4.x configs call it "su" or "yarn": Phi3Config reads both as longrope), with the
    top-level original_max_position_embeddings (default 4096) taking priority over the dict's;
  * sliding_window, when set, applies to every layer (transformers' sliding-window causal mask: a
    query sees the keys i - window < j <= i, our Mistral window).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import llama, rope
from lmforge.models.hf.keymap import unsupported

MODEL_TYPES = ("phi3",)
ORIGINAL_DEFAULT = 4096  # Phi3Config.original_max_position_embeddings

# Our per-projection parameters inside each fused HF tensor, in row order.
FUSED = {
    "self_attn.qkv_proj": ("attn.wq", "attn.wk", "attn.wv"),
    "mlp.gate_up_proj": ("mlp.w_gate", "mlp.w_up"),
}
_OURS_TO_FUSED = {part: fused for fused, parts in FUSED.items() for part in parts}
_LAYER = re.compile(r"(model\.)?layers\.(\d+)\.(.+)\.weight")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a Phi-3 config.json dict."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        unsupported("hidden_act", act, "silu (SwiGLU)")
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop"):
        if float(hf.get(key) or 0.0) > 0:
            unsupported(key, hf[key], "0.0 (lmforge's one dropout acts on attention, residuals and "
                        "embeddings together: set model.dropout instead)")
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_kv = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim")
    if head_dim is not None and d_model % n_heads == 0 and head_dim == d_model // n_heads:
        head_dim = None  # the default: keep configs minimal so that round trips compare equal
    max_pos = int(hf.get("max_position_embeddings", 4096))
    params = dict(rope.rope_params(hf))
    if rope.rope_kind(params) in ("su", "yarn"):  # Phi3Config's backward-compatible names for longrope
        params.pop("type", None)
        params["rope_type"] = "longrope"
    original = int(hf.get("original_max_position_embeddings", ORIGINAL_DEFAULT))
    scaling, _ = rope.scaling_from_hf(params, max_pos, original=original, kinds=("default", "longrope"))
    return dict(
        vocab_size=int(hf.get("vocab_size", 32064)),
        d_model=d_model,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(n_kv) if n_kv != n_heads else None,
        head_dim=head_dim,
        d_ff=int(hf["intermediate_size"]),
        max_seq_len=max_pos,
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        pos_embedding="rope",
        rope_theta=rope.rope_theta(hf, params),
        rope_scaling=scaling,
        rotary_fraction=rope.rotary_fraction(hf, params),
        mlp="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dropout=0.0,
        sliding_window=hf.get("sliding_window"),
        hf_model_type="phi3",  # the flags of Phi-4 (full rotary, no scaling) would export as Llama
    )


def is_default_for(cfg: ModelConfig) -> bool:
    """Whether an export without a model type picks Phi-3 for `cfg`: its hf_model_type says so, or, with
    none, partial rotary (which the Llama family lacks) or longrope (whose generation, ours included,
    recomputes the cache where it switches to the long factors: transformers' Phi-3 generate does, its
    Llama generate does not)."""
    if cfg.hf_model_type is not None:
        return cfg.hf_model_type == "phi3"
    longrope = cfg.rope_scaling is not None and cfg.rope_scaling.type == "longrope"
    return cfg.rotary_fraction != 1.0 or longrope


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """'phi3' if it expresses `cfg`; LmforgeError naming what it cannot."""
    requested = requested or "phi3"
    problems = []
    for key, value, want in (("norm", cfg.norm, "rmsnorm"), ("mlp", cfg.mlp, "swiglu"),
                             ("pos_embedding", cfg.pos_embedding, "rope"), ("bias", cfg.bias, False),
                             ("qkv_bias", cfg.qkv_bias, False), ("qk_norm", cfg.qk_norm, False),
                             ("score_head", cfg.score_head, False)):
        if value != want:
            problems.append(f"{key}={value} (Phi-3 needs {want})")
    if cfg.moe is not None:
        problems.append("moe is set (Phi-3 is dense)")
    sc = cfg.rope_scaling
    if sc is not None and sc.type != "longrope":
        problems.append(f"rope_scaling.type={sc.type} (Phi-3 has longrope only)")
    if sc is not None and sc.type == "longrope" and cfg.head_dim not in (None, cfg.d_model // cfg.n_heads):
        problems.append("longrope with head_dim != d_model / n_heads (transformers' Phi-3 sizes the factor "
                        "lists from hidden_size / num_attention_heads)")
    if problems:
        hint = ("; it exports as phi3 because model.hf_model_type=phi3: set model.hf_model_type=null to "
                "export by the flags" if cfg.hf_model_type == "phi3" else "")
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested!r}: "
                           + "; ".join(problems) + hint)
    return requested


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of Phi-3 (checked by `model_type_for`)."""
    rope_dict, max_pos = rope.scaling_to_hf(cfg)
    sc = cfg.rope_scaling
    # Phi3Config lets its top-level original length override the rope dict's: write the same value.
    original = sc.original_max_position_embeddings if sc is not None else cfg.max_seq_len
    partial = cfg.rotary_fraction
    out: dict[str, Any] = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.resolved_d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.resolved_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "original_max_position_embeddings": original,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "sliding_window": cfg.sliding_window,
        "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": partial,
        "rope_parameters": {**rope_dict, "rope_theta": cfg.rope_theta, "partial_rotary_factor": partial},
    }
    if sc is not None:
        out["rope_scaling"] = dict(rope_dict)
    return out


# --------------------------------------------------------------------------------------- weights


def import_names(hf_name: str, cfg: ModelConfig) -> list[str] | None:
    """Our parameter names filled by HF tensor `hf_name` (several for a fused tensor)."""
    m = _LAYER.fullmatch(hf_name)
    if m is not None and m.group(3) in FUSED:
        return [f"layers.{m.group(2)}.{part}.weight" for part in FUSED[m.group(3)]]
    if m is not None and m.group(3) in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "mlp.gate_proj", "mlp.up_proj"):
        return None  # a Phi-3 checkpoint has only the fused projections
    return llama.import_names(hf_name, cfg)


def _sizes(part_names: list[str], cfg: ModelConfig) -> list[int]:
    q = cfg.n_heads * cfg.resolved_head_dim
    kv = cfg.resolved_kv_heads * cfg.resolved_head_dim
    rows = {"attn.wq": q, "attn.wk": kv, "attn.wv": kv, "mlp.w_gate": cfg.resolved_d_ff,
            "mlp.w_up": cfg.resolved_d_ff}
    return [rows[n.split(".", 2)[2].removesuffix(".weight")] for n in part_names]


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs: a fused tensor split by rows, anything else renamed."""
    ours = import_names(hf_name, cfg) or []
    if len(ours) <= 1:
        return [(name, tensor) for name in ours]
    sizes = _sizes(ours, cfg)
    if tensor.shape[0] != sum(sizes):
        raise LmforgeError(f"tensor {hf_name} has {tensor.shape[0]} rows; the config gives {sum(sizes)} "
                           f"({' + '.join(map(str, sizes))})")
    return list(zip(ours, torch.split(tensor, sizes, dim=0), strict=True))


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    """The HF name holding our parameter (for messages): the fused tensor for a q/k/v or gate/up."""
    fused = fused_module(our_name.removesuffix(".weight"))
    return fused + ".weight" if fused is not None else llama.hf_name(our_name, cfg)


def fused_module(our_module: str) -> str | None:
    """The HF module fusing our linear layer `our_module` ("layers.0.attn.wk"), or None if not fused."""
    layer, _, part = our_module.partition(".")[2].partition(".")
    fused = _OURS_TO_FUSED.get(part)
    return None if fused is None else f"model.layers.{layer}.{fused}"


def fused_rows(our_module: str, cfg: ModelConfig) -> tuple[slice, int] | None:
    """(the rows of our linear layer `our_module` inside its fused HF module, that module's row count),
    or None if it is not fused."""
    fused = fused_module(our_module)
    if fused is None:
        return None
    layer = ".".join(our_module.split(".", 2)[:2])  # layers.{i}
    parts = [f"{layer}.{p}.weight" for p in FUSED[fused.split(".", 3)[3]]]
    sizes = _sizes(parts, cfg)
    i = parts.index(our_module + ".weight")
    return slice(sum(sizes[:i]), sum(sizes[: i + 1])), sum(sizes)


def export_tensors(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter, in our order, with each fused tensor where its first
    part comes; the tied head is not written."""
    for ours, tensor in state.items():
        if ours.startswith("value."):
            continue  # PPO's value head is training machinery, not part of the model
        fused = fused_module(ours.removesuffix(".weight")) if ours.endswith(".weight") else None
        if fused is None:
            name = llama.KEYS.to_hf(ours)
            assert name is not None, f"no HF name for {ours}"
            yield name, tensor
            continue
        layer = ".".join(ours.split(".", 2)[:2])  # layers.{i}
        parts = [f"{layer}.{p}.weight" for p in FUSED[fused.split(".", 3)[3]]]
        if ours == parts[0]:
            yield fused + ".weight", torch.cat([state[p] for p in parts], dim=0)
