"""Phi-3 (Phi-3, Phi-3.5, Phi-4 mini to medium) as llama.cpp's `phi3`: the fused projections stay fused
(`attn_qkv` holds q, k, v rows; `ffn_up` holds gate then up, which llama.cpp's SwiGLU splits in that
order), rotate-half RoPE over the first int(head_dim * partial_rotary_factor) dims of each head (no
permutation), and LongRoPE as llama.cpp's converter writes it: the short and long factors as the tensors
`rope_factors_short` / `rope_factors_long`, the original context length and the attention factor as keys.

Where the two differ: lmforge (as transformers) switches to the long factors when a sequence grows past the
original length; llama.cpp uses them for every token once its context (n_ctx, rounded up to 256) exceeds
it. llama.cpp's phi3 also disables sliding-window attention, so the file's context length is capped at the
window (where both attend to the same keys), as for the other families."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, Planned, context_length, mapped

ARCHES = {"phi3": "phi3"}


def _ours(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig arguments as lmforge's importer reads the config (RoPE, window, rotary fraction)."""
    from lmforge.models.hf import phi3

    return phi3.config_from_hf(cfg)


def check(cfg: dict[str, Any]) -> None:
    ours = _ours(cfg)
    d, heads = ours["d_model"], ours["n_heads"]
    if ours["head_dim"] is not None and ours["head_dim"] * heads != d:
        raise LmforgeError(f"GGUF export cannot write this Phi-3: head_dim={ours['head_dim']} with {heads} "
                           f"heads != hidden_size={d} (llama.cpp's phi3 sizes the query and output "
                           "projections by hidden_size); use --format hf")


def metadata(ctx: Context) -> None:
    w, cfg = ctx.writer, ctx.cfg
    ours = _ours(cfg)
    window = ours["sliding_window"]
    w.add_context_length(context_length({**cfg, "use_sliding_window": window is not None}, ctx.say))
    w.add_embedding_length(ours["d_model"])
    w.add_feed_forward_length(ours["d_ff"])
    w.add_block_count(ours["n_layers"])
    w.add_head_count(ours["n_heads"])
    w.add_head_count_kv(ours["n_kv_heads"] or ours["n_heads"])
    w.add_layer_norm_rms_eps(ours["norm_eps"])
    w.add_rope_dimension_count(int(ctx.head_dim * ours["rotary_fraction"]))
    w.add_rope_freq_base(ours["rope_theta"])
    w.add_sliding_window(window or 0)  # llama.cpp's converter writes it (0: none); llama.cpp ignores it
    scaling = ours["rope_scaling"]
    original = (scaling or {}).get("original_max_position_embeddings",
                                   cfg.get("original_max_position_embeddings", ours["max_seq_len"]))
    w.add_rope_scaling_orig_ctx_len(int(original))
    if scaling is None:
        return
    from lmforge.models.common.rope import attention_factor

    # lmforge's own factor (the config's attention_factor, else sqrt(1 + ln(factor) / ln(original)))
    w.add_rope_scaling_attn_factors(attention_factor(
        SimpleNamespace(**{"attention_factor": None, **scaling}), int(original)))
    ctx.extra["longrope"] = {k: torch.tensor(scaling[f"{k}_factor"], dtype=torch.float32)
                             for k in ("long", "short")}


def plan(ctx: Context):
    for kind, factors in ctx.extra.get("longrope", {}).items():
        yield Planned(f"rope_factors_{kind}.weight", list(factors.shape), lambda f=factors: f, quantize=False)
    yield from mapped(ctx)
