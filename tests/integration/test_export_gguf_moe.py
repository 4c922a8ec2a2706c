"""GGUF export of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), verified by
reloading: llama.cpp itself (the optional llama_cpp tier) for all four, transformers' GGUF loader for
the two it knows (qwen2_moe, qwen3_moe). Tiny models: 4 experts, top-2, 2 layers, 256 wide (a k-quant
row), routers that choose their pair of experts by a wide margin (see _imported).

Max relative logit error measured here (-s prints them; bounds: test_export_gguf's TOLERANCE):
llama.cpp f16 6e-4..1.2e-3, q8_0 1.5e-2..2.6e-2 (qwen3_moe's 768-wide experts the highest), q4_k_m
0.14..0.37 (olmoe the highest); transformers f16 4.5e-4 / 9.5e-4, q4_k_m 0.14 / 0.25 (qwen2_moe /
qwen3_moe). The layout is checked by f16's bound: stacking the experts in reverse order gives 0.35..0.78,
leaving out Mixtral's Q/K permutation 0.12."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_models import (
    TEXT,
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
    rel_error,
    save_and_import,
    transformers,
)

from lmforge.cli import main
from lmforge.data.tokenizer import Tokenizer

BASE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, tie_word_embeddings=False, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=256, num_local_experts=4, sliding_window=None)),
    # transformers' GGUF loader reads no expert width for qwen3_moe (GGUF_CONFIG_MAPPING has no
    # expert_feed_forward_length): it builds Qwen3MoeConfig's default 768, so the test model has 768
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=64, intermediate_size=256, moe_intermediate_size=768, num_experts=4,
                       norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=512,
                       num_experts=4, norm_topk_prob=False, use_sliding_window=False)),
    # llama.cpp's olmoe has no grouped-query attention (its k-norm is model-wide): 4 kv heads
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=256, num_experts=4, num_key_value_heads=4, norm_topk_prob=False)),
}


def _imported(name: str, tokenizer_file, root, **more):
    config_cls, model_cls, extra = FAMILIES[name]
    hf_tok = hf_tokenizer(tokenizer_file)
    torch.manual_seed(0)
    # OLMoE's config defaults name token ids of its own 50k vocabulary: ours instead
    ids = dict(eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id, bos_token_id=None)
    cfg = getattr(transformers, config_cls)(vocab_size=len(hf_tok), **{**BASE, **ids, **extra, **more})
    model = getattr(transformers, model_cls)(cfg)
    # A random router's top-2 is a near tie at a few of the 80 (position, layer) choices, where any
    # rounding picks another expert (a Qwen3-MoE under q8_0 measured 0.135 there, 0.02 elsewhere). So
    # every token embeds a strong sign along one direction u that the routers read: the pair of experts
    # is decided by a wide margin, the weights within the pair (and their renormalisation) stay random.
    g = torch.Generator().manual_seed(1)
    u = torch.randn(cfg.hidden_size, generator=g)
    u /= u.norm()
    perturb_vectors(model)  # (torch's generator; what follows draws from g only)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("embed_tokens.weight"):
                p.add_((torch.randint(0, 2, (p.shape[0], 1), generator=g) * 2 - 1) * u)
            elif n.endswith(".gate.weight"):  # a router: experts of the first half read +u, the others -u
                side = (torch.arange(p.shape[0]) < p.shape[0] // 2).float() * 2 - 1
                p.copy_(0.05 * torch.randn(p.shape, generator=g) + 0.5 * side[:, None] * u)
    return save_and_import(model, hf_tok, root)


@pytest.fixture(scope="module")
def families(tokenizer_file, tmp_path_factory):
    """name -> (imported dir, lmforge's model of it), each imported once, on first use."""
    return model_cache(tmp_path_factory, lambda root, name: _imported(name, tokenizer_file, root))


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("quant", ["f16", "q4_k_m"])
@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_transformers_reloads_the_moe_gguf_with_equal_logits(families, name, quant, tmp_path):
    imported, ours = families(name)
    out = tmp_path / "model.gguf"
    export(imported, out, quant)
    if name == "qwen2_moe":
        # transformers' GGUF loader reads neither expert width of qwen2_moe (no expert_feed_forward_length
        # nor expert_shared_feed_forward_length in its GGUF_CONFIG_MAPPING: it would build 1408/5632-wide
        # experts); give it the exported config, so that the file's tensors are what it checks here
        # (llama.cpp, which reads both keys, checks the metadata: test_llama_cpp_... below)
        config = transformers.AutoConfig.from_pretrained(imported.parent / "hf")  # what it was imported from
        err = rel_error(ours, out, random_ids(ours.cfg.vocab_size, (2, 40)), config=config)
    else:
        err = rel_error(ours, out, random_ids(ours.cfg.vocab_size, (2, 40)))
    print(f"transformers {name} {quant}: max relative logit error {err:.2e}")
    assert err < TOLERANCE[quant], (name, quant, err)
    types = _types(out)
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # the router is never quantized
    assert types["blk.1.ffn_down_exps.weight"] == ("F16" if quant == "f16" else "Q6_K")  # last layer: 6 bits


@pytest.mark.parametrize("quant", ["f16", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_llama_cpp_loads_the_moe_gguf_with_equal_logits(families, name, quant, tmp_path):
    """The optional tier: llama.cpp itself reads the file; its logits equal lmforge's within the weight
    type's tolerance and it tokenizes text to lmforge's ids."""
    llama_cpp()
    imported, ours = families(name)
    out = tmp_path / "model.gguf"
    export(imported, out, quant)
    llm = llama_cpp_model(out)
    tokenizer = Tokenizer.load(imported / "tokenizer.json")
    assert llm.tokenize(TEXT.encode(), add_bos=False, special=False) == tokenizer.encode(TEXT)
    err = llama_cpp_error(llm, ours, random_ids(ours.cfg.vocab_size, (40,)))
    print(f"llama.cpp {name} {quant}: max relative logit error {err:.2e}")
    assert err < TOLERANCE[quant], (name, quant, err)


@pytest.mark.parametrize(("name", "more", "says"), [
    ("qwen2_moe", dict(norm_topk_prob=True), "norm_topk_prob=true (llama.cpp's qwen2moe always keeps"),
    ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob=false (llama.cpp's qwen3moe always "
                                               "renormalises"),
    ("olmoe", dict(num_key_value_heads=2), "no grouped-query attention"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias (llama.cpp's qwen3moe has no attention-output"),
])
def test_settings_the_gguf_cannot_express_are_refused_by_name(tokenizer_file, tmp_path, capsys, name, more,
                                                               says):
    small = {k: 64 for k in FAMILIES[name][2] if k.endswith("intermediate_size")}
    imported = _imported(name, tokenizer_file, tmp_path, hidden_size=64, **{**small, **more})
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    capsys.readouterr()
    assert main(["export", str(imported), str(out), "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge export: error: GGUF export cannot write this") and says in err, err
    assert list(out.parent.iterdir()) == []  # nothing written, no scratch dir left


def test_an_eight_expert_model_keeps_attn_k_and_v_at_8_bits(tokenizer_file, tmp_path, capsys):
    """llama.cpp's quantizer keeps attn_k / attn_v of an 8-expert model at Q8_0 (and its attn_output
    above 4 bits) under Q4_K_M; Mixtral's window caps the context length, as Mistral's does."""
    imported = _imported("mixtral", tokenizer_file, tmp_path, num_local_experts=8, intermediate_size=32,
                         sliding_window=16)
    capsys.readouterr()
    export(imported, tmp_path / "m.gguf", "q4_k_m")
    assert "context length is set to 16 (not 128)" in capsys.readouterr().out
    types = _types(tmp_path / "m.gguf")
    assert types["blk.0.attn_k.weight"] == types["blk.1.attn_v.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.attn_output.weight"] == "Q6_K"
    # rows of 32: no k-quant block fits; Q4_K falls back to Q5_0, as in llama.cpp's quantizer
    assert types["blk.0.ffn_down_exps.weight"] == "Q5_0"
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    fields = {f.name: f for f in reader.fields.values()}
    assert int(fields["llama.expert_count"].parts[-1][0]) == 8
    assert int(fields["llama.expert_used_count"].parts[-1][0]) == 2
    assert int(fields["llama.context_length"].parts[-1][0]) == 16
    shapes = {t.name: list(t.shape) for t in reader.tensors}  # GGUF's order: in, out, expert
    assert shapes["blk.0.ffn_down_exps.weight"] == [32, 256, 8]


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe"])
def test_a_tied_model_gets_the_output_llama_cpp_requires(tokenizer_file, tmp_path, name):
    """llama.cpp's qwen2moe and olmoe require output.weight (their loaders fall back to no embedding):
    a model with tied embeddings gets the embedding written a second time as the output, and loads."""
    from lmforge.checkpoint.runs import load_model, run_config

    imported = _imported(name, tokenizer_file, tmp_path, tie_word_embeddings=True)
    out = tmp_path / "m.gguf"
    export(imported, out, "f16")
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}
    assert np.array_equal(tensors["output.weight"], tensors["token_embd.weight"])
    if name == "qwen2_moe":
        assert "blk.0.attn_q.bias" in tensors  # Qwen2-MoE's q/k/v biases are written
    llama_cpp()
    ours = load_model(*run_config(imported))[0].eval()
    err = llama_cpp_error(llama_cpp_model(out), ours, random_ids(ours.cfg.vocab_size, (40,)))
    print(f"llama.cpp {name} tied f16: max relative logit error {err:.2e}")
    assert err < TOLERANCE["f16"], (name, err)
