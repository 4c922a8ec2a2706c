"""Adapter for transformers' Granite (IBM): the Llama layout and key names with four scalars our blocks
take as flags: embedding_multiplier (scales the token embeddings), residual_multiplier (scales each
attention and MLP output before its residual add), attention_multiplier (the softmax scale, in place of
1/sqrt(head_dim); 1.0 by default) and logits_scaling (the logits are divided by it)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import llama, qwen3, variants
from lmforge.models.hf.variants import extra_flags

MODEL_TYPES = ("granite",)
FLAGS = variants.GRANITE_FLAGS

# transformers' GraniteConfig defaults for keys a config.json may leave out (5.x).
_DEFAULTS = {"max_position_embeddings": 2048, "num_key_value_heads": None, "rms_norm_eps": 1e-6,
             "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
             "logits_scaling": 1.0}


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a Granite config.json dict."""
    hf = qwen3.with_defaults(hf, _DEFAULTS)
    kwargs = llama.config_from_hf({**hf, "model_type": "llama"})  # biases as Llama's keys say
    kwargs.update({key: float(hf[key]) for key in FLAGS})
    return kwargs


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """"granite" (or check `requested`); LmforgeError naming what a Granite config cannot hold."""
    requested = requested or "granite"
    problems = [f"{k} (needs {v})" for k, v in qwen3.common_problems(cfg).items()]
    if cfg.qkv_bias and not cfg.bias:
        problems.append("qkv_bias without bias (Granite's attention_bias covers q/k/v/o and goes with "
                        "mlp_bias)")
    problems += [f"{f} (Granite has no such setting)" for f in extra_flags(cfg, FLAGS)]
    if cfg.sliding_window is not None:
        problems.append("sliding_window is set (Granite has none)")
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested!r}: "
                           + "; ".join(problems))
    return requested


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of a Granite (checked by `model_type_for`)."""
    out = llama.config_to_hf(cfg, "llama")
    arch = "GraniteForSequenceClassification" if cfg.score_head else "GraniteForCausalLM"
    scale = cfg.attention_multiplier
    out.update(architectures=[arch], model_type="granite", embedding_multiplier=cfg.embedding_multiplier,
               residual_multiplier=cfg.residual_multiplier, logits_scaling=cfg.logits_scaling,
               attention_multiplier=cfg.resolved_head_dim**-0.5 if scale is None else scale)
    return out


def import_names(hf_name: str, cfg: ModelConfig) -> list[str] | None:
    """Our parameter names filled by HF tensor `hf_name`: Llama's names."""
    return qwen3.import_names(hf_name, cfg, llama.KEYS)


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs for one HF tensor: a plain rename."""
    return [(ours, tensor) for ours in import_names(hf_name, cfg) or []]


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    """The HF name holding our parameter (for messages)."""
    return llama.KEYS.to_hf(our_name) or our_name


def export_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter, as Llama's."""
    return qwen3.export_tensors(state, cfg, llama.KEYS)
