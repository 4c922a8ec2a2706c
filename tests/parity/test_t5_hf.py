"""Parity of our T5 (models/t5.py) with transformers' T5ForConditionalGeneration (float32, 1e-5), T5 1.0
(ReLU, tied head with the output rescale) and v1.1 / Flan (gated-GELU, untied head), through the production
adapter (models/hf/t5.py), both directions: a random HF model saved -> `from_hf` -> same logits (with a
padded encoder batch); ours -> `to_hf` -> transformers loads it -> same logits. Greedy generation with the
encoder output computed once and the decoder's KV cache equals transformers' `generate` token for token.
Unsupported configs and damaged dirs are refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.config import ModelConfig  # noqa: E402
from lmforge.errors import LmforgeError  # noqa: E402
from lmforge.models import build_model  # noqa: E402
from lmforge.models.hf import from_hf, hf_to_model_config, to_hf  # noqa: E402

V, S, T, ATOL = 97, 13, 9, 1e-5
VARIANTS = {
    "t5": {"feed_forward_proj": "relu"},  # T5 1.0: tied, rescaled
    "v1_1": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},  # v1.1 / Flan-T5
}


def hf_model(variant: str, **kw):
    # few buckets and a short max distance: the test lengths reach the logarithmic buckets too
    kw = {"num_decoder_layers": 3, **VARIANTS[variant], **kw}
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=12,
                                dropout_rate=0.0, layer_norm_epsilon=1e-6, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, **kw)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random everywhere, the head too: unit norms would hide swapped tensors
        for name, p in model.named_parameters():
            is_norm = re.search(r"layer_norm", name)
            p.copy_((1.0 if is_norm else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
        if variant == "v1_1":  # transformers 5 ties at construction; a loaded Flan-T5 has its own head
            head = 0.2 * torch.randn(model.lm_head.weight.shape, generator=g)
            model.lm_head.weight = torch.nn.Parameter(head)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(encoder ids, their attention mask, decoder ids): a full row, a right- and a left-padded one."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, V, (3, S), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, :4] = 0
    dec = torch.randint(2, V, (3, T), generator=g)
    dec[:, 0] = 0  # the decoder start
    return torch.where(mask.bool(), ids, 0), mask, dec


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_logits_match(variant, tmp_path):
    hf = hf_model(variant)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    cfg = ours.cfg
    assert cfg.arch == "t5" and cfg.n_layers == 2 and cfg.n_decoder_layers == 3
    assert (cfg.mlp, cfg.tie_embeddings, ours.scale_output) == (
        ("relu", True, True) if variant == "t5" else ("geglu", False, False))
    ids, mask, dec = batch()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        torch.testing.assert_close(ours(ids, dec, attention_mask=mask), want, atol=ATOL, rtol=0)
        # no mask: every encoder key attended
        want = hf(input_ids=ids, decoder_input_ids=dec).logits
        torch.testing.assert_close(ours(ids, dec), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_loads_in_transformers(variant, tmp_path):
    hf = hf_model(variant)
    hf.save_pretrained(tmp_path / "src")
    ours = from_hf(tmp_path / "src").eval()
    to_hf(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "t5" and config["architectures"] == ["T5ForConditionalGeneration"]
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is transformers.T5ForConditionalGeneration
    assert (back.lm_head.weight is back.shared.weight) == (variant == "t5")
    ids, mask, dec = batch()
    with torch.no_grad():
        want = ours(ids, dec, attention_mask=mask)
        got = back(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # and round trip: our import of the export has the same config
    assert from_hf(tmp_path / "out").cfg == ours.cfg


@pytest.mark.parametrize(("mlp", "tie"), [("relu", True), ("geglu", False)])
def test_fresh_t5_exports(mlp, tie, tmp_path):
    """A model of our own (T5's init) -> transformers -> the same logits."""
    cfg = ModelConfig(arch="t5", vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=40, mlp=mlp,
                      tie_embeddings=tie, max_seq_len=32, norm_eps=1e-6, relative_attention_num_buckets=8,
                      relative_attention_max_distance=12)
    torch.manual_seed(3)
    ours = build_model(cfg).eval()
    to_hf(ours, tmp_path)
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, mask, dec = batch()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
                                   ours(ids, dec, attention_mask=mask), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generate_matches_transformers(variant, tmp_path):
    from lmforge.models.t5_generate import generate

    # transformers' generate sizes its decoder cache by num_layers: an equal decoder depth here
    hf = hf_model(variant, num_decoder_layers=2)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    ids, mask, _ = batch()
    # no stop token: every row runs the whole budget (the self-attention cache grows to 12 positions)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        free = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                           num_beams=1)
    assert free.shape == (3, 13)
    got = generate(ours, ids, attention_mask=mask, max_new_tokens=12, stops=frozenset())
    assert got == free[:, 1:].tolist()
    # a stop token that ends row 0 early: transformers pads the row after it, ours ends there
    stop = int(free[0, 4])
    with torch.no_grad():
        want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                           num_beams=1, eos_token_id=stop)
    got = generate(ours, ids, attention_mask=mask, max_new_tokens=12, stops={stop})
    for row, mine in zip(want[:, 1:].tolist(), got):
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert mine == row[:cut]
    assert len(got[0]) <= 4 and got[0][-1] == stop


@pytest.mark.parametrize(("key", "value"), [("feed_forward_proj", "gated-silu"), ("is_decoder", True),
                                            ("is_encoder_decoder", False), ("tie_word_embeddings", "yes"),
                                            ("decoder_start_token_id", -1)])
def test_unsupported_configs_are_refused(key, value):
    cfg = hf_model("t5").config.to_dict()
    cfg[key] = value
    with pytest.raises(LmforgeError, match=key):
        hf_to_model_config(cfg)


def test_hostile_dirs_are_refused(tmp_path):
    """Weights that do not fit the config, a missing tensor, a stray tensor: one clear error each. (A
    missing lm_head is no error: transformers 5 writes tie_word_embeddings true for every T5, and a file
    without lm_head is then tied, as transformers loads it.)"""
    from safetensors.torch import load_file, save_file

    hf_model("v1_1").save_pretrained(tmp_path / "ok")
    state = load_file(tmp_path / "ok" / "model.safetensors")
    cases = {
        "missing tensors: decoder.block.1.layer.1.EncDecAttention.k.weight": {
            k: v for k, v in state.items() if k != "decoder.block.1.layer.1.EncDecAttention.k.weight"},
        "unexpected tensors: encoder.block.7": {**state, "encoder.block.7.layer.0.layer_norm.weight":
                                                torch.ones(32)},
        "does not fit our encoder.rel_bias.weight": {
            **state, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": torch.ones(9, 4),
        },
    }
    for i, (message, tensors) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        (bad / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(LmforgeError, match=re.escape(message)):
            from_hf(bad)


def test_t5_config_refuses_what_its_blocks_lack():
    with pytest.raises(ValueError, match="qkv_bias=True"):
        ModelConfig(arch="t5", qkv_bias=True)
    with pytest.raises(ValueError, match="mlp=swiglu"):
        ModelConfig(arch="t5", mlp="swiglu")
    with pytest.raises(ValueError, match="n_decoder_layers=3"):
        ModelConfig(n_decoder_layers=3)
    with pytest.raises(ValueError, match="mlp=relu"):
        ModelConfig(mlp="relu")
    with pytest.raises(ValueError, match=r"quant=\(set\)"):  # what `lmforge quantize` of a T5 run meets
        ModelConfig(arch="t5", quant={"bits": 8})
    cfg = ModelConfig(arch="t5")
    assert (cfg.pos_embedding, cfg.mlp) == ("relative", "relu")
