"""LoRA / DoRA adapters in Hugging Face PEFT's file format: `adapter_config.json` and
`adapter_model.safetensors`, as `PeftModel.save_pretrained` writes and `PeftModel.from_pretrained` reads.

Tensor names are PEFT's: `base_model.model.` + the Hugging Face module name + `.lora_A.weight`,
`.lora_B.weight` and, with DoRA, `.lora_magnitude_vector`. The Llama-style layouts are covered (Llama,
Mistral, Qwen2, the MoE families, OLMo 2, Gemma 2 / 3: any model `to_hf` writes with these module names):
their q/k/v/o and MLP projections are separate linear layers named one-to-one with ours, and
our RoPE uses the same "rotate_half" convention, so q/k rows (and hence B's rows) map without any
permutation. GPT-2's fused Conv1D `c_attn` has no per-q/k/v adapter, so it is refused.

Files from elsewhere are untrusted: the config is checked key by key and tensors are read with
safetensors (never pickle) and checked against the model before the model is touched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.finetune.lora import ALL_LINEAR, adapter_settings, linear_names, lora_layers, wrap_layers
from lmforge.models.hf import llama
from lmforge.models.hf.convert import export_model_type
from lmforge.utils.io import atomic_write_bytes, atomic_write_json, read_json_object
from lmforge.utils.safe_regex import compile_regex

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# Our adapter parameter -> PEFT's tensor suffix.
SUFFIXES = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight", "lora_magnitude": "lora_magnitude_vector"}

# adapter_config.json keys that must be off (null, false, empty) for the adapter to mean what we compute.
_MUST_BE_OFF = (
    "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform", "layers_pattern",
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
    export_model_type(cfg)  # a clear LmforgeError for a layout no Hugging Face family here writes


def _hf_module(our_module: str) -> str:
    hf = llama.KEYS.to_hf(our_module + ".weight")
    if hf is None:
        raise LmforgeError(f"{our_module} has no Hugging Face name, so its adapter has no PEFT name")
    return hf.removesuffix(".weight")


def _named_linears(model: nn.Module) -> dict[str, str]:
    """{our linear layer: its HF module name} for the layers adapters can have in PEFT's files. A mixture of
    experts' router has no name in the Llama layout (each MoE family names it differently): it is left out,
    and an adapter on it is refused by name when saving."""
    names = {n: llama.KEYS.to_hf(n + ".weight") for n in linear_names(model)}
    return {n: h.removesuffix(".weight") for n, h in names.items() if h is not None}


def _target_modules(model: nn.Module, wrapped: list[str]) -> list[str]:
    """PEFT target_modules naming exactly the wrapped layers: leaf names ("q_proj") where every layer
    of that kind is wrapped, full module names otherwise (PEFT matches both as name suffixes)."""
    all_hf = list(_named_linears(model).values())
    wrapped_hf = [_hf_module(n) for n in wrapped]
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
        prefix = PREFIX + _hf_module(name) + "."
        for pname, p in layer.named_parameters(recurse=False):
            tensors[prefix + SUFFIXES[pname]] = p.detach().to("cpu").contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings["r"],
        "lora_alpha": settings["alpha"],
        "lora_dropout": settings["dropout"],
        "target_modules": _target_modules(model, list(layers)),
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
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    from safetensors.torch import save

    out = Path(out_dir)
    atomic_write_bytes(out / WEIGHTS, save(tensors, metadata={"format": "pt"}))
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
    unknown = sorted(k for k, v in cfg.items() if v and k not in _IGNORED and k not in _MUST_BE_OFF)
    if unknown:
        raise LmforgeError(
            f"{file}: unknown option(s) {', '.join(f'{k}={cfg[k]!r}' for k in unknown)}; lmforge cannot tell "
            "whether the adapter means what it computes, so it refuses to load it"
        )
    return {
        "r": r, "alpha": float(alpha), "dropout": float(dropout), "targets": targets,
        "rslora": cfg.get("use_rslora", False), "dora": cfg.get("use_dora", False),
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
    hf_names = _named_linears(model)
    wrapped = [n for n, h in hf_names.items() if _peft_matches(h, settings["targets"])]
    if not wrapped:
        kinds = ", ".join(dict.fromkeys(h.rpartition(".")[2] for h in hf_names.values()))
        raise LmforgeError(
            f"{Path(adapter_dir) / CONFIG}: target_modules={settings['targets']!r} matches none of the "
            f"model's linear layers ({kinds})"
        )
    tensors = _read_tensors(file)
    r, params = settings["r"], dict(model.named_parameters())
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}  # PEFT key -> (our name, shape)
    for name in wrapped:
        base = model.get_submodule(name)
        shapes = {"lora_A": (r, base.in_features), "lora_B": (base.out_features, r)}
        if settings["dora"]:
            shapes["lora_magnitude"] = (base.out_features,)
        for pname, shape in shapes.items():
            expected[PREFIX + hf_names[name] + "." + SUFFIXES[pname]] = (f"{name}.{pname}", shape)
    base_weights: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key in tensors:
        if key in expected:
            continue
        # A base weight saved with the adapter: `...lm_head.base_layer.weight` or `...embed_tokens.weight`.
        ours = llama.KEYS.to_ours(key.removeprefix(PREFIX).replace(".base_layer.", "."))
        if not key.startswith(PREFIX) or ours is None:
            raise LmforgeError(
                f"{file}: tensor {key!r} is no adapter of the layers target_modules names "
                f"({settings['targets']!r}) and no base weight of this model"
            )
        if ours not in params:
            raise LmforgeError(f"{file}: tensor {key!r} would load into {ours!r}, which this model has not")
        module, _, leaf = ours.rpartition(".")
        after = f"{module}.base.{leaf}" if module in wrapped else ours  # its name once wrapped
        base_weights[key] = (after, tuple(params[ours].shape))
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
        for key, (ours, _) in {**expected, **base_weights}.items():
            params[ours].copy_(tensors[key])
    return wrapped
