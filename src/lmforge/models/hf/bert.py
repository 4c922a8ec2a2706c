"""Adapter for transformers' BertForMaskedLM and RobertaForMaskedLM: our Encoder (models/encoder.py).

The two differ in names (`bert.` + `cls.predictions.` against `roberta.` + `lm_head.`) and in
positions: RoBERTa's start at padding_idx + 1 and count real tokens only, which is our
`position_offset` (= pad_token_id + 1; BERT: 0). A config is exported as RoBERTa exactly when its
position_offset is set. The MLM decoder is tied to the word embeddings and its bias to the head's
`bias`, as transformers ties them; checkpoints that store the tied copies too are read all the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf.keymap import KeyMap, unsupported

MODEL_TYPES = ("bert", "roberta")
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_ARCHITECTURES = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM"}
_CLASSIFIERS = {"bert": "BertForSequenceClassification", "roberta": "RobertaForSequenceClassification"}


def _keys(base: str, head: str) -> KeyMap:
    enc = f"{base}.encoder.layer.{{i}}"
    dense, norm = ("dense", "layer_norm") if base == "roberta" else ("transform.dense", "transform.LayerNorm")
    return KeyMap([  # (ours, HF); {i} is the layer index, {p} weight or bias
        ("tok_embeddings.weight", f"{base}.embeddings.word_embeddings.weight"),
        ("pos_embeddings.weight", f"{base}.embeddings.position_embeddings.weight"),
        ("type_embeddings.weight", f"{base}.embeddings.token_type_embeddings.weight"),
        ("emb_norm.{p}", f"{base}.embeddings.LayerNorm.{{p}}"),
        ("layers.{i}.attn.wq.{p}", f"{enc}.attention.self.query.{{p}}"),
        ("layers.{i}.attn.wk.{p}", f"{enc}.attention.self.key.{{p}}"),
        ("layers.{i}.attn.wv.{p}", f"{enc}.attention.self.value.{{p}}"),
        ("layers.{i}.attn.wo.{p}", f"{enc}.attention.output.dense.{{p}}"),
        ("layers.{i}.attn_norm.{p}", f"{enc}.attention.output.LayerNorm.{{p}}"),
        ("layers.{i}.mlp.w_up.{p}", f"{enc}.intermediate.dense.{{p}}"),
        ("layers.{i}.mlp.w_down.{p}", f"{enc}.output.dense.{{p}}"),
        ("layers.{i}.mlp_norm.{p}", f"{enc}.output.LayerNorm.{{p}}"),
        ("head.dense.{p}", f"{head}.{dense}.{{p}}"),
        ("head.norm.{p}", f"{head}.{norm}.{{p}}"),
        ("head.bias", f"{head}.bias"),
        # a sequence classifier (model.score_head): BERT's pooler + classifier; RoBERTa's classification
        # head is the same computation, tanh(dense(<s>)) then out_proj, under other names
        ("pooler.{p}", "classifier.dense.{p}" if base == "roberta" else f"{base}.pooler.dense.{{p}}"),
        ("score.{p}", "classifier.out_proj.{p}" if base == "roberta" else "classifier.{p}"),
    ])


KEYS = {"bert": _keys("bert", "cls.predictions"), "roberta": _keys("roberta", "lm_head")}
# Tensors a checkpoint may hold that our model has no place for and needs none: the tied copies of
# the decoder, the position-id buffer older transformers saved, and BertForPreTraining's pooler and
# next-sentence head (not part of masked LM).
_SKIPPED = (".predictions.decoder.weight", ".predictions.decoder.bias", "lm_head.decoder.weight",
            "lm_head.decoder.bias", ".embeddings.position_ids", "cls.seq_relationship.weight",
            "cls.seq_relationship.bias")


def _family_of(cfg: ModelConfig) -> str:
    return "roberta" if cfg.position_offset else "bert"


# ---------------------------------------------------------------------------------------- config


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a BERT or RoBERTa config.json dict."""
    kind = hf["model_type"]
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        unsupported("hidden_act", act, ", ".join(_ACTIVATIONS))
    if hf.get("position_embedding_type", "absolute") != "absolute":
        unsupported("position_embedding_type", hf["position_embedding_type"], "absolute")
    for key in ("is_decoder", "add_cross_attention"):
        if hf.get(key):
            unsupported(key, True, "false (a masked-LM encoder)")
    if not hf.get("tie_word_embeddings", True):
        unsupported("tie_word_embeddings", False, "true (the MLM decoder is the word embedding)")
    hidden, attention = (float(hf.get(k, 0.1))
                         for k in ("hidden_dropout_prob", "attention_probs_dropout_prob"))
    d_model, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    offset = 0
    if kind == "roberta":
        pad = hf.get("pad_token_id", 1)
        if not isinstance(pad, int) or pad < 0:
            unsupported("pad_token_id", pad, "an id >= 0 (RoBERTa's positions start after it)")
        offset = pad + 1
    max_pos = int(hf.get("max_position_embeddings", 512))
    if max_pos <= offset:
        unsupported("max_position_embeddings", max_pos, f"more than pad_token_id + 1 = {offset}")
    if d_model % heads:
        unsupported("hidden_size/num_attention_heads", (d_model, heads), "hidden_size divisible by heads")
    return dict(
        arch="encoder",
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=heads,
        d_ff=int(hf["intermediate_size"]),
        max_seq_len=max_pos - offset,
        position_offset=offset,
        type_vocab_size=int(hf.get("type_vocab_size", 2)),
        norm="layernorm",
        norm_placement="post_ln",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        pos_embedding="learned",
        mlp=_ACTIVATIONS[act],
        bias=True,
        tie_embeddings=True,
        dropout=hidden,
        attention_dropout=attention if attention != hidden else None,  # None: one value for both
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """'roberta' for a position offset, else 'bert'; LmforgeError naming the fields that do not fit."""
    kind = _family_of(cfg)
    problems = []
    if requested not in (None, kind):
        problems.append(f"model.position_offset={cfg.position_offset} makes it {kind!r}, not {requested!r}")
    checks = (
        (cfg.arch == "encoder", f"arch={cfg.arch} (needs encoder)"),
        (cfg.norm == "layernorm", f"norm={cfg.norm} (needs layernorm)"),
        (cfg.norm_placement == "post_ln", f"norm_placement={cfg.norm_placement} (BERT is post_ln)"),
        (cfg.mlp in ("gelu", "gelu_tanh"), f"mlp={cfg.mlp} (needs gelu or gelu_tanh)"),
        (cfg.bias, "bias=false (BERT has biases everywhere)"),
        (cfg.resolved_kv_heads == cfg.n_heads, "n_kv_heads != n_heads (no grouped-query attention)"),
        (cfg.resolved_head_dim * cfg.n_heads == cfg.d_model, "head_dim * n_heads != d_model"),
    )
    problems += [msg for ok, msg in checks if not ok]
    if problems:
        raise LmforgeError(f"this model cannot be exported as Hugging Face {kind!r}: " + "; ".join(problems))
    return kind


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """BERT / RoBERTa config.json keys (checked by `model_type_for`)."""
    out = {
        "architectures": [(_CLASSIFIERS if cfg.score_head else _ARCHITECTURES)[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.resolved_d_ff,
        "hidden_act": "gelu_new" if cfg.mlp == "gelu_tanh" else "gelu",
        "max_position_embeddings": cfg.max_seq_len + cfg.position_offset,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.norm_eps,
        "hidden_dropout_prob": cfg.resolved_hidden_dropout,
        "attention_probs_dropout_prob": cfg.resolved_attention_dropout,
        "initializer_range": cfg.init_std,
        "position_embedding_type": "absolute",
        "is_decoder": False,
        "tie_word_embeddings": True,
    }
    if model_type == "roberta":
        out["pad_token_id"] = cfg.position_offset - 1  # transformers derives the positions from it
    if cfg.score_head:
        n = cfg.num_labels
        out.update(num_labels=n, id2label={str(i): f"LABEL_{i}" for i in range(n)},
                   label2id={f"LABEL_{i}": i for i in range(n)})
    return out


def check_config(cfg: ModelConfig) -> None:
    """Refuse what transformers' BERT cannot hold: no token-type table (it always has one)."""
    if cfg.type_vocab_size < 1:
        raise LmforgeError("a BERT / RoBERTa export needs model.type_vocab_size >= 1 (transformers always "
                           "has a token-type table)")


# --------------------------------------------------------------------------------------- weights


def import_names(hf_name: str, cfg: ModelConfig) -> list[str] | None:
    """Our parameter names filled by HF tensor `hf_name`: [] for known non-weights, None if unknown."""
    pooler = ".pooler." in hf_name or hf_name.startswith(("bert.pooler", "pooler"))
    if hf_name.endswith(_SKIPPED) or (pooler and not cfg.score_head):
        return []
    if pooler and cfg.position_offset:  # RoBERTa's classifier reads its own dense layer, never the pooler
        return []
    for keys in KEYS.values():
        name = hf_name
        if not hf_name.startswith(("bert.", "roberta.", "cls.", "lm_head.", "classifier.")):
            name = f"{_family_of(cfg)}.{hf_name}"  # a base-model checkpoint (BertModel) has no prefix
        if (ours := keys.to_ours(name)) is not None:
            return [ours]
    return None


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs for one HF tensor: names change, layouts do not."""
    return [(ours, tensor) for ours in import_names(hf_name, cfg) or []]


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    """The HF name holding our parameter (for messages)."""
    return KEYS[_family_of(cfg)].to_hf(our_name) or our_name


def export_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter (the tied decoder is not written, as transformers does)."""
    check_config(cfg)
    keys = KEYS[_family_of(cfg)]
    for ours, tensor in state.items():
        name = keys.to_hf(ours)
        assert name is not None, f"no HF name for {ours}"
        yield name, tensor
