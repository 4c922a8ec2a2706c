"""GPT-2 as llama.cpp's `gpt2`: learned positions, LayerNorm with biases, one fused q/k/v projection
(c_attn, q then k then v, as llama.cpp's attn_qkv splits it), a GELU MLP with biases.

Hugging Face's GPT-2 layers are Conv1D modules whose weights are stored (in, out), the transpose of a
linear layer's: those four are transposed back, as llama.cpp's converter does. llama.cpp's GELU is the
tanh approximation (GPT-2's gelu_new) and its attention scale 1/sqrt(head_dim): the variants
transformers can configure beyond those are refused by name."""

from __future__ import annotations

from typing import Any

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, Planned, mapped

ARCHES = {"gpt2": "gpt2"}
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
# config keys whose non-default value changes GPT-2's attention in a way llama.cpp's graph has no form for
_FIXED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
          "reorder_and_upcast_attn": False, "add_cross_attention": False}


def check(cfg: dict[str, Any]) -> None:
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        raise LmforgeError(f"GGUF export cannot write this gpt2 model: activation_function={act!r}; "
                           "llama.cpp's gpt2 computes GELU's tanh approximation (gelu_new), which would give "
                           "different numbers (use --format hf)")
    for key, want in _FIXED.items():
        if bool(cfg.get(key, want)) != want:
            raise LmforgeError(f"GGUF export cannot write this gpt2 model: {key}={cfg[key]!r}; llama.cpp's "
                               f"gpt2 has only {key}={want} (use --format hf)")


def metadata(ctx: Context) -> None:
    w, cfg = ctx.writer, ctx.cfg
    # Context (and the writer after it) reads Llama's key names; GPT-2's config.json has n_layer, n_head
    cfg.setdefault("num_hidden_layers", cfg["n_layer"])
    cfg.setdefault("num_attention_heads", cfg["n_head"])
    n_embd = int(cfg["n_embd"])
    # the position table's rows: llama.cpp sizes it by the context length, so it is exactly n_positions
    w.add_context_length(int(cfg.get("n_positions") or cfg.get("n_ctx") or 1024))
    w.add_embedding_length(n_embd)
    w.add_block_count(ctx.n_layers)
    w.add_feed_forward_length(int(cfg.get("n_inner") or 4 * n_embd))
    w.add_head_count(ctx.n_heads)
    w.add_layer_norm_eps(float(cfg.get("layer_norm_epsilon", 1e-5)))


def plan(ctx: Context):
    def transposed(name: str, t):
        return t.t().contiguous() if name.endswith(_CONV1D) else t

    names = ctx.names()
    conv1d = {names.get_name(n, try_suffixes=(".weight",)) for n in ctx.tensors.where if n.endswith(_CONV1D)}
    for item in mapped(ctx, transposed):
        # the planned shape is the stored one; a Conv1D's is written transposed, (out, in)
        yield Planned(item.name, item.shape[::-1], item.load) if item.name in conv1d else item
