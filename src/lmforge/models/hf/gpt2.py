"""Adapter for transformers' GPT-2: learned positions, LayerNorm with bias, GELU (tanh) MLP, tied head.

Two layout differences from ours: GPT-2's linear layers are `Conv1D`s whose weights are stored
(in, out), the transpose of nn.Linear's (out, in); and q, k, v come from one fused `c_attn`
projection, split along its output dimension on import and concatenated on export.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf.blockflags import feature_problems
from lmforge.models.hf.keymap import KeyMap, unsupported

MODEL_TYPES = ("gpt2",)

# gelu_new is GPT-2's tanh approximation written out; gelu_pytorch_tanh the same formula fused.
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

KEYS = KeyMap(
    [  # (ours, HF); {i} is the layer index, {p} weight or bias
        ("tok_embeddings.weight", "transformer.wte.weight"),
        ("pos_embeddings.weight", "transformer.wpe.weight"),
        ("norm.{p}", "transformer.ln_f.{p}"),
        ("output.weight", "lm_head.weight"),
        ("layers.{i}.attn_norm.{p}", "transformer.h.{i}.ln_1.{p}"),
        ("layers.{i}.mlp_norm.{p}", "transformer.h.{i}.ln_2.{p}"),
        ("layers.{i}.attn.wo.{p}", "transformer.h.{i}.attn.c_proj.{p}"),
        ("layers.{i}.mlp.w_up.{p}", "transformer.h.{i}.mlp.c_fc.{p}"),
        ("layers.{i}.mlp.w_down.{p}", "transformer.h.{i}.mlp.c_proj.{p}"),
    ]
)
# The fused projection: HF's c_attn.{p} holds our wq, wk, wv.{p} in that order.
FUSED = KeyMap([("layers.{i}.attn.{p}", "transformer.h.{i}.attn.c_attn.{p}")])
_QKV = ("wq", "wk", "wv")
# Conv1D modules: their weights are stored transposed.
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


# ---------------------------------------------------------------------------------------- config


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for a GPT-2 config.json dict."""
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        unsupported("activation_function", act, ", ".join(_ACTIVATIONS))
    for key, bad in (
        ("scale_attn_by_inverse_layer_idx", True),
        ("reorder_and_upcast_attn", True),
        ("add_cross_attention", True),
        ("scale_attn_weights", False),
    ):
        if bool(hf.get(key, not bad)) == bad:
            unsupported(key, bad, str(not bad).lower())
    drops = {k: float(hf.get(k, 0.1)) for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop")}
    if drops["resid_pdrop"] != drops["embd_pdrop"]:
        # model.hidden_dropout acts on both the residual branches and the embeddings.
        unsupported("resid_pdrop/embd_pdrop", drops, "one value for both (model.hidden_dropout)")
    d_model = int(hf["n_embd"])
    return dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_layers=int(hf["n_layer"]),
        n_heads=int(hf["n_head"]),
        d_ff=int(hf.get("n_inner") or 4 * d_model),
        max_seq_len=int(hf.get("n_positions", hf.get("n_ctx", 1024))),
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        pos_embedding="learned",
        mlp=_ACTIVATIONS[act],
        bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dropout=drops["resid_pdrop"],
        attention_dropout=drops["attn_pdrop"] if drops["attn_pdrop"] != drops["resid_pdrop"] else None,
    )


def model_type_for(cfg: ModelConfig, requested: str | None = None) -> str:
    """'gpt2' when `cfg` is expressible as GPT-2; LmforgeError naming the fields otherwise."""
    problems = []
    if requested not in (None, "gpt2"):
        problems.append(f"learned positions exist only in gpt2, not {requested!r}")
    checks = (
        (cfg.norm == "layernorm", f"norm={cfg.norm} (needs layernorm)"),
        (cfg.mlp in ("gelu", "gelu_tanh"), f"mlp={cfg.mlp} (needs gelu or gelu_tanh)"),
        (cfg.bias, "bias=false (GPT-2 has biases everywhere)"),
        (cfg.resolved_kv_heads == cfg.n_heads, "n_kv_heads != n_heads (GPT-2 has no grouped-query attn)"),
        (cfg.resolved_head_dim * cfg.n_heads == cfg.d_model, "head_dim * n_heads != d_model"),
        (cfg.sliding_window is None, "sliding_window is set"),
        (cfg.rope_scaling is None, "rope_scaling is set"),
    )
    problems += [msg for ok, msg in checks if not ok]
    problems += feature_problems(cfg)  # norm placement, Gemma's features: not in GPT-2
    if problems:
        raise LmforgeError("this model cannot be exported as Hugging Face 'gpt2': " + "; ".join(problems))
    return "gpt2"


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """GPT-2 config.json keys (checked by `model_type_for`)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.resolved_d_ff,
        "n_positions": cfg.max_seq_len,
        "activation_function": "gelu_new" if cfg.mlp == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": cfg.norm_eps,
        "attn_pdrop": cfg.resolved_attention_dropout,
        "resid_pdrop": cfg.resolved_hidden_dropout,
        "embd_pdrop": cfg.resolved_hidden_dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


# --------------------------------------------------------------------------------------- weights


def _canonical(hf_name: str) -> str:
    # Base-model checkpoints (GPT2Model, e.g. the original "gpt2") have no "transformer." prefix.
    if hf_name.startswith(("transformer.", "lm_head.")):
        return hf_name
    return "transformer." + hf_name


def import_names(hf_name: str, cfg: ModelConfig) -> list[str] | None:
    """Our parameter names filled by HF tensor `hf_name`: [] for known non-weights, None if unknown."""
    name = _canonical(hf_name)
    if name.endswith((".attn.bias", ".attn.masked_bias")):
        return []  # causal-mask buffers that older transformers saved with the weights
    if name == "lm_head.weight" and cfg.tie_embeddings:
        return []  # transformers also drops it in favour of the embedding when weights are tied
    fused = FUSED.to_ours(name)
    if fused is not None:
        prefix, _, kind = fused.rpartition(".")  # layers.{i}.attn, weight|bias
        return [f"{prefix}.{part}.{kind}" for part in _QKV]
    ours = KEYS.to_ours(name)
    return None if ours is None else [ours]


def import_tensor(hf_name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs for one HF tensor: Conv1D weights transposed, c_attn split in three."""
    names = import_names(hf_name, cfg) or []
    if hf_name.endswith(_CONV1D):
        tensor = tensor.t()  # (in, out) -> (out, in)
    if len(names) == 3:
        return list(zip(names, tensor.split(cfg.d_model, dim=0)))
    return [(ours, tensor) for ours in names]


def hf_name(our_name: str, cfg: ModelConfig) -> str:
    """The HF name holding our parameter (for messages)."""
    prefix, _, kind = our_name.rpartition(".")
    for part in _QKV:
        if prefix.endswith(f".attn.{part}"):
            return FUSED.to_hf(f"{prefix.rsplit('.', 1)[0]}.{kind}") or our_name
    return KEYS.to_hf(our_name) or our_name


def export_tensors(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter; q/k/v fused into c_attn, Conv1D weights transposed."""
    for ours, tensor in state.items():
        prefix, _, kind = ours.rpartition(".")
        part = prefix.rsplit(".", 1)[-1]
        if part in ("wk", "wv"):
            continue  # written with wq
        if part == "wq":
            attn = prefix.rsplit(".", 1)[0]
            tensor = torch.cat([state[f"{attn}.{p}.{kind}"] for p in _QKV], dim=0)  # (3 d, d) or (3 d,)
            name = FUSED.to_hf(f"{attn}.{kind}")
        else:
            name = KEYS.to_hf(ours)
        assert name is not None, f"no HF name for {ours}"
        if name.endswith(_CONV1D):
            tensor = tensor.t()  # (out, in) -> Conv1D's (in, out)
        yield name, tensor
