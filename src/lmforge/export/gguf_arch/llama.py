"""Llama, Mistral, Qwen2 and Qwen3 as llama.cpp's `llama`, `qwen2` and `qwen3`. Mistral is llama.cpp's
`llama` (its converter files MistralForCausalLM there too)."""

from __future__ import annotations

from typing import Any

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, llama_metadata, mapped, permute_rope_rows

ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def check(cfg: dict[str, Any]) -> None:
    if cfg.get("mlp_bias") or cfg.get("attention_bias"):
        raise LmforgeError("GGUF export does not support a Llama with attention_bias / mlp_bias (llama.cpp's "
                           "converter drops some of those biases); use --format hf")


def metadata(ctx: Context) -> None:
    llama_metadata(ctx)


def plan(ctx: Context):
    if ctx.arch != "llama":  # qwen2/qwen3 rotate halves, as Hugging Face does
        return mapped(ctx)

    def pairs(name: str, t):
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return permute_rope_rows(t, ctx.n_heads)
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return permute_rope_rows(t, ctx.n_kv)
        return t

    return mapped(ctx, pairs)
