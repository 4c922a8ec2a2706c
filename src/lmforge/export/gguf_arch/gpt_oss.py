"""gpt-oss as llama.cpp's `gpt-oss` architecture (its LLM_ARCH_OPENAI_MOE graph).

What differs from a Llama-shaped file, as llama.cpp's converter writes the released models:
- every layer has attention sinks (`blk.N.attn_sinks.weight`, one F32 logit per query head) and an
  output-projection bias the loader requires (written as zeros when the model has no attention bias);
- layers alternate sliding-window and full attention: the window is `attention.sliding_window`, and
  which layers slide is llama.cpp's default for this architecture (even layers slide, as transformers'
  default layer_types), else written per layer as `attention.sliding_window_pattern` (a bool array);
  a model with no sliding layer slides over a window of the whole context (llama.cpp's graph needs one);
- the router has a bias and stays F32 (llama.cpp's quantizer never quantizes ffn_gate_inp); the experts
  are stacked per layer and Hugging Face's fused, interleaved `gate_up_proj` (gate in the even columns,
  up in the odd) is split into `ffn_gate_exps` / `ffn_up_exps` (E, d_ff, d), each with its (E, d_ff)
  bias, `down_proj` transposed into `ffn_down_exps` (E, d, d_ff). The experts are written in the type
  --quant asks (llama.cpp's MoE matmul takes any of ours), not MXFP4, which lmforge's weights are not in;
- the clamped SwiGLU's alpha and limit have no key: llama.cpp hard-codes gpt-oss's 1.702 and 7.0;
- the output head is required: a model with tied embeddings gets the embedding written as the head too.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, Planned

ARCHES = {"gpt_oss": "gpt-oss"}

# llama.cpp's graph (llm_graph_context::build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE) fixes these
_ALPHA, _LIMIT = 1.702, 7.0
# llama.cpp's gpt-oss reads no YaRN beta keys: its defaults are the only betas it computes with
_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}


def _rope(cfg: dict[str, Any]) -> tuple[str, float, dict[str, Any] | None]:
    from lmforge.models.hf import rope

    params = rope.rope_params(cfg)
    kind = rope.rope_kind(params)
    scaling, _ = rope.scaling_from_hf(params, int(cfg.get("max_position_embeddings", 2048)))
    return kind, rope.rope_theta(cfg, params), scaling


def check(cfg: dict[str, Any]) -> None:
    alpha, limit = float(cfg.get("swiglu_alpha", _ALPHA)), float(cfg.get("swiglu_limit", _LIMIT))
    if not (math.isclose(alpha, _ALPHA, rel_tol=1e-6) and math.isclose(limit, _LIMIT, rel_tol=1e-6)):
        raise LmforgeError(f"GGUF export: llama.cpp's gpt-oss computes the clamped SwiGLU with "
                           f"swiglu_alpha {_ALPHA} and swiglu_limit {_LIMIT} (no metadata key changes them); "
                           f"this model has swiglu_alpha={alpha}, swiglu_limit={limit}; use --format hf")
    kind, _, scaling = _rope(cfg)
    if kind == "yarn":
        other = {k: scaling[k] for k in ("mscale", "mscale_all_dim", "attention_factor") if k in scaling}
        betas = {k: scaling[k] for k in _BETAS if scaling[k] != _BETAS[k]}
        if other or betas:
            raise LmforgeError(f"GGUF export: llama.cpp's gpt-oss computes YaRN with beta_fast 32, "
                               f"beta_slow 1 and its own attention factor; this model's RoPE has "
                               f"{other | betas}; use --format hf")
    elif kind not in ("default", "linear"):
        raise LmforgeError(f"GGUF export supports a gpt-oss RoPE of type default, linear or yarn; this model "
                           f"has {kind!r}; use --format hf")


def _sliding(cfg: dict[str, Any]) -> list[bool]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(n)]
    return [t == "sliding_attention" for t in types]


def metadata(ctx: Context) -> None:
    w, cfg, gguf = ctx.writer, ctx.cfg, ctx.gguf
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))  # each layer type its own window
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(ctx.n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_count(int(cfg["num_local_experts"]))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    w.add_head_count(ctx.n_heads)
    w.add_head_count_kv(ctx.n_kv)
    w.add_key_length(ctx.head_dim)
    w.add_value_length(ctx.head_dim)
    w.add_rope_dimension_count(ctx.head_dim)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    sliding, n_ctx = _sliding(cfg), int(cfg.get("max_position_embeddings", 2048))
    window = int(cfg.get("sliding_window") or 128)
    if not any(sliding):
        # llama.cpp's gpt-oss graph needs a sliding layer (it asserts one): a window as long as the
        # context is full attention at every position the model is meant for
        ctx.say(f"note: no layer of this model slides; llama.cpp's gpt-oss needs one, so the GGUF's layers "
                f"slide over a window of the whole context ({n_ctx} tokens), which is full attention up to "
                "the context length")
        sliding, window = [True] * ctx.n_layers, n_ctx
    w.add_sliding_window(window)
    if sliding != [i % 2 == 0 for i in range(ctx.n_layers)]:  # not llama.cpp's default for gpt-oss
        w.add_sliding_window_pattern(sliding)
    kind, theta, scaling = _rope(cfg)
    w.add_rope_freq_base(theta)
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if not scaling["truncate"]:
            ctx.say("note: this model's YaRN does not round its correction range (truncate: false, as the "
                    "released gpt-oss models); llama.cpp always rounds it, so its RoPE frequencies in that "
                    "range differ slightly from lmforge's and transformers' (llama.cpp's own converter "
                    "writes these models the same way)")


def plan(ctx: Context):
    names, t, cfg = ctx.names(), ctx.tensors, ctx.cfg
    d, n_experts = int(cfg["hidden_size"]), int(cfg["num_local_experts"])
    d_ff = int(cfg["intermediate_size"])

    def plain(hf: str, quantize: bool = True) -> Planned:
        gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise LmforgeError(f"GGUF export: no llama.cpp name for tensor {hf!r} of a gpt-oss model")
        return Planned(gname, t.shape(hf), lambda: t[hf], quantize=quantize)

    yield plain("model.embed_tokens.weight")
    yield plain("model.norm.weight")
    head = "lm_head.weight" if "lm_head.weight" in t.where and not cfg.get("tie_word_embeddings") else \
        "model.embed_tokens.weight"
    yield Planned("output.weight", t.shape(head), lambda: t[head])
    for i in range(ctx.n_layers):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        yield plain(pre + "input_layernorm.weight")
        yield plain(pre + "post_attention_layernorm.weight")
        for proj in ("q", "k", "v", "o"):
            yield plain(f"{pre}self_attn.{proj}_proj.weight")
            if f"{pre}self_attn.{proj}_proj.bias" in t.where:
                yield plain(f"{pre}self_attn.{proj}_proj.bias")
        if pre + "self_attn.o_proj.bias" not in t.where:  # llama.cpp requires it: zeros are no bias
            yield Planned(blk + "attn_output.bias", [d], lambda: torch.zeros(d), quantize=False)
        yield Planned(blk + "attn_sinks.weight", t.shape(pre + "self_attn.sinks"),
                      lambda n=pre + "self_attn.sinks": t[n], quantize=False)
        # the router is small and decides which experts run: F32, as llama.cpp keeps it
        yield plain(pre + "mlp.router.weight", quantize=False)
        yield plain(pre + "mlp.router.bias")
        exp = pre + "mlp.experts."
        for half, gname in ((0, "ffn_gate_exps"), (1, "ffn_up_exps")):
            # gate_up_proj (E, d, 2 d_ff) -> (E, d_ff, d): gate the even columns, up the odd ones
            yield Planned(f"{blk}{gname}.weight", [n_experts, d_ff, d],
                          lambda h=half, e=exp: t[e + "gate_up_proj"][..., h::2].transpose(1, 2).contiguous())
            yield Planned(f"{blk}{gname}.bias", [n_experts, d_ff], quantize=False,
                          load=lambda h=half, e=exp: t[e + "gate_up_proj_bias"][..., h::2].contiguous())
        yield Planned(blk + "ffn_down_exps.weight", [n_experts, d, d_ff],
                      lambda e=exp: t[e + "down_proj"].transpose(1, 2).contiguous())
        yield Planned(blk + "ffn_down_exps.bias", [n_experts, d], lambda e=exp: t[e + "down_proj_bias"],
                      quantize=False)
