"""The mixture-of-experts families as llama.cpp writes them: Mixtral is its `llama` with experts (so the
Q/K rows are permuted from halves to pairs), Qwen2-MoE `qwen2moe` (plus one shared expert with a
sigmoid gate), Qwen3-MoE `qwen3moe` (per-head q/k norms) and OLMoE `olmoe` (q/k norms over the whole
projections).

The experts of a layer become one 3-D tensor per projection (ffn_gate_exps / ffn_up_exps /
ffn_down_exps, [n_expert, out, in]), stacked from the Hugging Face dir's per-expert tensors (the layout
lmforge's export writes, for transformers 4 and 5 alike: models/hf/moe.py). The router
(ffn_gate_inp) and the shared expert's gate stay F32, as llama.cpp's converter and quantizer keep them.

What llama.cpp cannot express is refused here, before anything is written: its graphs fix whether the
top-k weights are renormalised per architecture (llama and qwen3moe do, qwen2moe and olmoe do not: no
metadata key changes that), load no attention-output bias for qwen3moe and olmoe, and size OLMoE's
k-norm for the whole model width (no grouped-query attention)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, Planned, llama_metadata, mapped, permute_rope_rows

ARCHES = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}

# whether llama.cpp's graph for the architecture renormalises the top-k routing weights (the `norm_w`
# argument its build_moe_ffn call passes; fixed in code, not read from the file)
_RENORMALISES = {"mixtral": True, "qwen3_moe": True, "qwen2_moe": False, "olmoe": False}
# Hugging Face projection name -> llama.cpp's stacked tensor (Mixtral's w1 gate, w3 up, w2 down)
_PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.("
                         + "|".join(_PROJ) + r")\.weight")


def _n_experts(cfg: dict[str, Any]) -> int:
    return int(cfg.get("num_local_experts") if cfg["model_type"] == "mixtral" or "num_experts" not in cfg
               else cfg["num_experts"])


def check(cfg: dict[str, Any]) -> None:
    model_type = cfg["model_type"]
    arch = ARCHES[model_type]
    problems = []
    renorm = True if model_type == "mixtral" else bool(cfg.get("norm_topk_prob", False))
    if renorm != _RENORMALISES[model_type]:
        problems.append(f"norm_topk_prob={str(renorm).lower()} (llama.cpp's {arch} always "
                        f"{'renormalises' if _RENORMALISES[model_type] else 'keeps'} the top-k routing "
                        f"weights{'' if _RENORMALISES[model_type] else ' as the softmax gives them'})")
    if model_type in ("qwen3_moe", "olmoe") and cfg.get("attention_bias"):
        problems.append(f"attention_bias (llama.cpp's {arch} has no attention-output bias)")
    if model_type == "mixtral" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        problems.append("attention_bias / mlp_bias (Mixtral has none)")
    n_heads = int(cfg["num_attention_heads"])
    if model_type == "olmoe" and int(cfg.get("num_key_value_heads") or n_heads) != n_heads:
        problems.append("num_key_value_heads != num_attention_heads (llama.cpp's olmoe sizes the k-norm for "
                        "the whole width: no grouped-query attention)")
    if int(cfg.get("num_experts_per_tok", 0)) < 1 or _n_experts(cfg) < 1:
        problems.append("no experts (num_experts and num_experts_per_tok must be >= 1)")
    if problems:
        raise LmforgeError(f"GGUF export cannot write this {model_type} model as llama.cpp's {arch}: "
                           + "; ".join(problems) + " (use --format hf)")


def metadata(ctx: Context) -> None:
    cfg = ctx.cfg
    if cfg["model_type"] == "mixtral" and cfg.get("sliding_window") is not None:
        # Mixtral's window (it has no use_sliding_window key) caps the context, as Mistral's does
        ctx = replace(ctx, cfg={**cfg, "use_sliding_window": True})
    llama_metadata(ctx)
    w = ctx.writer
    w.add_expert_count(_n_experts(cfg))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if "moe_intermediate_size" in cfg and cfg["model_type"] in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    if cfg["model_type"] == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))


def _is_expert(name: str) -> bool:
    return bool(_PER_EXPERT.fullmatch(name))


def _stacked(ctx: Context):
    """{(layer, 'gate'|'up'|'down'): (shape, loader)} of the experts' stacked tensors."""
    per_expert: dict[tuple[int, str], dict[int, str]] = {}
    out = {}
    for name in ctx.tensors.where:
        if m := _PER_EXPERT.fullmatch(name):
            per_expert.setdefault((int(m[1]), _PROJ[m[3]]), {})[int(m[2])] = name
    n_experts = _n_experts(ctx.cfg)
    for key, names in per_expert.items():
        if sorted(names) != list(range(n_experts)):
            raise LmforgeError(f"GGUF export: layer {key[0]}'s {key[1]} projection has experts "
                               f"{sorted(names)}, not 0..{n_experts - 1}")
        ordered = [names[j] for j in range(n_experts)]
        out[key] = ([n_experts, *ctx.tensors.shape(ordered[0])],
                    lambda ns=ordered: torch.stack([ctx.tensors[n] for n in ns]))
    return out


def plan(ctx: Context):
    model_type = ctx.cfg["model_type"]
    transform = None
    if model_type == "mixtral":  # llama.cpp's llama rotates adjacent pairs: permute as for Llama

        def transform(name: str, t: torch.Tensor) -> torch.Tensor:
            if name.endswith("q_proj.weight"):
                return permute_rope_rows(t, ctx.n_heads)
            if name.endswith("k_proj.weight"):
                return permute_rope_rows(t, ctx.n_kv)
            return t

    # llama.cpp's quantizer keeps attn_k and attn_v of an 8-expert model at Q8_0 and its attn_output
    # at Q5_K under Q4_K_M; lmforge writes no Q5_K, so that one keeps 6 bits (never fewer than llama.cpp)
    eight = _n_experts(ctx.cfg) == 8
    for item in mapped(ctx, transform, skip=_is_expert):
        if item.name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
            item.quantize = False  # the router and the shared expert's gate: F32, as llama.cpp keeps them
        if item.name.endswith("ffn_gate_inp_shexp.weight"):
            # Hugging Face's (1, d) gate as the vector llama.cpp declares ({n_embd}); transformers' GGUF
            # loader reads only that form (it adds the leading 1 itself)
            item.shape, item.load = [item.shape[-1]], lambda load=item.load: load().reshape(-1)
        elif eight and item.name.endswith(("attn_k.weight", "attn_v.weight")):
            item.role = "q8_0"
        elif eight and item.name.endswith("attn_output.weight"):
            item.role = "more_bits"
        yield item
    if ctx.cfg.get("tie_word_embeddings") and model_type in ("qwen2_moe", "olmoe"):
        # these two llama.cpp architectures require output.weight (no fallback to the embedding)
        yield Planned("output.weight", ctx.tensors.shape("model.embed_tokens.weight"),
                      lambda: ctx.tensors["model.embed_tokens.weight"])
    stacked = _stacked(ctx)
    for layer in range(ctx.n_layers):
        for proj in ("gate", "up", "down"):
            if (layer, proj) not in stacked:
                raise LmforgeError(f"GGUF export: layer {layer} of this {model_type} model has no "
                                   f"{proj} projection of its experts")
            shape, load = stacked[layer, proj]
            yield Planned(f"blk.{layer}.ffn_{proj}_exps.weight", shape, load)
