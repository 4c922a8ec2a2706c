"""Adapter for transformers' T5ForConditionalGeneration: our T5 (models/t5.py), T5 1.0 and v1.1 / Flan-T5.

feed_forward_proj relu is T5 1.0's feed-forward (wi, wo), gated-gelu v1.1's (wi_0 through GELU's tanh
approximation times wi_1, then wo). The head: T5 1.0 ties lm_head to `shared` and rescales the decoder
output by d_model**-0.5; v1.1 stores its own lm_head and does not rescale (config tie_word_embeddings
false). transformers 5 always ties the config and records the rescale as scale_decoder_outputs, which wins
when present; a checkpoint that stores a tied copy (lm_head, the stacks' embed_tokens) is read all the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf.keymap import KeyMap, unsupported

MODEL_TYPES = ("t5",)
_FF = {"relu": "relu", "gated-gelu": "geglu"}


def _stack(side: str, cross: bool, gated: bool) -> list[tuple[str, str]]:
    blk, ours = f"{side}.block.{{i}}.layer", f"{side}.layers.{{i}}"
    ff = 2 if cross else 1
    pairs = [(f"{ours}.attn.{w}.weight", f"{blk}.0.SelfAttention.{h}.weight") for w, h in
             (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))]
    pairs += [(f"{ours}.attn_norm.weight", f"{blk}.0.layer_norm.weight"),
              (f"{ours}.mlp_norm.weight", f"{blk}.{ff}.layer_norm.weight"),
              (f"{ours}.mlp.w_down.weight", f"{blk}.{ff}.DenseReluDense.wo.weight")]
    if gated:
        pairs += [(f"{ours}.mlp.w_gate.weight", f"{blk}.{ff}.DenseReluDense.wi_0.weight"),
                  (f"{ours}.mlp.w_up.weight", f"{blk}.{ff}.DenseReluDense.wi_1.weight")]
    else:
        pairs += [(f"{ours}.mlp.w_up.weight", f"{blk}.{ff}.DenseReluDense.wi.weight")]
    if cross:
        pairs += [(f"{ours}.cross.{w}.weight", f"{blk}.1.EncDecAttention.{h}.weight") for w, h in
                  (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))]
        pairs += [(f"{ours}.cross_norm.weight", f"{blk}.1.layer_norm.weight")]
    bias = f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    norm = f"{side}.final_layer_norm.weight"
    return pairs + [(f"{side}.rel_bias.weight", bias), (f"{side}.norm.weight", norm)]


def _keys(gated: bool) -> KeyMap:
    return KeyMap([("tok_embeddings.weight", "shared.weight"), ("output.weight", "lm_head.weight"),
                   *_stack("encoder", False, gated), *_stack("decoder", True, gated)])


KEYS = {False: _keys(False), True: _keys(True)}
# Copies a checkpoint may hold that our model reads from elsewhere: the stacks' tied embeddings, and the
# cross-attention bias old transformers created in the decoder's first block and never used.
_SKIPPED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
            "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")


# ---------------------------------------------------------------------------------------- config


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a T5 config.json dict."""
    ff = hf.get("feed_forward_proj", "relu")
    if ff not in _FF:
        unsupported("feed_forward_proj", ff, ", ".join(_FF))
    for key in ("is_decoder",):
        if hf.get(key):
            unsupported(key, True, "false (an encoder-decoder)")
    if hf.get("is_encoder_decoder", True) is not True:
        unsupported("is_encoder_decoder", hf["is_encoder_decoder"], "true")
    tie = hf.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        unsupported("tie_word_embeddings", tie, "true or false")
    scale = hf.get("scale_decoder_outputs", tie)  # transformers 5 writes it; before, the tie decided
    if not isinstance(scale, bool):
        unsupported("scale_decoder_outputs", scale, "true or false")
    start = hf.get("decoder_start_token_id")
    start = hf.get("pad_token_id", 0) if start is None else start  # T5 starts from its padding id
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        unsupported("decoder_start_token_id", start, "a token id >= 0")
    layers = int(hf["num_layers"])
    dec = hf.get("num_decoder_layers")
    return dict(
        arch="t5",
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["d_model"]),
        n_layers=layers,
        n_decoder_layers=None if dec is None or int(dec) == layers else int(dec),
        n_heads=int(hf["num_heads"]),
        head_dim=int(hf["d_kv"]),
        d_ff=int(hf["d_ff"]),
        max_seq_len=int(hf.get("n_positions") or 512),
        relative_attention_num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(hf.get("relative_attention_max_distance", 128)),
        norm="rmsnorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
        pos_embedding="relative",
        mlp=_FF[ff],
        tie_embeddings=tie,
        scale_decoder_output=None if scale == tie else scale,
        decoder_start_token_id=start,
        dropout=float(hf.get("dropout_rate", 0.1)),
    )


def fit_to_files(kwargs: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The head as the weights have it: a stored lm_head is the model's own (transformers 5 writes
    tie_word_embeddings true for every T5 and unties on load a lm_head it finds), the rescale staying as
    the config says."""
    if kwargs["tie_embeddings"] and "lm_head.weight" in names:
        scale = kwargs["scale_decoder_output"]
        kwargs = {**kwargs, "tie_embeddings": False, "scale_decoder_output": True if scale is None else scale}
        if not kwargs["scale_decoder_output"]:
            kwargs["scale_decoder_output"] = None  # untied and unscaled: v1.1's default
    return kwargs


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """'t5' for model.arch=t5; LmforgeError otherwise."""
    if cfg.arch != "t5" or requested not in (None, "t5"):
        raise LmforgeError(f"this model cannot be exported as Hugging Face {requested or 't5'!r}: "
                           f"model.arch={cfg.arch} (t5 needs arch=t5, and arch=t5 exports as t5 only)")
    return "t5"


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """T5 config.json keys (checked by `model_type_for`)."""
    scale = cfg.tie_embeddings if cfg.scale_decoder_output is None else cfg.scale_decoder_output
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.resolved_head_dim,
        "d_ff": cfg.resolved_d_ff,
        "num_layers": cfg.n_layers,
        "num_decoder_layers": cfg.n_decoder_layers or cfg.n_layers,
        "num_heads": cfg.n_heads,
        "n_positions": cfg.max_seq_len,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "dropout_rate": cfg.dropout,
        "layer_norm_epsilon": cfg.norm_eps,
        "initializer_factor": 1.0,
        "feed_forward_proj": "gated-gelu" if cfg.mlp == "geglu" else "relu",
        "is_encoder_decoder": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_decoder_outputs": scale,
        "decoder_start_token_id": cfg.decoder_start_token_id,
        "pad_token_id": cfg.decoder_start_token_id,  # T5 starts the decoder from its padding id
    }


# --------------------------------------------------------------------------------------- weights


def import_names(hf_name: str, cfg: ModelConfig) -> list[str] | None:
    """Our parameter names filled by HF tensor `hf_name`: [] for known copies, None if unknown."""
    if hf_name in _SKIPPED or (hf_name == "lm_head.weight" and cfg.tie_embeddings):
        return []
    ours = KEYS[cfg.mlp == "geglu"].to_ours(hf_name)
    return None if ours is None else [ours]


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs for one HF tensor: names change, layouts do not."""
    return [(ours, tensor) for ours in import_names(hf_name, cfg) or []]


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    """The HF name holding our parameter (for messages)."""
    return KEYS[cfg.mlp == "geglu"].to_hf(our_name) or our_name


def export_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter; a tied head is `shared` (transformers ties lm_head to it)."""
    keys = KEYS[cfg.mlp == "geglu"]
    for ours, tensor in state.items():
        name = keys.to_hf(ours)
        assert name is not None, f"no HF name for {ours}"
        yield name, tensor
