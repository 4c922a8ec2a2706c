"""A tagger's and an extractive reader's heads against transformers' ...ForTokenClassification and
...ForQuestionAnswering, both ways, fp32 within 1e-5: lmforge's decoder (Llama, Mistral, Qwen2) and encoder
(BERT, RoBERTa) with a per-token score head exported and loaded by transformers' Auto classes with equal
logits at every real position, and transformers' own checkpoints imported into lmforge with equal logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.config.schema import ModelConfig  # noqa: E402
from lmforge.engine.objectives.qa import span_logits  # noqa: E402
from lmforge.engine.objectives.token_classify import token_scores  # noqa: E402
from lmforge.models.hf.convert import from_hf, to_hf  # noqa: E402
from lmforge.models.transformer import add_head, build_model  # noqa: E402

PAD = 0
AUTO = {"token": "AutoModelForTokenClassification", "span": "AutoModelForQuestionAnswering"}
SUFFIX = {"token": "ForTokenClassification", "span": "ForQuestionAnswering"}


def _batch(pad: int = PAD):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 3, 9, 1])
    ids = torch.randint(2, 96, (5, 12), generator=g)
    mask = torch.arange(12)[None] < lengths[:, None]
    return torch.where(mask, ids, pad), mask.long(), lengths


def _ours(model, reads, ids, lengths, types=None) -> torch.Tensor:
    """(B, T, outputs) of lmforge's head: a tagger's logits or a reader's (start, end)."""
    with torch.no_grad():
        if reads == "token":
            return token_scores(model, ids, lengths)
        start, end = span_logits(model, SimpleNamespace(input_ids=ids, lengths=lengths, token_types=types))
        return torch.stack([start, end], -1)


def _theirs(path, reads, ids, mask, types=None) -> tuple[str, torch.Tensor]:
    hf = getattr(transformers, AUTO[reads]).from_pretrained(path, dtype=torch.float32).eval()
    kw = {} if types is None else {"token_type_ids": types}
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, **kw)
    logits = out.logits if reads == "token" else torch.stack([out.start_logits, out.end_logits], -1)
    return type(hf).__name__, logits


def _close(ours, theirs, mask):
    real = mask.bool()  # padding positions are no answer and no tag (lmforge's span logits are -inf there)
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)


def _randomize_bias(model):
    with torch.no_grad():
        model.score.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("reads", ["token", "span"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoder_export_loads_in_transformers_with_equal_logits(tmp_path, family, reads):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                      tie_embeddings=False, qkv_bias=family == "qwen2")
    model = build_model(cfg)
    add_head(model, "score", outputs=5 if reads == "token" else 2, reads=reads)
    _randomize_bias(model)
    model.eval()
    to_hf(model, tmp_path, eos_token_id=PAD, pad_token_id=PAD)
    ids, mask, lengths = _batch()
    name, theirs = _theirs(tmp_path, reads, ids, mask)
    assert name == {"llama": "Llama", "qwen2": "Qwen2"}[family] + SUFFIX[reads]
    ours = _ours(model, reads, ids, lengths)
    _close(ours, theirs, mask)
    back = from_hf(tmp_path).eval()  # ... and back: the exported dir imports as the same head
    assert (back.cfg.score_head, back.cfg.score_reads, back.cfg.num_labels) == (True, reads, ours.size(-1))
    _close(_ours(back, reads, ids, lengths), ours, mask)


@pytest.mark.parametrize("reads", ["token", "span"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_transformers_heads_import_with_equal_logits(tmp_path, family, reads):
    kinds = {"llama": (transformers.LlamaConfig, "Llama"), "mistral": (transformers.MistralConfig, "Mistral"),
             "qwen2": (transformers.Qwen2Config, "Qwen2")}
    config_cls, prefix = kinds[family]
    config = config_cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                        num_labels=4 if reads == "token" else 2, pad_token_id=PAD, eos_token_id=PAD,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    theirs_model = getattr(transformers, prefix + SUFFIX[reads])(config)
    with torch.no_grad():
        head = theirs_model.score if reads == "token" else theirs_model.qa_outputs
        head.bias.normal_(0, 0.5)
    theirs_model.save_pretrained(tmp_path)
    ids, mask, lengths = _batch()
    _, theirs = _theirs(tmp_path, reads, ids, mask)
    ours = from_hf(tmp_path).eval()
    assert (ours.cfg.score_head, ours.cfg.score_reads) == (True, reads)
    _close(_ours(ours, reads, ids, lengths), theirs, mask)


@pytest.mark.parametrize("reads", ["token", "span"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_encoder_heads_both_ways(tmp_path, family, reads):
    """BERT's / RoBERTa's token classifier and QA head (no pooler): transformers' checkpoint imported, and
    lmforge's encoder exported again, with equal logits; a reader's context has token type 1 (BERT)."""
    kinds = {"bert": (transformers.BertConfig, "Bert", {}),
             "roberta": (transformers.RobertaConfig, "Roberta", {"pad_token_id": 1, "type_vocab_size": 1})}
    config_cls, prefix, extra = kinds[family]
    pad = extra.get("pad_token_id", 0)
    config = config_cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=40,
                        num_labels=3 if reads == "token" else 2, **{"pad_token_id": 0, **extra})
    torch.manual_seed(0)
    model_cls = getattr(transformers, prefix + SUFFIX[reads])
    theirs_model = model_cls(config)
    with torch.no_grad():
        (theirs_model.classifier if reads == "token" else theirs_model.qa_outputs).bias.normal_(0, 0.5)
    theirs_model.save_pretrained(tmp_path / "theirs")
    ids, mask, lengths = _batch(pad)
    types = None
    if reads == "span":
        types = torch.zeros_like(ids)
        if family == "bert":
            types = ((torch.arange(12)[None] >= 2) & mask.bool()).long()
    _, theirs = _theirs(tmp_path / "theirs", reads, ids, mask, types)
    ours = from_hf(tmp_path / "theirs").eval()
    assert (ours.cfg.arch, ours.cfg.score_reads) == ("encoder", reads) and not hasattr(ours, "pooler")
    _close(_ours(ours, reads, ids, lengths, types), theirs, mask)
    to_hf(ours, tmp_path / "ours")
    name, again = _theirs(tmp_path / "ours", reads, ids, mask, types)
    assert name == prefix + SUFFIX[reads]
    _close(again, theirs, mask)


def test_a_family_without_the_head_class_is_refused(tmp_path):
    from lmforge.errors import LmforgeError

    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=1, n_heads=4, max_seq_len=16,
                      pos_embedding="learned", bias=True, mlp="gelu_tanh", norm="layernorm")  # GPT-2
    model = build_model(cfg)
    add_head(model, "score", outputs=3, reads="token")
    with pytest.raises(LmforgeError, match="not 'gpt2'"):
        to_hf(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()
