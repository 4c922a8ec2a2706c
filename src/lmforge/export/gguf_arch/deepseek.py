"""DeepSeek-V3 as llama.cpp's `deepseek2` (its converter files DeepseekV3ForCausalLM there).

Multi-head latent attention is written as llama.cpp's absorbed MLA: one key/value "head" (the latent of
kv_lora_rank plus the shared rotated key) and kv_b_proj split per head into attn_k_b (transposed: it
multiplies the queries' no-rope part into the latent) and attn_v_b. llama.cpp rotates adjacent pairs,
DeepSeek's own (rope_interleave) layout; a half-split checkpoint has its rope rows of q and of
kv_a_proj_with_mqa reordered to pairs. The MoE keys say what the converter leaves to its config's
`scoring_func`, which transformers' config (and lmforge's export) lacks: sigmoid scores, else llama.cpp
routes by softmax. YaRN's two scales (of the rotation and, with mscale_all_dim, of MLA's softmax) are
written as llama.cpp's yarn_log_multiplier and rope attn_factor (see _yarn)."""

from __future__ import annotations

import math
from typing import Any

import torch

from lmforge.errors import LmforgeError
from lmforge.export.gguf_arch.common import Context, Planned, context_length
from lmforge.models.hf.deepseek import LATENT_NORM_EPS

ARCHES = {"deepseek_v3": "deepseek2"}

_PROJ = ("gate_proj", "up_proj", "down_proj")
_FFN = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _refuse(what: str) -> LmforgeError:
    return LmforgeError(f"GGUF export of deepseek_v3 (llama.cpp's deepseek2): {what}; use --format hf")


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn(cfg: dict[str, Any]) -> dict[str, float] | None:
    """None for plain RoPE, else what llama.cpp's deepseek2 is told of yarn: factor, original context,
    log multiplier L and rope attn_factor a; LmforgeError for a yarn it computes differently.

    transformers scales cos/sin by R (attention_factor, else mscale(s, mscale) / mscale(s, mscale_all_dim)
    when both are set, else mscale(s, 1)) and MLA's softmax by F = mscale(s, mscale_all_dim)^2
    (models/common/rope.py, mla.py). llama.cpp (llama-context.cpp, models/deepseek2.cpp), with
    c = 1 + 0.1 ln s: for L != 0 the rotation by a and the softmax by (a (1 + 0.1 L ln s))^2; for L = 0
    both by a * mscale(s, 1) (squared for the softmax). So a = R and L = (sqrt(F) / R - 1) / (0.1 ln s)
    give both, and DeepSeek's own mscale = mscale_all_dim gives a = 1, L = mscale_all_dim, which is what
    llama.cpp's converter writes."""
    from lmforge.models.hf import rope

    params = rope.rope_params(cfg)
    kind = rope.rope_kind(params)
    if kind == "default":
        return None
    if kind != "yarn":
        raise _refuse(f"RoPE scaling {kind!r} has no deepseek2 form (none or yarn)")
    scaling, _ = rope.scaling_from_hf(params, int(cfg.get("max_position_embeddings", 4096)))
    # deepseek2 reads no beta keys: llama.cpp's defaults, with the truncated ramp ends transformers' has
    for key, want in (("beta_fast", 32.0), ("beta_slow", 1.0), ("truncate", True)):
        if scaling[key] != want:
            raise _refuse(f"rope_parameters.{key}={scaling[key]} (llama.cpp's deepseek2 takes only {want})")
    s, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    rotation = scaling.get("attention_factor")
    if rotation is None:
        rotation = _mscale(s, m) / _mscale(s, m_all) if m and m_all else _mscale(s, 1.0)
    softmax = _mscale(s, m_all) ** 2 if m_all else 1.0
    ratio = math.sqrt(softmax) / rotation
    if math.isclose(ratio, 1.0, rel_tol=1e-6):
        log_mul, attn = 0.0, rotation / _mscale(s, 1.0)
    elif s != 1.0:
        log_mul, attn = (ratio - 1.0) / (0.1 * math.log(s)), rotation
    else:  # factor 1: llama.cpp's softmax factor is the rotation's square, whatever L
        raise _refuse(f"yarn RoPE of factor 1 scaling the rotation by {rotation:.6g} and the softmax by "
                      f"{softmax:.6g} (llama.cpp's deepseek2 scales the softmax by the rotation's square)")
    return {"factor": s, "original": scaling["original_max_position_embeddings"], "log_mul": log_mul,
            "attn_factor": attn}


def check(cfg: dict[str, Any]) -> None:
    if cfg.get("attention_bias"):
        raise _refuse("attention_bias=true (deepseek2 has no q/kv/o projection biases)")
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    # llama.cpp normalises the q and kv latents with rms_norm_eps; transformers with a fixed 1e-6
    if not math.isclose(eps, LATENT_NORM_EPS, rel_tol=1e-6):
        raise _refuse(f"rms_norm_eps={eps}: llama.cpp's deepseek2 also normalises the q/kv latents with it, "
                      f"where this model uses {LATENT_NORM_EPS} (a model with model.norm_eps=1e-6 exports)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse(f"hidden_act={cfg['hidden_act']!r} (deepseek2's MLPs are SwiGLU)")
    if int(cfg.get("num_nextn_predict_layers") or 0) > 0:
        raise _refuse("multi-token-prediction layers (num_nextn_predict_layers > 0)")
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if n_group > 1 and topk_group < n_group and cfg["n_routed_experts"] // n_group < 2:
        raise _refuse(f"n_group={n_group} over {cfg['n_routed_experts']} experts (a group's score is its "
                      "two best experts'; llama.cpp needs at least two per group)")
    _yarn(cfg)


def metadata(ctx: Context) -> None:
    w, cfg, gguf = ctx.writer, ctx.cfg, ctx.gguf
    rank, rope_dim = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    w.add_context_length(context_length(cfg, ctx.say))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(ctx.n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(ctx.n_heads)
    # absorbed MLA is multi-query attention over the latent: one "head" of the latent plus the rope key
    w.add_head_count_kv(1)
    w.add_key_length(rank + rope_dim)
    w.add_value_length(rank)
    w.add_key_length_mla(int(cfg["qk_nope_head_dim"]) + rope_dim)
    w.add_value_length_mla(int(cfg["v_head_dim"]))
    w.add_kv_lora_rank(rank)
    # 0 for a plain q projection: llama.cpp reads the key for every deepseek2 but V2-Lite-sized ones
    w.add_q_lora_rank(int(cfg.get("q_lora_rank") or 0))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_rope_dimension_count(rope_dim)
    from lmforge.models.hf import rope

    w.add_rope_freq_base(rope.rope_theta(cfg, rope.rope_params(cfg)))
    yarn = _yarn(cfg)
    if yarn is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn["factor"])
        w.add_rope_scaling_orig_ctx_len(int(yarn["original"]))
        if yarn["log_mul"]:
            # llama.cpp divides this key by 0.1 for deepseek2 (its converter's legacy factor)
            w.add_rope_scaling_yarn_log_mul(0.1 * yarn["log_mul"])
        if yarn["attn_factor"] != 1.0:
            w.add_rope_scaling_attn_factors(yarn["attn_factor"])
    w.add_leading_dense_block_count(min(int(cfg["first_k_dense_replace"]), ctx.n_layers))
    w.add_expert_count(int(cfg["n_routed_experts"]))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    w.add_expert_shared_count(int(cfg["n_shared_experts"]))
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    w.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if n_group > 1 and topk_group < n_group:  # all groups kept: no limit (llama.cpp refuses used == count)
        w.add_expert_group_count(n_group)
        w.add_expert_group_used_count(topk_group)


def _pairs(w: torch.Tensor, n: int, nope: int, rope_dim: int) -> torch.Tensor:
    """Rows of n blocks of (nope, rope) with each block's rope rows from halves order to adjacent pairs
    (transformers' half-split rotation, rope_interleave=false, becomes llama.cpp's pair rotation)."""
    blocks = w.reshape(n, nope + rope_dim, -1)
    rope_rows = blocks[:, nope:].reshape(n, 2, rope_dim // 2, -1).swapaxes(1, 2).reshape(n, rope_dim, -1)
    return torch.cat([blocks[:, :nope], rope_rows], dim=1).reshape(w.shape)


def plan(ctx: Context) -> list[Planned]:
    cfg, tensors = ctx.cfg, ctx.tensors
    n_heads, rank = ctx.n_heads, int(cfg["kv_lora_rank"])
    nope, rope_dim, v_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    pairs = not cfg.get("rope_interleave", True)
    used: set[str] = set()
    out: list[Planned] = []

    def put(gname: str, hf: str, transform=None, quantize: bool = True) -> None:
        used.add(hf)
        load = (lambda: tensors[hf]) if transform is None else (lambda: transform(tensors[hf]))
        out.append(Planned(gname, tensors.shape(hf), load, quantize=quantize))

    put("token_embd.weight", "model.embed_tokens.weight")
    for i in range(ctx.n_layers):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        attn = hf + "self_attn."
        put(blk + "attn_norm.weight", hf + "input_layernorm.weight")
        q_pairs = (lambda t: _pairs(t, n_heads, nope, rope_dim)) if pairs else None
        if attn + "q_proj.weight" in tensors.where:
            put(blk + "attn_q.weight", attn + "q_proj.weight", q_pairs)
        else:
            put(blk + "attn_q_a.weight", attn + "q_a_proj.weight")
            put(blk + "attn_q_a_norm.weight", attn + "q_a_layernorm.weight")
            put(blk + "attn_q_b.weight", attn + "q_b_proj.weight", q_pairs)
        put(blk + "attn_kv_a_mqa.weight", attn + "kv_a_proj_with_mqa.weight",
            (lambda t: _pairs(t, 1, rank, rope_dim)) if pairs else None)
        put(blk + "attn_kv_a_norm.weight", attn + "kv_a_layernorm.weight")
        kv_b = attn + "kv_b_proj.weight"
        used.add(kv_b)

        def per_head(name=kv_b):  # (n_heads, nope + v, rank): each head's key rows, then its value rows
            return tensors[name].reshape(n_heads, nope + v_dim, rank)

        out.append(Planned(blk + "attn_k_b.weight", [n_heads, rank, nope],
                           lambda f=per_head: f()[:, :nope].transpose(1, 2).contiguous()))
        out.append(Planned(blk + "attn_v_b.weight", [n_heads, v_dim, rank],
                           lambda f=per_head: f()[:, nope:].contiguous()))
        put(blk + "attn_output.weight", attn + "o_proj.weight")
        put(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        if hf + "mlp.gate_proj.weight" in tensors.where:  # a leading dense block
            for proj in _PROJ:
                put(blk + f"ffn_{_FFN[proj]}.weight", hf + f"mlp.{proj}.weight")
            continue
        put(blk + "ffn_gate_inp.weight", hf + "mlp.gate.weight", quantize=False)  # llama.cpp keeps it F32
        put(blk + "exp_probs_b.bias", hf + "mlp.gate.e_score_correction_bias", quantize=False)
        for proj in _PROJ:
            put(blk + f"ffn_{_FFN[proj]}_shexp.weight", hf + f"mlp.shared_experts.{proj}.weight")
        n_experts = int(cfg["n_routed_experts"])
        for proj in _PROJ:
            names = [hf + f"mlp.experts.{j}.{proj}.weight" for j in range(n_experts)]
            missing = [n for n in names if n not in tensors.where]
            if missing:
                raise LmforgeError(f"GGUF export: {missing[0]} is missing (expected one tensor per expert)")
            used.update(names)
            out.append(Planned(blk + f"ffn_{_FFN[proj]}_exps.weight", [n_experts, *tensors.shape(names[0])],
                               lambda names=names: torch.stack([tensors[n] for n in names])))
    put("output_norm.weight", "model.norm.weight")
    if "lm_head.weight" in tensors.where and not cfg.get("tie_word_embeddings"):
        put("output.weight", "lm_head.weight")
    used.add("lm_head.weight")
    left = sorted(set(tensors.where) - used)
    if left:
        raise LmforgeError(f"GGUF export: no llama.cpp deepseek2 tensor for {', '.join(left[:5])}")
    return out
