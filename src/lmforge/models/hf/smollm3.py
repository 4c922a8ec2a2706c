"""Adapter for transformers' SmolLM3: the Llama layout where some layers apply no RoPE (NoPE).

transformers reads `no_rope_layers`, one 0/1 per layer (1: the layer uses RoPE), or, when that is
absent, builds it from `no_rope_layer_interval` n: layer i skips RoPE when (i + 1) % n == 0 (every
n-th layer, counting from 1). Ours is the list of skipping layers, `nope_layers`. A sliding window
(use_sliding_window, on the NoPE layers unless layer_types says otherwise) imports only when it covers
every layer or none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import granite, llama, qwen3, variants
from lmforge.models.hf.keymap import unsupported
from lmforge.models.hf.variants import extra_flags

MODEL_TYPES = ("smollm3",)
FLAGS = variants.SMOLLM3_FLAGS

# transformers' SmolLM3Config defaults for keys a config.json may leave out (5.x).
_DEFAULTS = {"max_position_embeddings": 32768, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": True, "rope_theta": 2000000.0, "no_rope_layer_interval": 4}


def uses_rope(hf: dict[str, Any], n_layers: int) -> list[int]:
    """transformers' no_rope_layers: 1 where layer i applies RoPE, 0 where it does not."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        every = int(hf["no_rope_layer_interval"])
        if every < 1:
            unsupported("no_rope_layer_interval", every, "a whole number >= 1")
        return [int((i + 1) % every != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) != n_layers or any(f not in (0, 1) for f in flags):
        unsupported("no_rope_layers", flags, f"a list of {n_layers} flags, 0 or 1, one per layer")
    return [int(f) for f in flags]


def _window(hf: dict[str, Any], rope: list[int]) -> int | None:
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window", False) or window is None:
        return None
    types = hf.get("layer_types") or ["full_attention" if r else "sliding_attention" for r in rope]
    if set(types) == {"full_attention"}:
        return None
    if set(types) == {"sliding_attention"}:
        return int(window)
    unsupported("use_sliding_window (layer_types)", types,
                "use_sliding_window=false, or a window on every layer")
    return None  # unreachable


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a SmolLM3 config.json dict."""
    hf = qwen3.with_defaults(hf, _DEFAULTS)
    kwargs = llama.config_from_hf({**hf, "model_type": "llama"})  # biases as Llama's keys say
    rope = uses_rope(hf, kwargs["n_layers"])
    kwargs.update(nope_layers=[i for i, r in enumerate(rope) if not r], sliding_window=_window(hf, rope))
    return kwargs


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """"smollm3" (or check `requested`); LmforgeError naming what a SmolLM3 config cannot hold."""
    requested = requested or "smollm3"
    problems = [f"{k} (needs {v})" for k, v in qwen3.common_problems(cfg).items()]
    if cfg.qkv_bias and not cfg.bias:
        problems.append("qkv_bias without bias (SmolLM3's attention_bias covers q/k/v/o and goes with "
                        "mlp_bias)")
    problems += [f"{f} (SmolLM3 has no such setting)" for f in extra_flags(cfg, FLAGS)]
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested!r}: "
                           + "; ".join(problems))
    return requested


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """config.json keys of a SmolLM3 (checked by `model_type_for`)."""
    out = llama.config_to_hf(cfg, "llama")
    arch = "SmolLM3ForSequenceClassification" if cfg.score_head else "SmolLM3ForCausalLM"
    window = cfg.sliding_window is not None
    out.update(architectures=[arch], model_type="smollm3",
               no_rope_layers=[int(i not in cfg.nope_layers) for i in range(cfg.n_layers)],
               use_sliding_window=window, sliding_window=cfg.sliding_window,
               layer_types=["sliding_attention" if window else "full_attention"] * cfg.n_layers)
    return out


import_names = granite.import_names
import_tensor = granite.import_tensor
hf_name = granite.hf_name


def export_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter, as Llama's."""
    return qwen3.export_tensors(state, cfg, llama.KEYS)
