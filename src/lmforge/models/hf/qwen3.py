"""Adapter for transformers' Qwen3: the Llama layout plus an RMSNorm over each head's q and k (one
weight of head_dim, applied before RoPE: our qk_norm with qk_norm_scope=head).

Config differences from Qwen2: attention_bias puts biases on q/k/v *and* o (our qkv_bias plus
attn_out_bias), and head_dim defaults to 128 rather than hidden_size / num_attention_heads. The sliding
window follows Qwen2's keys (use_sliding_window, max_window_layers, layer_types): a window on every
layer or on none imports; one on only some layers is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import llama, variants
from lmforge.models.hf.keymap import KeyMap
from lmforge.models.hf.variants import extra_flags

MODEL_TYPES = ("qwen3",)
FLAGS = variants.QWEN3_FLAGS

# transformers' Qwen3Config defaults for keys a config.json may leave out (5.x).
_DEFAULTS = {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128,
             "rms_norm_eps": 1e-6, "sliding_window": 4096, "max_window_layers": 28}

KEYS = llama.KEYS.extended([
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
])


def with_defaults(hf: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A copy of `hf` with a family's class defaults filled in where config.json leaves keys out."""
    return {**defaults, **hf}


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a Qwen3 config.json dict."""
    hf = with_defaults(hf, _DEFAULTS)
    # Llama's reading of the shared keys; the biases and the window are Qwen3's own.
    kwargs = llama.config_from_hf({**hf, "model_type": "llama", "attention_bias": False, "mlp_bias": False})
    bias = bool(hf.get("attention_bias", False))
    kwargs.update(qkv_bias=bias, attn_out_bias=bias, qk_norm=True, qk_norm_scope="head",
                  sliding_window=llama._window_from_hf({**hf, "model_type": "qwen2"}, "qwen2",
                                                       kwargs["n_layers"]))
    return kwargs


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """"qwen3" when `cfg` is a Qwen3 (or check `requested`); LmforgeError naming what does not fit."""
    requested = requested or "qwen3"
    problems = [f"{k} (needs {v})" for k, v in common_problems(cfg).items()]
    if not (cfg.qk_norm and cfg.qk_norm_scope == "head"):
        problems.append("Qwen3 normalises each head's q and k: needs qk_norm=true and qk_norm_scope=head")
    if cfg.bias:
        problems.append("bias=true (Qwen3's attention_bias covers q/k/v/o only: qkv_bias and attn_out_bias)")
    if cfg.qkv_bias != cfg.attn_out_bias:
        problems.append(f"qkv_bias={cfg.qkv_bias} with attn_out_bias={cfg.attn_out_bias} (Qwen3's "
                        "attention_bias sets both)")
    problems += [f"{f} (Qwen3 has no such setting)" for f in extra_flags(cfg, FLAGS)]
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested!r}: "
                           + "; ".join(problems))
    return requested


def common_problems(cfg: ModelConfig) -> dict[str, str]:
    """{key=value: what is needed} for the settings every Llama-layout family needs."""
    out = {}
    for key, want in (("norm", "rmsnorm"), ("mlp", "swiglu"), ("pos_embedding", "rope")):
        if getattr(cfg, key) != want:
            out[f"{key}={getattr(cfg, key)}"] = want
    if cfg.moe is not None:
        out["moe is set"] = "a dense model (export a mixture of experts as its moe family)"
    return out


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of a Qwen3 (checked by `model_type_for`)."""
    out = llama.config_to_hf(cfg, "llama")
    del out["attention_bias"], out["mlp_bias"]
    arch = "Qwen3ForSequenceClassification" if cfg.score_head else "Qwen3ForCausalLM"
    window = cfg.sliding_window is not None
    out.update(
        architectures=[arch], model_type="qwen3", attention_bias=cfg.qkv_bias, use_sliding_window=window,
        sliding_window=cfg.sliding_window, max_window_layers=0 if window else cfg.n_layers,
        layer_types=["sliding_attention" if window else "full_attention"] * cfg.n_layers,
    )
    return out


def import_names(hf_name: str, cfg: ModelConfig, keys: KeyMap = KEYS) -> list[str] | None:
    """Our parameter names filled by HF tensor `hf_name`: [] for known non-weights, None if unknown."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return []
    name = llama._canonical(hf_name)
    if name == "lm_head.weight" and cfg.tie_embeddings:
        return []
    ours = keys.to_ours(name)
    return None if ours is None else [ours]


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs for one HF tensor: a plain rename."""
    return [(ours, tensor) for ours in import_names(hf_name, cfg) or []]


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    """The HF name holding our parameter (for messages)."""
    return KEYS.to_hf(our_name) or our_name


def export_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                   keys: KeyMap = KEYS) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter; the tied head, a reward model's output projection and
    PPO's value head are not written (as llama.export_tensors)."""
    for ours, tensor in state.items():
        if (ours == "output.weight" and cfg.score_head) or ours.startswith("value."):
            continue
        name = keys.to_hf(ours)
        assert name is not None, f"no HF name for {ours}"
        yield name, tensor
