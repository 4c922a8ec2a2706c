"""Logits parity of our Encoder with transformers' BertForMaskedLM and RobertaForMaskedLM (float32, 1e-5),
through the production adapter (models/hf/bert.py), both directions: a random HF model saved ->
`from_hf` -> same logits (with and without a padding mask); ours -> `to_hf` -> transformers loads it ->
same logits. Unsupported configs are refused by name."""

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

V, T, ATOL = 120, 19, 1e-5
FAMILIES = {
    "bert": (transformers.BertConfig, transformers.BertForMaskedLM, {"type_vocab_size": 2}),
    "roberta": (transformers.RobertaConfig, transformers.RobertaForMaskedLM, {"type_vocab_size": 1}),
}


def hf_model(kind: str, **kw):
    config_cls, model_cls, extra = FAMILIES[kind]
    cfg = config_cls(vocab_size=V, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=40, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12, **{**extra, **kw})
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random everywhere: HF's zero biases and unit norms would hide swapped tensors
        for name, p in model.named_parameters():
            is_norm = re.search(r"LayerNorm|layer_norm", name) and name.endswith("weight")
            p.copy_((1.0 if is_norm else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    return model


def padded_batch(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) (3, T): one full row, one right-padded, one left-padded."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, V, (3, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[2, :6] = 0
    return torch.where(mask.bool(), ids, pad_id), mask


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_import_logits_match(kind, tmp_path):
    hf = hf_model(kind)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    assert ours.cfg.arch == "encoder" and ours.cfg.position_offset == (2 if kind == "roberta" else 0)
    ids, mask = padded_batch(hf.config.pad_token_id)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask)
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)
        # no mask: every key attended, positions as transformers derives them from the ids
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=ATOL, rtol=0)
        # token types (BERT has two)
        if kind == "bert":
            types = (torch.arange(T) >= 9).long().expand(3, T)
            want_types = hf(input_ids=ids, token_type_ids=types).logits
            torch.testing.assert_close(ours(ids, token_type_ids=types), want_types, atol=ATOL, rtol=0)
        # select: only the chosen positions' logits, the same values
        sel = torch.zeros_like(real)
        sel[0, [1, 5]] = True
        sel[2, 7] = True
        torch.testing.assert_close(ours(ids, attention_mask=mask, select=sel), want[sel], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_export_loads_in_transformers(kind, tmp_path):
    hf = hf_model(kind)
    hf.save_pretrained(tmp_path / "src")
    ours = from_hf(tmp_path / "src").eval()
    to_hf(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == kind and config["architectures"] == [FAMILIES[kind][1].__name__]
    back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is FAMILIES[kind][1]
    ids, mask = padded_batch(hf.config.pad_token_id)
    with torch.no_grad():
        want = ours(ids, attention_mask=mask)
        got = back(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)


def test_fresh_encoder_exports_as_bert(tmp_path):
    """A model of our own (BERT layout, random init) -> transformers -> the same logits."""
    cfg = ModelConfig(arch="encoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=24,
                      norm="layernorm", norm_eps=1e-12, pos_embedding="learned", mlp="gelu", bias=True)
    torch.manual_seed(3)
    ours = build_model(cfg).eval()
    to_hf(ours, tmp_path)
    back = transformers.BertForMaskedLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ours(ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("key", "value"), [("position_embedding_type", "relative_key"),
                                            ("hidden_act", "relu"), ("is_decoder", True),
                                            ("tie_word_embeddings", False)])
def test_unsupported_configs_are_refused(key, value):
    cfg = hf_model("bert").config.to_dict()
    cfg[key] = value
    with pytest.raises(LmforgeError, match=key):
        hf_to_model_config(cfg)

