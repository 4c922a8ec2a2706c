"""LoRA / DoRA adapters in Hugging Face PEFT's file format: `adapter_config.json` and
`adapter_model.safetensors`, as `PeftModel.save_pretrained` writes and `PeftModel.from_pretrained` reads.

Tensor names are PEFT's: `base_model.model.` + the Hugging Face module name + `.lora_A.weight`,
`.lora_B.weight` and, with DoRA, `.lora_magnitude_vector`. The Llama-style layouts (Llama, Mistral,
Qwen2, Qwen3, Granite, SmolLM3, the MoE families' attention, OLMo 2, Gemma 2 / 3: any model `to_hf`
writes with these module names), T5's (both stacks, `SelfAttention.q`, `EncDecAttention.q`,
`DenseReluDense.wi`: task_type SEQ_2_SEQ_LM) and DeepSeek-V3's (model.mla): their projections are
separate linear layers named one-to-one with ours, and our RoPE uses their convention (halves, or
DeepSeek's interleaved pairs), so q/k rows (and hence B's rows) map without any permutation. Routers and
stacked routed experts are no linear layers in transformers: adapters on them have no PEFT form and are
refused. Phi-3's fused qkv_proj / gate_up_proj get the exact block-diagonal union of our adapters
(peft_fused.py), and a fused module's adapter loads as adapters on each of its parts. GPT-2's fused
Conv1D `c_attn` has no per-q/k/v adapter, so it is refused.

Files from elsewhere are untrusted: the config is checked key by key and tensors are read with
safetensors (never pickle) and checked against the model before the model is touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.finetune.lora import ALL_LINEAR, adapter_settings, linear_names, lora_layers, wrap_layers
from lmforge.finetune.peft_fused import LAYOUT_KEY, fused_adapter, fused_pattern, read_layout, unfuse
from lmforge.models.hf import deepseek, llama, phi3, t5
from lmforge.models.hf.convert import export_model_type
from lmforge.models.hf.keymap import KeyMap
from lmforge.utils.io import atomic_write_bytes, atomic_write_json, read_json_object
from lmforge.utils.safe_regex import compile_regex

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# Our adapter parameter -> PEFT's tensor suffix.
SUFFIXES = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight", "lora_magnitude": "lora_magnitude_vector"}

# adapter_config.json keys that must be off (null, false, empty) for the adapter to mean what we compute.
_MUST_BE_OFF = (
    "modules_to_save", "layers_to_transform", "layers_pattern",
    "exclude_modules", "layer_replication", "lora_bias", "use_qalora", "target_parameters",
    "trainable_token_indices", "megatron_config", "alora_invocation_tokens", "arrow_config",
    "use_bdlora", "kasa_config", "monteclora_config", "velora_config", "fan_in_fan_out",
)
# Keys that describe the file or only matter while PEFT initialises a new adapter.
_IGNORED = (
    "peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora",
    "bias", "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights", "auto_mapping",
    "peft_version", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "megatron_core",
    "qalora_group_size", "ensure_weight_tying",
)


def _check_layout(cfg: ModelConfig) -> None:
    if cfg.pos_embedding == "learned":
        raise LmforgeError(
            "PEFT adapter files cover the Llama / Mistral / Qwen2 layouts (separate q/k/v projections); "
            "this model has GPT-2's layout, whose fused Conv1D c_attn cannot hold our per-q/k/v adapters. "
            "Save the adapters with adapter_state_dict, or merge_lora and export the full model"
        )
    if cfg.mla is not None:
        deepseek.model_type_for(cfg)  # multi-head latent attention: DeepSeek-V3's layout
        return
    if phi3.is_default_for(cfg):  # exported as Phi-3: fused qkv_proj / gate_up_proj (peft_fused.py)
        phi3.model_type_for(cfg)
        return
    export_model_type(cfg)  # a clear LmforgeError for a layout no Hugging Face family here writes


def _keys(cfg: ModelConfig) -> KeyMap:
    """Our names -> transformers' for the model's layout (MLA has projections of its own; T5 names both
    stacks' modules as T5ForConditionalGeneration does: `encoder.block.0.layer.0.SelfAttention.q`)."""
    if cfg.arch == "t5":
        return t5.KEYS[cfg.mlp == "geglu"]
    return deepseek.KEYS if cfg.mla is not None else llama.KEYS


def _hf_module(our_module: str, cfg: ModelConfig) -> str:
    if cfg.mla is not None:
        return deepseek.adapter_module(our_module)
    hf = _keys(cfg).to_hf(our_module + ".weight")
    if hf is None:
        raise LmforgeError(f"{our_module} has no Hugging Face name, so its adapter has no PEFT name")
    return hf.removesuffix(".weight")


def _has_peft_name(our_module: str, model: nn.Module) -> bool:
    try:
        _hf_module(our_module, model.cfg)
    except LmforgeError:
        return False
    return True


def _target_modules(model: nn.Module, wrapped: list[str]) -> list[str]:
    """PEFT target_modules naming exactly the wrapped layers: leaf names ("q_proj") where every layer
    of that kind is wrapped, full module names otherwise (PEFT matches both as name suffixes)."""
    # Layers that are not wrapped and have no PEFT name (a router) cannot be confused with wrapped ones.
    all_hf = [_hf_module(n, model.cfg) for n in linear_names(model)
              if n in wrapped or _has_peft_name(n, model)]
    wrapped_hf = [_hf_module(n, model.cfg) for n in wrapped]
    out: list[str] = []
    for leaf in dict.fromkeys(h.rpartition(".")[2] for h in wrapped_hf):  # in module order
        kind = [h for h in all_hf if h.rpartition(".")[2] == leaf]
        out += [leaf] if all(h in wrapped_hf for h in kind) else sorted(h for h in kind if h in wrapped_hf)
    return out


def save_peft_adapter(
    model: nn.Module, out_dir: str | os.PathLike, base_model_name_or_path: str | None, model_cfg: ModelConfig
) -> Path:
    """Write the model's adapters as a PEFT adapter dir (`PeftModel.from_pretrained` loads it onto the
    Hugging Face export of the base model); returns the directory. Each file is written beside and
    renamed into place."""
    _check_layout(model_cfg)
    settings = adapter_settings(model)
    layers = lora_layers(model)
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        if layer.merged:
            raise LmforgeError(f"{name} is merged into its base weight; unmerge_lora(model) before saving")
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    metadata = {"format": "pt"}
    if phi3.is_default_for(model_cfg):
        fused, targets, ranks, alphas, layout = fused_adapter(model, layers, model_cfg, settings)
        tensors = {PREFIX + k: v for k, v in fused.items()}
        if layout:
            metadata[LAYOUT_KEY] = json.dumps(layout)
    else:
        targets = _target_modules(model, list(layers))
        for name, layer in layers.items():
            prefix = PREFIX + _hf_module(name, model_cfg) + "."
            for pname, p in layer.named_parameters(recurse=False):
                tensors[prefix + SUFFIXES[pname]] = p.detach().to("cpu").contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_2_SEQ_LM" if model_cfg.arch == "t5" else "CAUSAL_LM",
        "r": settings["r"],
        "lora_alpha": settings["alpha"],
        "lora_dropout": settings["dropout"],
        "target_modules": targets,
        "use_rslora": settings["rslora"],
        "use_dora": settings["dora"],
        "bias": "none",
        "lora_bias": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": ranks,  # only where fused modules hold several of our adapters
        "alpha_pattern": alphas,
    }
    from safetensors.torch import save

    out = Path(out_dir)
    atomic_write_bytes(out / WEIGHTS, save(tensors, metadata=metadata))
    atomic_write_json(out / CONFIG, config)
    return out


# ---------------------------------------------------------------------------------------- loading


def read_adapter_config(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    """adapter_config.json as the settings `apply_lora` takes, after checking every key we rely on."""
    file = Path(adapter_dir) / CONFIG
    if not file.is_file():
        raise LmforgeError(f"{adapter_dir} is not a PEFT adapter directory: it has no {CONFIG}")
    cfg = read_json_object(file, "an adapter config")

    def bad(key: str, why: str) -> LmforgeError:
        return LmforgeError(f"{file}: {key}={cfg.get(key)!r} {why}")

    if cfg.get("peft_type") != "LORA":
        raise bad("peft_type", "is not supported; lmforge reads LORA adapters (LoRA, rsLoRA, DoRA)")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in cfg:
            raise LmforgeError(f"{file} has no {key!r}, which a LoRA adapter config needs")
    r, alpha, dropout = cfg["r"], cfg["lora_alpha"], cfg.get("lora_dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise bad("r", "must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise bad("lora_alpha", "must be a number")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise bad("lora_dropout", "must be a number in [0, 1)")
    targets = cfg["target_modules"]
    is_list = isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    if not (isinstance(targets, str) or is_list):
        raise bad("target_modules", "must be a list of module names or one regular expression")
    for key in ("use_rslora", "use_dora"):
        if not isinstance(cfg.get(key, False), bool):
            raise bad(key, "must be true or false")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", "is not supported; lmforge's adapters train no biases (bias must be 'none')")
    for key in _MUST_BE_OFF:
        if cfg.get(key):
            raise bad(key, "is not supported by lmforge's LoRA (it must be null, false or empty)")
    # Per-module ranks only as lmforge writes them for fused modules (Phi-3), recorded in the file.
    layout = read_layout(Path(adapter_dir) / WEIGHTS)
    want = fused_pattern(layout, r, float(alpha), bool(cfg.get("use_rslora", False)))
    for key in ("rank_pattern", "alpha_pattern"):
        if (cfg.get(key) or {}) != want[key]:
            raise bad(key, "is not supported by lmforge's LoRA (it must be null, false or empty, or the "
                      "fused-module ranks lmforge writes for Phi-3)")
    unknown = sorted(k for k, v in cfg.items() if v and k not in _IGNORED and k not in _MUST_BE_OFF
                     and k not in ("rank_pattern", "alpha_pattern"))
    if unknown:
        raise LmforgeError(
            f"{file}: unknown option(s) {', '.join(f'{k}={cfg[k]!r}' for k in unknown)}; lmforge cannot tell "
            "whether the adapter means what it computes, so it refuses to load it"
        )
    return {
        "r": r, "alpha": float(alpha), "dropout": float(dropout), "targets": targets,
        "rslora": cfg.get("use_rslora", False), "dora": cfg.get("use_dora", False), "fused": layout,
    }


def _peft_matches(hf_module: str, targets: str | list[str]) -> bool:
    """PEFT's rule: a string is a regular expression over the whole name, or "all-linear" (every
    linear layer but the output head); a list matches a name equal to, or ending in "." + an entry."""
    if targets == ALL_LINEAR:
        return hf_module != "lm_head"
    if isinstance(targets, str):  # from the adapter's config file: under the regex time budget
        return compile_regex(targets, "adapter_config.json target_modules").fullmatch(hf_module) is not None
    return any(hf_module == t or hf_module.endswith("." + t) for t in targets)


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not file.is_file():
        raise LmforgeError(f"{file.parent} is not a PEFT adapter directory: it has no {WEIGHTS}")
    try:
        return load_file(str(file))
    except Exception as e:  # SafetensorError, OSError, and what a broken header makes the reader raise
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LmforgeError(f"{file} is not a readable safetensors file: {reason}") from None


def load_peft_adapter(model: nn.Module, adapter_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32
                      ) -> list[str]:
    """Add the adapters of a PEFT adapter dir to a materialised lmforge Transformer (adapter tensors in
    `dtype`), freezing the rest as `apply_lora` does; returns the wrapped module names.

    Everything is checked (config keys, tensor names and shapes) before the model is changed. Base
    weights that PEFT stores beside the adapters (it does so for `lm_head` and embeddings) are loaded too.
    """
    _check_layout(model.cfg)
    settings = read_adapter_config(adapter_dir)
    file = Path(adapter_dir) / WEIGHTS
    # Phi-3: one adapter on a fused module (qkv_proj) is, exactly, adapters on each of its parts sharing
    # its A, each with its rows of B (and of DoRA's magnitudes, which are per row).
    fused = phi3.is_default_for(model.cfg)
    hf_names = {n: (fused and phi3.fused_module(n)) or _hf_module(n, model.cfg)
                for n in linear_names(model) if _has_peft_name(n, model)}
    tensors = _read_tensors(file)
    if settings["fused"]:  # lmforge's own Phi-3 file: back to the per-layer adapters it was made of
        if not fused:
            raise LmforgeError(f"{file} holds adapters of Phi-3's fused modules; this model has the Llama "
                               "layout")
        split = unfuse(tensors, settings["fused"], settings["r"], model.cfg, PREFIX, file)
        parts = {p for hf in settings["fused"] for p in hf_names if hf_names[p] == hf}
        hf_names.update(split)
    else:
        split, parts = {}, set()
    wrapped = [n for n, h in hf_names.items()
               if n in split or (n not in parts and _peft_matches(h, settings["targets"]))]
    if not wrapped:
        kinds = ", ".join(dict.fromkeys(h.rpartition(".")[2] for h in hf_names.values()))
        raise LmforgeError(
            f"{Path(adapter_dir) / CONFIG}: target_modules={settings['targets']!r} matches none of the "
            f"model's linear layers ({kinds})"
        )
    r, params = settings["r"], dict(model.named_parameters())
    # PEFT key -> ([(our name, its rows of the tensor or None: all)], the tensor's shape)
    expected: dict[str, tuple[list[tuple[str, slice | None]], tuple[int, ...]]] = {}
    for name in wrapped:
        base = model.get_submodule(name)
        fused_rows = fused and name not in split and phi3.fused_rows(name, model.cfg)
        rows, out = fused_rows or (None, base.out_features)
        shapes = {"lora_A": (r, base.in_features), "lora_B": (out, r)}
        if settings["dora"]:
            shapes["lora_magnitude"] = (out,)
        for pname, shape in shapes.items():
            key = PREFIX + hf_names[name] + "." + SUFFIXES[pname]
            cut = None if pname == "lora_A" else rows
            expected.setdefault(key, ([], shape))[0].append((f"{name}.{pname}", cut))
    base_weights: dict[str, tuple[list[tuple[str, slice | None]], tuple[int, ...]]] = {}
    for key in tensors:
        if key in expected:
            continue
        # A base weight saved with the adapter: `...lm_head.base_layer.weight` or `...embed_tokens.weight`.
        ours = _keys(model.cfg).to_ours(key.removeprefix(PREFIX).replace(".base_layer.", "."))
        if not key.startswith(PREFIX) or ours is None:
            raise LmforgeError(
                f"{file}: tensor {key!r} is no adapter of the layers target_modules names "
                f"({settings['targets']!r}) and no base weight of this model"
            )
        if ours not in params:
            raise LmforgeError(f"{file}: tensor {key!r} would load into {ours!r}, which this model has not")
        module, _, leaf = ours.rpartition(".")
        after = f"{module}.base.{leaf}" if module in wrapped else ours  # its name once wrapped
        base_weights[key] = ([(after, None)], tuple(params[ours].shape))
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise LmforgeError(
            f"{file} lacks {len(missing)} adapter tensor(s) its config promises, e.g. {missing[0]!r}"
        )
    for key, (_, shape) in {**expected, **base_weights}.items():
        if tuple(tensors[key].shape) != shape:
            raise LmforgeError(
                f"{file}: tensor {key!r} has shape {tuple(tensors[key].shape)}, but the model needs {shape} "
                f"(r={r}); the adapter was made for a model of another size"
            )
    wrap_layers(model, wrapped, r=r, alpha=settings["alpha"], dropout=settings["dropout"],
                rslora=settings["rslora"], dora=settings["dora"], dtype=dtype, init=None)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, (targets, _) in {**expected, **base_weights}.items():
            for ours, rows in targets:
                params[ours].copy_(tensors[key] if rows is None else tensors[key][rows])
    return wrapped
