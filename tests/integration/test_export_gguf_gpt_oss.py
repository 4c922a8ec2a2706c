"""`lmforge export RUN OUT.gguf --format gguf` of a gpt-oss model, verified by llama.cpp itself (its
`gpt-oss` architecture): logits for 40 random ids equal lmforge's within each weight type's tolerance.

The test model has what a layout mistake would show: attention sinks of order 1, q/k/v/o and router and
expert biases away from 0, expert weights large enough that the clamped SwiGLU's limit binds, a sliding
window (16) shorter than the 40 tokens on the sliding layers, YaRN past its original 32 positions, and
hidden / expert widths of 256 (whole k-quant rows). There is no transformers reload test: transformers'
GGUF loader (5.24) cannot read llama.cpp's gpt-oss layout (test_transformers_gguf_loader_cannot_read_it).

Max relative logit error against llama.cpp measured here (printed with -s; bounds: test_export_gguf's
TOLERANCE): f16 8.7e-4..1.3e-3 (2.1e-3 with YaRN's truncate false, which llama.cpp rounds), q8_0 2.5e-2,
q4_k_m 0.20. The f16 bound catches the layout: swapping gate and up gives 0.98, zero sinks 0.95, zero up
biases 3.5e-2, leaving out the clamp (limit 7) on lmforge's side 0.78."""

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
    random_ids,
    rel_error,
    save_and_import,
    transformers,
)

from lmforge.cli import main

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": True, "rope_theta": 10000.0}
CONFIG = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
              sliding_window=16, tie_word_embeddings=False, attention_bias=True, rope_parameters=YARN)


def _imported(tokenizer_file, root, **over):
    """A random transformers GptOssForCausalLM with a 300-token tokenizer, imported by lmforge."""
    hf_tok = hf_tokenizer(tokenizer_file)
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(vocab_size=len(hf_tok), **{**CONFIG, **over})
    model = transformers.GptOssForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in n:
                p.copy_(1 + 0.2 * noise)
            elif "sinks" in n:
                p.copy_(noise)
            elif n.endswith("gate_up_proj"):
                p.copy_(0.3 * noise)  # pre-activations of a few units: the limit (7) clamps some
            elif p.ndim == 1 or n.endswith("_bias"):
                p.copy_(0.1 * noise)
    return save_and_import(model, hf_tok, root)


@pytest.fixture(scope="module")
def models(tokenizer_file, tmp_path_factory):
    """name -> (imported dir, lmforge's model of it), each built once, on first use."""
    variants = {
        "gpt_oss": {},
        # every layer full attention, tied head, no attention biases, plain RoPE
        "gpt_oss_full_tied": dict(layer_types=["full_attention"] * 2, tie_word_embeddings=True,
                                  attention_bias=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # linear RoPE scaling; heads narrower than hidden / n_heads (the released: 64 < 2880 / 64)
        "gpt_oss_linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                               head_dim=32),
        # every expert runs (top-4 of 4): no near-tie in the top-k for quantization noise to flip
        "gpt_oss_all_experts": dict(num_experts_per_tok=4),
        # as the released models: YaRN without rounding its correction range (llama.cpp rounds it)
        "gpt_oss_untruncated": dict(rope_parameters={**YARN, "truncate": False}),
    }
    return model_cache(tmp_path_factory, lambda root, name: _imported(tokenizer_file, root, **variants[name]))


def test_the_file_has_the_converters_gpt_oss_layout(models, tmp_path, capsys):
    """Names, shapes and types as llama.cpp's converter writes gpt-oss: split gate/up experts with biases,
    sinks and router F32, the window and (where not llama.cpp's default) the per-layer pattern."""
    imported, _ = models("gpt_oss")
    export(imported, tmp_path / "m.gguf", "q8_0")
    fields = gguf_fields(tmp_path / "m.gguf")
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "gpt-oss"
    assert int(fields["gpt-oss.attention.sliding_window"].parts[-1][0]) == 16
    assert "gpt-oss.attention.sliding_window_pattern" not in fields  # even layers slide: the default
    assert int(fields["gpt-oss.expert_feed_forward_length"].parts[-1][0]) == 256
    assert bytes(fields["gpt-oss.rope.scaling.type"].parts[-1]).decode() == "yarn"
    T = gguf.GGMLQuantizationType
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    for name, shape, qtype in (("blk.0.ffn_gate_exps.weight", [256, 256, 4], T.Q8_0),
                               ("blk.0.ffn_up_exps.bias", [256, 4], T.F32),
                               ("blk.1.ffn_down_exps.weight", [256, 256, 4], T.Q8_0),
                               ("blk.1.attn_sinks.weight", [4], T.F32),
                               ("blk.0.ffn_gate_inp.weight", [256, 4], T.F32),
                               ("blk.0.attn_q.bias", [256], T.F32)):
        assert (list(tensors[name].shape), tensors[name].tensor_type) == (shape, qtype), name
    # the up bias is the odd columns of Hugging Face's interleaved gate_up_proj_bias
    from safetensors.torch import load_file

    hf = load_file(imported.parent / "hf" / "model.safetensors")
    up = torch.from_numpy(np.array(tensors["blk.0.ffn_up_exps.bias"].data))
    assert torch.equal(up, hf["model.layers.0.mlp.experts.gate_up_proj_bias"][:, 1::2])

    full, _ = models("gpt_oss_full_tied")
    export(full, tmp_path / "full.gguf", "f16")
    assert "slide over a window of the whole context (128 tokens)" in capsys.readouterr().out
    fields = gguf_fields(tmp_path / "full.gguf")
    pattern = fields["gpt-oss.attention.sliding_window_pattern"]
    assert [bool(pattern.parts[i][0]) for i in pattern.data] == [True, True]
    assert int(fields["gpt-oss.attention.sliding_window"].parts[-1][0]) == 128
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "full.gguf").tensors}
    assert "output.weight" in tensors and "blk.0.attn_q.bias" not in tensors
    assert not np.array(tensors["blk.0.attn_output.bias"].data).any()  # llama.cpp requires one: zeros


def test_settings_the_gguf_cannot_express_are_refused(tokenizer_file, tmp_path, capsys, monkeypatch):
    """llama.cpp hard-codes gpt-oss's SwiGLU alpha and limit and YaRN's betas: another value is refused by
    name before the Hugging Face export, and nothing is left behind."""
    imported = _imported(tokenizer_file, tmp_path, swiglu_limit=5.0)
    out = tmp_path / "out"
    out.mkdir()
    capsys.readouterr()
    assert main(["export", str(imported), str(out / "m.gguf"), "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "swiglu_limit=5.0" in err and "--format hf" in err and err.count("\n") == 1
    assert list(out.iterdir()) == []
    betas = _imported(tokenizer_file, tmp_path / "b", rope_parameters={**YARN, "beta_fast": 16.0})
    assert main(["export", str(betas), str(out / "m.gguf"), "--format", "gguf"]) == 2
    assert "beta_fast" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_transformers_gguf_loader_cannot_read_it(models, tmp_path):
    """transformers 5.24's gpt_oss GGUF loader cannot read llama.cpp's gpt-oss layout (its converter's and
    ours): it takes each rope.scaling key's name length for its value, so a YaRN file fails to open, and
    it expects expert tensors named ffn_*_projs, so on a file without YaRN it leaves the experts and the
    sinks newly initialised and its logits are not the model's. llama.cpp is the reference here. If this
    starts failing, transformers has learnt the layout: turn it into a reload test."""
    imported, ours = models("gpt_oss")
    export(imported, tmp_path / "yarn.gguf", "f16")
    with pytest.raises(TypeError):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="yarn.gguf")
    imported, ours = models("gpt_oss_full_tied")
    export(imported, tmp_path / "m.gguf", "f16")
    assert rel_error(ours, tmp_path / "m.gguf", random_ids(ours.cfg.vocab_size, (1, 40))) > 0.5


@pytest.mark.parametrize(("name", "quant"), [
    ("gpt_oss", "f16"), ("gpt_oss_full_tied", "f16"), ("gpt_oss_untruncated", "f16"),
    ("gpt_oss_linear", "f16"),
    ("gpt_oss_all_experts", "f16"), ("gpt_oss_all_experts", "q8_0"), ("gpt_oss_all_experts", "q4_k_m")])
def test_llama_cpp_gpt_oss_gives_equal_logits(models, name, quant, tmp_path):
    """llama.cpp itself (llama-cpp-python) reads the file; its logits equal lmforge's within the weight
    type's tolerance, past the sliding window and YaRN's original context.

    The quantized types run on the model whose tokens use every expert: top-k selection is discrete, and
    where two router logits nearly tie, 8- or 4-bit rounding elsewhere in the model picks the other
    expert for that token (measured on the top-2-of-4 model in q8_0: 39 positions of 40 at <= 2.6e-2,
    one whose second and third router logits differ by 0.005 at 0.41). Selection itself is checked in
    f16, whose error is far below every gap."""
    llama_cpp()
    imported, ours = models(name)
    out = tmp_path / "model.gguf"
    export(imported, out, quant)
    err = llama_cpp_error(llama_cpp_model(out), ours, random_ids(ours.cfg.vocab_size, (40,)))
    print(f"llama.cpp {name} {quant}: max relative logit error {err:.2e}")
    assert err < TOLERANCE[quant], (name, quant, err)
