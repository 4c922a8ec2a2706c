"""GGUF export of DeepSeek-V3 as llama.cpp's `deepseek2`, verified by llama.cpp itself (transformers has
no GGUF loader for it): logits of 40 random tokens equal lmforge's within each weight type's tolerance.

Two tiny models (hidden 256 for the k-quant rows, 2 layers: one dense, one MoE of 4 experts + a shared
one) cover the layouts: low-rank q, DeepSeek's interleaved RoPE, YaRN with DeepSeek-V3's mscale and
grouped routing; a plain q projection with half-split RoPE (rows reordered to pairs), unnormalised top-k
and tied embeddings; and transformers' two other yarn forms. Max relative logit error against llama.cpp
(llama-cpp-python 0.3.36, printed with -s): f16 2.1e-3..4.3e-3, q8_0 2.4e-2, q4_k_m 0.17. Leaving out
(in f16) the pair reordering gives 0.52..0.66, the sigmoid gating key 1.6e-2..5.8e-2, the group keys
5.3e-2, the yarn log multiplier 0.21..0.47, the rope attn_factor 5.5e-2..0.28."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_models import (
    TOLERANCE,
    export,
    gguf,
    hf_tokenizer,
    llama_cpp,
    llama_cpp_error,
    llama_cpp_model,
    model_cache,
    perturb_vectors,
    random_ids,
    save_and_import,
    transformers,
)

from lmforge.cli import main

SHAPE = dict(hidden_size=256, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
             first_k_dense_replace=1, max_position_embeddings=64, rms_norm_eps=1e-6)
VARIANTS = {
    # DeepSeek-V3's own layout: q through its low-rank latent, interleaved RoPE extended by yarn with
    # V3's mscale = mscale_all_dim = 1 (the softmax scaled by (1 + 0.1 ln 4)^2), 2 groups of which 1 is
    # routed to, normalised top-k scaled by 2.5.
    "v3": dict(q_lora_rank=64, rope_interleave=True, n_group=2, topk_group=1, norm_topk_prob=True,
               routed_scaling_factor=2.5, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
    # a plain q projection, half-split RoPE, no groups, unnormalised top-k, tied embeddings
    "plain": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False,
                  routed_scaling_factor=1.5, tie_word_embeddings=True),
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
# transformers' other yarn forms, which llama.cpp's converter does not write: mscale != mscale_all_dim
# scales the rotation by their ratio; without mscale_all_dim the rotation by 1 + 0.1 ln 4, the softmax not
VARIANTS["v3_mscales"] = {**VARIANTS["v3"], "rope_parameters": {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7}}
VARIANTS["plain_yarn"] = {**VARIANTS["plain"], "rope_parameters": YARN}
# The quantized types run on a model whose every routed expert runs (top-4 of 4, so no groups) and whose
# attention scores stay small (attn_gain 1): top-k selection is discrete, and where two scores nearly
# tie, 8- or 4-bit rounding elsewhere in the model picks the other expert for that token (v3 at gain 1 in
# q8_0: 39 positions of 40 within 2.4e-2, one at 0.39); sharp attention multiplies the rounding (this
# model at gain 10 in q8_0: 7e-2, of which 5.5e-2 from the weights' rounding alone). Selection and the
# softmax scale are checked in f16, far below every gap.
VARIANTS["v3_quant"] = {**VARIANTS["v3"], "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1}
ATTN_GAIN = {"v3_quant": 1.0}


def _imported(tokenizer_file, root, attn_gain=10.0, **config):
    """A random DeepseekV3ForCausalLM (norms and the routing bias away from 1 and 0; the q and kv_b
    projections `attn_gain` times transformers' init) imported by lmforge."""
    hf_tok = hf_tokenizer(tokenizer_file)
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(vocab_size=len(hf_tok), **config)
    model = transformers.DeepseekV3ForCausalLM(config)
    perturb_vectors(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")):
                # gain 10: attention scores of a few units (not ~0.03, where every softmax is near
                # uniform), so that a wrong softmax scale (yarn's mscale) shows in the logits
                p.mul_(attn_gain)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return save_and_import(model, hf_tok, root)


@pytest.fixture(scope="module")
def variants(tokenizer_file, tmp_path_factory):
    """name -> (imported dir, lmforge's model of it), each imported once, on first use."""
    return model_cache(tmp_path_factory, lambda root, name: _imported(
        tokenizer_file, root, ATTN_GAIN.get(name, 10.0), **{**SHAPE, **VARIANTS[name]}))


def _fields(path):
    return {f.name: f.parts[-1] for f in gguf.GGUFReader(path).fields.values()}


def test_metadata_and_split_kv_b(variants, tmp_path):
    """The keys llama.cpp's deepseek2 reads, and kv_b_proj split into attn_k_b (transposed) / attn_v_b
    that put back together give the weights lmforge has."""
    imported, ours = variants("v3")
    out = tmp_path / "m.gguf"
    export(imported, out, "f16")
    f = _fields(out)
    assert bytes(f["general.architecture"]).decode() == "deepseek2"
    expect = {"deepseek2.attention.head_count_kv": 1, "deepseek2.attention.key_length": 64 + 16,
              "deepseek2.attention.value_length": 64, "deepseek2.attention.key_length_mla": 48,
              "deepseek2.attention.value_length_mla": 32, "deepseek2.attention.q_lora_rank": 64,
              "deepseek2.attention.kv_lora_rank": 64, "deepseek2.rope.dimension_count": 16,
              "deepseek2.leading_dense_block_count": 1, "deepseek2.expert_count": 4,
              "deepseek2.expert_used_count": 2, "deepseek2.expert_shared_count": 1,
              "deepseek2.expert_feed_forward_length": 64, "deepseek2.expert_gating_func": 2,  # sigmoid
              "deepseek2.expert_group_count": 2, "deepseek2.expert_group_used_count": 1,
              "deepseek2.rope.scaling.original_context_length": 16}
    assert {k: int(f[k][0]) for k in expect} == expect
    assert bool(f["deepseek2.expert_weights_norm"][0]) is True
    assert float(f["deepseek2.expert_weights_scale"][0]) == 2.5
    assert float(f["deepseek2.rope.scaling.yarn_log_multiplier"][0]) == pytest.approx(0.1)
    tensors = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32))
               for t in gguf.GGUFReader(out).tensors}
    k_b, v_b = tensors["blk.0.attn_k_b.weight"], tensors["blk.0.attn_v_b.weight"]  # (4, 64, 32), (4, 32, 64)
    assert k_b.shape == (4, 64, 32) and v_b.shape == (4, 32, 64)
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(4 * 64, 64)
    torch.testing.assert_close(kv_b, ours.layers[0].attn.wkv_b.weight.detach(), rtol=1e-3, atol=1e-4)
    assert tensors["blk.1.ffn_gate_exps.weight"].shape == (4, 64, 256)
    assert "blk.1.exp_probs_b.bias" in tensors and "blk.0.ffn_gate.weight" in tensors


@pytest.mark.parametrize(("name", "quant"), [("v3", "f16"), ("plain", "f16"), ("v3_mscales", "f16"),
                                           ("plain_yarn", "f16"), ("v3_quant", "q8_0"),
                                           ("v3_quant", "q4_k_m")])
def test_llama_cpp_loads_the_deepseek_gguf_with_equal_logits(variants, name, quant, tmp_path):
    """llama.cpp itself (llama-cpp-python) reads the file; its logits equal lmforge's within the weight
    type's tolerance, past YaRN's original context (16)."""
    llama_cpp()
    imported, ours = variants(name)
    out = tmp_path / "model.gguf"
    export(imported, out, quant)
    err = llama_cpp_error(llama_cpp_model(out), ours, random_ids(ours.cfg.vocab_size, (40,)))
    print(f"llama.cpp deepseek2 {name} {quant}: max relative logit error {err:.2e}")
    assert err < TOLERANCE[quant], (name, quant, err)


@pytest.mark.parametrize(("change", "named"), [
    # deepseek2 reads no yarn beta: llama.cpp's 32 and 1
    (dict(rope_parameters={**YARN, "beta_fast": 16.0}), "beta_fast"),
    (dict(attention_bias=True), "attention_bias"),
    # llama.cpp normalises the q/kv latents with rms_norm_eps; transformers with 1e-6
    (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
])
def test_what_deepseek2_cannot_express_is_refused_by_name(tokenizer_file, tmp_path, capsys, change, named):
    imported = _imported(tokenizer_file, tmp_path, **{**SHAPE, **VARIANTS["v3"], **change})
    capsys.readouterr()
    assert main(["export", str(imported), str(tmp_path / "m.gguf"), "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    assert named in err and "deepseek2" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "imported"]  # nothing written beside
