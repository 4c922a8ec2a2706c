"""A classifier's head against transformers' ...ForSequenceClassification, both ways, fp32 within 1e-5:
lmforge's Transformer with a score head of num_labels outputs, read at each row's last real token
(objective classify's pooling), exported and loaded by AutoModelForSequenceClassification (which pools
the last token that is not padding); and a LlamaForSequenceClassification / Qwen2 checkpoint of
transformers' own imported into lmforge. Right-padded batches with the pad id equal to eos, as lmforge
pads."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.config.schema import ModelConfig  # noqa: E402
from lmforge.engine.objectives.classify import classify_logits  # noqa: E402
from lmforge.models.hf.convert import from_hf, to_hf  # noqa: E402
from lmforge.models.transformer import add_head, build_model  # noqa: E402

PAD = 0


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 3, 9, 1])
    ids = torch.randint(1, 96, (5, 12), generator=g)
    mask = torch.arange(12)[None] < lengths[:, None]
    return torch.where(mask, ids, PAD), mask.long(), lengths


def _hf_logits(path, ids, mask):
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return type(hf).__name__, hf(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("num_labels", [1, 3])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, num_labels):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                      tie_embeddings=False)
    model = build_model(cfg)
    add_head(model, "score", outputs=num_labels)
    model.eval()
    to_hf(model, tmp_path, eos_token_id=PAD, pad_token_id=PAD)
    ids, mask, lengths = _batch()
    name, theirs = _hf_logits(tmp_path, ids, mask)
    with torch.no_grad():
        ours = classify_logits(model, ids, lengths)
    assert name == "LlamaForSequenceClassification" and theirs.shape == (5, num_labels)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    # ... and back: the exported dir imports as the same classifier
    back = from_hf(tmp_path).eval()
    assert (back.cfg.score_head, back.cfg.num_labels) == (True, num_labels)
    with torch.no_grad():
        torch.testing.assert_close(classify_logits(back, ids, lengths), ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_classifier_imports_with_equal_logits(tmp_path, family):
    kinds = {"llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification)}
    config_cls, model_cls = kinds[family]
    config = config_cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                        num_labels=4, pad_token_id=PAD, eos_token_id=PAD, tie_word_embeddings=False)
    torch.manual_seed(0)
    model_cls(config).save_pretrained(tmp_path)
    ids, mask, lengths = _batch()
    _, theirs = _hf_logits(tmp_path, ids, mask)
    ours = from_hf(tmp_path).eval()
    assert (ours.cfg.score_head, ours.cfg.num_labels) == (True, 4)
    with torch.no_grad():
        torch.testing.assert_close(classify_logits(ours, ids, lengths), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_encoder_classifier_both_ways(tmp_path, family):
    """BERT's pooler (dense + tanh on [CLS]) and classifier, RoBERTa's classification head: transformers'
    checkpoint imported, and lmforge's encoder classifier exported, with equal logits; a pair's second
    segment has token type 1."""
    kinds = {"bert": (transformers.BertConfig, transformers.BertForSequenceClassification, {}),
             "roberta": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification,
                         {"pad_token_id": 1, "type_vocab_size": 1})}
    config_cls, model_cls, extra = kinds[family]
    pad = extra.get("pad_token_id", 0)
    config = config_cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=40, num_labels=3,
                        **{"pad_token_id": 0, **extra})
    torch.manual_seed(0)
    model_cls(config).save_pretrained(tmp_path / "theirs")
    ids, mask, lengths = _batch()
    ids = torch.where(mask.bool(), ids.clamp(min=2), pad)
    types = torch.zeros_like(ids)
    if family == "bert":
        types = ((torch.arange(12)[None] >= 2) & mask.bool()).long()
    hf = model_cls.from_pretrained(tmp_path / "theirs", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    ours = from_hf(tmp_path / "theirs").eval()
    assert (ours.cfg.arch, ours.cfg.score_head, ours.cfg.num_labels) == ("encoder", True, 3)
    with torch.no_grad():
        torch.testing.assert_close(classify_logits(ours, ids, lengths, types), theirs, atol=1e-5, rtol=0)
    to_hf(ours, tmp_path / "ours")
    name, again = type(hf).__name__, model_cls.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids, attention_mask=mask, token_type_ids=types).logits,
                                   theirs, atol=1e-5, rtol=0)
    assert name == model_cls.__name__


def test_encoder_head_added_to_a_masked_lm():
    """A masked-LM encoder turned classifier: the MLM head goes, BERT's pooler and classifier come."""
    cfg = ModelConfig(arch="encoder", vocab_size=96, d_model=32, n_layers=1, n_heads=4, max_seq_len=16,
                      pos_embedding="learned", tie_embeddings=True, norm="layernorm", mlp="gelu", bias=True)
    model = build_model(cfg)
    add_head(model, "score", outputs=5)
    assert not hasattr(model, "head") and model.score.out_features == 5 and model.score.bias is not None
    rebuilt = build_model(model.cfg)
    assert set(rebuilt.state_dict()) == set(model.state_dict())
