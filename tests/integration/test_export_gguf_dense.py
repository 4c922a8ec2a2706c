"""GGUF export of Granite, SmolLM3, OLMo 2 and Phi-3 (finetune/gguf_arch/{granite,smollm3,olmo2,phi3}.py),
verified by reloading: llama.cpp itself (the optional tier, the test that decides: each family's graph
is llama.cpp's own) gives lmforge's logits within each weight type's tolerance; transformers' GGUF loader,
which of these four knows Phi-3 only, does too for a plain Phi-3.

Each test model sets what its family adds to Llama away from the neutral value: Granite's four multipliers
and its biases, SmolLM3's NoPE layer (4 layers: llama.cpp skips RoPE on every 4th), OLMo 2's post-norms
and whole-projection q/k norms with a tied head (llama.cpp's olmo2 needs the head written out), Phi-3's
fused projections, partial rotary and LongRoPE (its long factors, in force past the original length 16 on
both sides, and its short ones, in force below 256, where llama.cpp's context of 64 is rounded to).

Max relative logit error measured against llama.cpp 0.3.36 (printed with -s): see the report in
test_llama_cpp_loads_each_dense_family; the bounds are test_export_gguf.TOLERANCE."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_models import (
    TOLERANCE,
    export,
    gguf,
    gguf_fields,
    hf_tokenizer,
    llama_cpp,
    llama_cpp_error,
    llama_cpp_model,
    model_cache,
    perturb_vectors,
    random_ids,
    rel_error,
    save_and_import,
    transformers,
)

from lmforge.cli import main

BASE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, max_position_embeddings=128, tie_word_embeddings=False)
LONG = [1.0 + 0.25 * i for i in range(16)]  # 16 = a rotary half of 32 dims (head_dim 64, factor 0.5)
SHORT = [1.0 + 0.05 * i for i in range(16)]
# q/k weights times 4 give attention scores of order 1, where random weights give nearly uniform attention
# whatever the positions: then RoPE's layout (pairs or halves, partial, factors) and which layers skip it
# move the logits (a missing q/k permutation 7e-2, RoPE on SmolLM3's NoPE layer 0.18, LongRoPE's attention
# factor left out 0.95, against 1e-3..2.4e-3 as written). The f16 reloads use such models, the quantized
# ones the plain random models (peaked attention amplifies quantization error past the bounds, which
# test_export_gguf measured on plain random models).
SHARP = 4.0
CONFIGS = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.05, logits_scaling=2.5,
        attention_bias=True, mlp_bias=True)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        num_hidden_layers=4, no_rope_layer_interval=4, tie_word_embeddings=True)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=500.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None)),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=None, partial_rotary_factor=0.5, original_max_position_embeddings=16,
        rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})),
    "phi3_longrope_short": ("Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=None, partial_rotary_factor=0.5, max_position_embeddings=1024,
        original_max_position_embeddings=256, tie_word_embeddings=True,
        rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})),
}


def _imported(name: str, tokenizer_file, root, base=BASE, gain=1.0, **more):
    config_cls, model_cls, extra = CONFIGS[name]
    hf_tok = hf_tokenizer(tokenizer_file)
    torch.manual_seed(0)
    # the special ids of LlamaConfig, which test_export_gguf's models have (OLMo 2's default ids lie
    # past this 300-token vocabulary)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    cfg = getattr(transformers, config_cls)(vocab_size=len(hf_tok), **{**ids, **base, **extra, **more})
    model = getattr(transformers, model_cls)(cfg)
    perturb_vectors(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(gain)
    return save_and_import(model, hf_tok, root)


@pytest.fixture(scope="module")
def dense(tokenizer_file, tmp_path_factory):
    """(name, q/k gain) -> (imported dir, lmforge's model of it), each imported once, on first use."""
    return model_cache(tmp_path_factory, lambda root, name, gain: _imported(name, tokenizer_file, root,
                                                                           gain=gain))


def test_each_family_writes_its_architecture_keys_and_tensors(tokenizer_file, tmp_path):
    """The keys and tensors llama.cpp's loader reads, checked in the file itself (the default tier's check;
    64-wide models, head_dim 16: Phi-3 rotates 8 dims, so 4 factors)."""
    small = {**BASE, "hidden_size": 64, "intermediate_size": 64}
    longrope = {"type": "longrope", "short_factor": SHORT[:4], "long_factor": LONG[:4]}
    expect = {
        "granite": {"granite.embedding_scale": 3.0, "granite.residual_scale": 0.4,
                    "granite.attention.scale": 0.05, "granite.logit_scale": 2.5},
        "olmo2": {"olmo2.rope.freq_base": 500.0},
        "phi3_longrope": {"phi3.rope.dimension_count": 8, "phi3.rope.scaling.original_context_length": 16,
                          "phi3.attention.sliding_window": 0, "phi3.context_length": 128},
        # llama.cpp's phi3 attends to the whole context (it turns Phi's sliding window off): the file's
        # context length is the window, where both attend to the same keys
        "phi3": {"phi3.context_length": 16, "phi3.attention.sliding_window": 16},
    }
    for name, keys in expect.items():
        more = {"rope_scaling": longrope} if name == "phi3_longrope" else {}
        more = {"sliding_window": 16} if name == "phi3" else more
        imported = _imported(name, tokenizer_file, tmp_path / name, base=small, **more)
        out = tmp_path / f"{name}.gguf"
        export(imported, out, "f16")
        fields = gguf_fields(out)
        for key, value in keys.items():
            assert float(fields[key].parts[-1][0]) == pytest.approx(value), (name, key)
        tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
        if name == "olmo2":  # tied: the head written out, as llama.cpp's olmo2 requires
            assert {"output.weight", "blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight",
                    "blk.0.attn_q_norm.weight"} <= set(tensors)
            assert np.array_equal(tensors["output.weight"].data, tensors["token_embd.weight"].data)
            assert not any(n.endswith(("attn_norm.weight", "ffn_norm.weight")) for n in tensors)
        if name == "phi3_longrope":  # fused projections kept fused (GGML order: in, out); factors as tensors
            assert list(tensors["blk.0.attn_qkv.weight"].shape) == [64, 64 + 2 * 2 * 16]
            assert list(tensors["blk.0.ffn_up.weight"].shape) == [64, 2 * 64]
            assert np.allclose(tensors["rope_factors_long.weight"].data, LONG[:4])
            assert np.allclose(tensors["rope_factors_short.weight"].data, SHORT[:4])
            # lmforge's LongRoPE attention factor: sqrt(1 + ln(128 / 16) / ln(16))
            attn = float(fields["phi3.rope.scaling.attn_factor"].parts[-1][0])
            assert attn == pytest.approx(np.sqrt(1 + np.log(8) / np.log(16)), rel=1e-6)


@pytest.mark.parametrize("quant", ["f16", "q4_k_m"])
def test_transformers_reloads_a_phi3_gguf_with_equal_logits(dense, quant, tmp_path):
    """transformers' GGUF loader knows phi3 of these four (it reads no partial rotary or LongRoPE, so the
    plain Phi-3 only); it splits attn_qkv and ffn_up back into Phi3's fused modules."""
    imported, ours = dense("phi3", SHARP if quant == "f16" else 1.0)
    out = tmp_path / "model.gguf"
    export(imported, out, quant)
    err = rel_error(ours, out, random_ids(ours.cfg.vocab_size, (2, 40)))
    print(f"transformers phi3 {quant}: max relative logit error {err:.2e}")
    assert err < TOLERANCE[quant], (quant, err)


REFUSALS = [
    ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=2),
     "skips RoPE on every 4th layer only"),
    ("olmo2", dict(attention_bias=True), "no output-projection bias"),
    ("phi3", dict(head_dim=32), "sizes the query and output projections by hidden_size"),
]


@pytest.mark.parametrize(("name", "more", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_setting_gguf_cannot_hold_is_refused_by_name(name, more, message, tokenizer_file, tmp_path, capsys):
    small = {**BASE, "hidden_size": 64, "intermediate_size": 64}
    imported = _imported(name, tokenizer_file, tmp_path, base=small, **more)
    capsys.readouterr()
    out = tmp_path / "out" / "m.gguf"
    assert main(["export", str(imported), str(out), "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("quant", ["f16", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llama_cpp_loads_each_dense_family_with_equal_logits(dense, name, quant, tmp_path):
    """The optional tier: llama.cpp reads the file and its logits for 40 random ids equal lmforge's (f16
    on the SHARP models, where the layout shows; the quantized types on plain ones)."""
    llama_cpp()
    imported, ours = dense(name, SHARP if quant == "f16" else 1.0)
    out = tmp_path / "model.gguf"
    export(imported, out, quant)
    err = llama_cpp_error(llama_cpp_model(out), ours, random_ids(ours.cfg.vocab_size, (40,)))
    print(f"llama.cpp {name} {quant}: max relative logit error {err:.2e}")
    assert err < TOLERANCE[quant], (name, quant, err)
