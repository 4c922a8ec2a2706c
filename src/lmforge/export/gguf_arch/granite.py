"""Granite (IBM) as llama.cpp's `granite`: Llama's layout and pair-wise RoPE (q/k rows permuted as for
`llama`), with its four scalars as metadata keys: embedding_multiplier -> embedding_scale,
residual_multiplier -> residual_scale, attention_multiplier -> attention.scale (the softmax scale in place
of 1/sqrt(head_dim)) and logits_scaling -> logit_scale (logits divided by it). llama.cpp's granite
also loads q/k/v/o and MLP biases, so attention_bias / mlp_bias export (q/k biases permuted as their rows)."""

from __future__ import annotations

from typing import Any

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, llama_metadata, mapped, permute_rope_rows

ARCHES = {"granite": "granite"}
# config.json key -> gguf-py writer method; transformers' GraniteConfig defaults when a key is absent
SCALES = {"embedding_multiplier": "add_embedding_scale", "residual_multiplier": "add_residual_scale",
          "attention_multiplier": "add_attention_scale", "logits_scaling": "add_logit_scale"}


def check(cfg: dict[str, Any]) -> None:
    # llama.cpp reads 0 as "not set" (no scaling, or 1/sqrt(head_dim)), so a zero would change the model
    zero = [key for key in SCALES if cfg.get(key, 1.0) == 0]
    if zero:
        raise LmforgeError(f"GGUF export cannot write a Granite with {', '.join(f'{k}=0' for k in zero)}: "
                           "llama.cpp's granite reads 0 as 'unset'; use --format hf")


def metadata(ctx: Context) -> None:
    llama_metadata(ctx)
    for key, method in SCALES.items():
        # logit_scale is a required key of llama.cpp's granite: write all four, defaults included
        getattr(ctx.writer, method)(float(ctx.cfg.get(key, 1.0)))


def plan(ctx: Context):
    return mapped(ctx, lambda name, t: rope_pairs(ctx, name, t))


def rope_pairs(ctx: Context, name: str, t):
    """q/k rows (and biases) from Hugging Face's rotated halves to llama.cpp's adjacent pairs."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return permute_rope_rows(t, ctx.n_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return permute_rope_rows(t, ctx.n_kv)
    return t
