"""PEFT adapters for checkpoints whose Hugging Face modules fuse several of our linear layers: Phi-3's
`qkv_proj` (our wq | wk | wv, by rows) and `gate_up_proj` (w_gate | w_up).

Our adapters are per projection: part i adds s * B_i A_i to its rows. One LoRA on the fused module
expresses that exactly when it is their block-diagonal union: A = [A_1; ...; A_n] (the wrapped parts'
A's stacked, rank n*r) and B holding B_i in part i's rows and block i's columns, zeros elsewhere (so a
part without an adapter gets no update). PEFT scales by alpha / rank (rsLoRA: alpha / sqrt(rank)), so the
fused module gets rank n*r and alpha n*alpha (rsLoRA: sqrt(n)*alpha), written as its rank_pattern /
alpha_pattern entries. DoRA normalises each output row of W + s*BA, and the rows of the fused module are
the rows of its parts, so it is exact too, with the magnitudes concatenated, when every part of the
module has an adapter; otherwise the parts without one would need a magnitude equal to their weight's
row norms, which reproduces W only up to rounding: refused.

The file records which of our layers each fused adapter holds (safetensors metadata `lmforge_fused`;
PEFT ignores it), so that lmforge reads its own file back as the per-projection adapters it wrote
(`unfuse`): rank r each, after checking that B is exactly block-diagonal.
"""

from __future__ import annotations

import json
import math
import re

import torch
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import llama, phi3

LAYOUT_KEY = "lmforge_fused"  # safetensors metadata: {HF fused module: [our layers in its adapter]}


def fused_adapter(
    model: nn.Module, layers: dict[str, nn.Module], cfg: ModelConfig, settings: dict
) -> tuple[dict[str, torch.Tensor], list[str], dict[str, int], dict[str, float], dict[str, list[str]]]:
    """(PEFT tensors without the `base_model.model.` prefix, target_modules, rank_pattern, alpha_pattern,
    layout {fused HF module: our layers in its adapter}) for the adapters `layers` (our module name ->
    LoRALinear) of a Phi-3 layout model."""
    r, alpha = settings["r"], settings["alpha"]
    groups: dict[str, list[str]] = {}  # HF module -> our wrapped modules, in row order
    tensors: dict[str, torch.Tensor] = {}
    for name in layers:
        fused = phi3.fused_module(name)
        if fused is None:
            hf = llama.KEYS.to_hf(name + ".weight")
            if hf is None:
                raise LmforgeError(f"{name} has no Hugging Face name, so its adapter has no PEFT name")
            hf = hf.removesuffix(".weight")
            layer = layers[name]
            tensors[hf + ".lora_A.weight"] = layer.lora_A.detach()
            tensors[hf + ".lora_B.weight"] = layer.lora_B.detach()
            if settings["dora"]:
                tensors[hf + ".lora_magnitude_vector"] = layer.lora_magnitude.detach()
            groups[hf] = [name]
        else:
            groups.setdefault(fused, []).append(name)
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    layout: dict[str, list[str]] = {}
    for hf, wrapped in groups.items():
        if phi3.fused_module(wrapped[0]) is None:
            continue
        layout[hf] = list(wrapped)
        layer_prefix = wrapped[0].rsplit(".", 2)[0]  # layers.{i}
        parts = [f"{layer_prefix}.{p}" for p in phi3.FUSED[hf.split(".", 3)[3]]]
        if settings["dora"] and wrapped != parts:
            missing = ", ".join(p for p in parts if p not in wrapped)
            raise LmforgeError(
                f"a DoRA adapter on {hf} needs adapters on all of {', '.join(parts)} (missing: {missing}): "
                "Phi-3 fuses them into one module whose DoRA normalises every row; target all of them "
                "(e.g. qkv_proj, gate_up_proj) or use plain LoRA"
            )
        n = len(wrapped)
        blocks = []
        for part in parts:  # B: part rows x (n*r) columns, B_i in block i
            rows = model.get_submodule(part).out_features
            block = torch.zeros(rows, n * r, dtype=layers[wrapped[0]].lora_B.dtype)
            if part in layers:
                i = wrapped.index(part)
                block[:, i * r : (i + 1) * r] = layers[part].lora_B.detach().cpu()
            blocks.append(block)
        tensors[hf + ".lora_A.weight"] = torch.cat([layers[w].lora_A.detach().cpu() for w in wrapped])
        tensors[hf + ".lora_B.weight"] = torch.cat(blocks)
        if settings["dora"]:
            tensors[hf + ".lora_magnitude_vector"] = torch.cat([layers[w].lora_magnitude.detach().cpu()
                                                                for w in wrapped])
        if n > 1:
            ranks[re.escape(hf)] = n * r
            alphas[re.escape(hf)] = alpha * (math.sqrt(n) if settings["rslora"] else n)
    tensors = {k: v.to("cpu").contiguous() for k, v in tensors.items()}
    return tensors, list(groups), ranks, alphas, layout


def fused_pattern(layout: dict[str, list[str]], r: int, alpha: float, rslora: bool) -> dict[str, dict]:
    """The rank_pattern and alpha_pattern `fused_adapter` writes for `layout` (to check a file's)."""
    n = {re.escape(hf): len(parts) for hf, parts in layout.items() if len(parts) > 1}
    return {"rank_pattern": {k: v * r for k, v in n.items()},
            "alpha_pattern": {k: alpha * (math.sqrt(v) if rslora else v) for k, v in n.items()}}


def read_layout(file) -> dict[str, list[str]]:
    """The `lmforge_fused` layout of an adapter file written by lmforge ({} for any other file)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            raw = (f.metadata() or {}).get(LAYOUT_KEY)
    except Exception:  # unreadable: the tensor reader reports it with its own message
        return {}
    try:
        layout = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        layout = None
    ok = isinstance(layout, dict) and all(isinstance(k, str) and isinstance(v, list) and v
                                          and all(isinstance(p, str) for p in v) for k, v in layout.items())
    if not ok:
        raise LmforgeError(f"{file}: metadata {LAYOUT_KEY} must map fused module names to lists of layers")
    return layout


def unfuse(tensors: dict[str, torch.Tensor], layout: dict[str, list[str]], r: int, cfg: ModelConfig,
           prefix: str, file) -> dict[str, str]:
    """Replace, in `tensors`, each fused adapter of `layout` by the per-layer adapters it is the union
    of, keyed by a name of our own ({prefix}lmforge.{layer}.lora_A.weight ...); returns {our layer: that
    name}. LmforgeError when B is not exactly block-diagonal (not a file that fused_adapter wrote)."""
    names: dict[str, str] = {}
    for hf, parts in layout.items():
        n = len(parts)
        slots = [phi3.fused_rows(p, cfg) if phi3.fused_module(p) == hf else None for p in parts]
        if any(s is None for s in slots) or len(set(parts)) != n:
            raise LmforgeError(f"{file}: metadata {LAYOUT_KEY} lists {parts} for {hf}, which are not its "
                               "parts")
        keys = {k: f"{prefix}{hf}.{k}" for k in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")}
        if keys["lora_A.weight"] not in tensors or keys["lora_B.weight"] not in tensors:
            raise LmforgeError(f"{file} has no adapter for {hf}, which its metadata {LAYOUT_KEY} lists")
        a, b = tensors.pop(keys["lora_A.weight"]), tensors.pop(keys["lora_B.weight"])
        m = tensors.pop(keys["lora_magnitude_vector"], None)
        total = slots[0][1]
        if tuple(a.shape[:1]) != (n * r,) or tuple(b.shape) != (total, n * r):
            raise LmforgeError(f"{file}: the adapter of {hf} has shapes {tuple(a.shape)} / {tuple(b.shape)}; "
                               f"{n} layers of rank {r} need {n * r} rows of A and B of {(total, n * r)}")
        rebuilt = torch.zeros_like(b)
        for i, (part, (rows, _)) in enumerate(zip(parts, slots, strict=True)):
            block = slice(i * r, (i + 1) * r)
            rebuilt[rows, block] = b[rows, block]
            names[part] = f"lmforge.{part}"
            tensors[f"{prefix}lmforge.{part}.lora_A.weight"] = a[block]
            tensors[f"{prefix}lmforge.{part}.lora_B.weight"] = b[rows, block]
            if m is not None:
                tensors[f"{prefix}lmforge.{part}.lora_magnitude_vector"] = m[rows]
        if not torch.equal(rebuilt, b):
            raise LmforgeError(f"{file}: the adapter of {hf} is not block-diagonal over {', '.join(parts)} "
                               "as lmforge writes it, so it is not the per-layer adapters its metadata names")
    return names
