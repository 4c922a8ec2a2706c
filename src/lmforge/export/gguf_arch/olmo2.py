"""OLMo 2 as llama.cpp's `olmo2`: post-norm blocks (x + norm(attn(x)), x + norm(mlp(x)); the norms are
`post_attention_norm` / `post_ffw_norm`, and there is no input norm), one RMSNorm over the whole q and k
projections (`attn_q_norm` / `attn_k_norm`, sized n_heads * head_dim and n_kv_heads * head_dim), and
rotate-half RoPE as Hugging Face's (no permutation). llama.cpp's olmo2 requires an `output` tensor (a tied
model gets the embedding written twice), sizes q by hidden_size (head_dim must be hidden_size / heads) and
has no output-projection bias (attention_bias is refused)."""

from __future__ import annotations

from typing import Any

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, Planned, llama_metadata, mapped

ARCHES = {"olmo2": "olmo2"}


def check(cfg: dict[str, Any]) -> None:
    problems = []
    d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or d // heads
    if head_dim * heads != d:
        problems.append(f"head_dim={head_dim} with {heads} heads != hidden_size={d} (llama.cpp's olmo2 sizes "
                        "the query projection and its norm by hidden_size)")
    if cfg.get("attention_bias"):
        problems.append("attention_bias=true (llama.cpp's olmo2 has no output-projection bias)")
    if cfg.get("sliding_window") is not None:  # OLMo 3's; lmforge's OLMo 2 has none
        problems.append(f"sliding_window={cfg['sliding_window']}")
    if problems:
        raise LmforgeError("GGUF export cannot write this OLMo 2: " + "; ".join(problems)
                           + "; use --format hf")


def metadata(ctx: Context) -> None:
    llama_metadata(ctx)


def plan(ctx: Context):
    tied = "lm_head.weight" not in ctx.tensors.where or bool(ctx.cfg.get("tie_word_embeddings"))
    for item in mapped(ctx):
        if tied and item.name == "token_embd.weight":
            item.role = "plain"  # the head is written as its own tensor below, which gets the head's bits
        yield item
    if tied:
        embed = "model.embed_tokens.weight"
        yield Planned("output.weight", ctx.tensors.shape(embed), lambda: ctx.tensors[embed])
