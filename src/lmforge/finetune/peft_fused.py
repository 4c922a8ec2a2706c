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
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import llama, phi3


def fused_adapter(
    model: nn.Module, layers: dict[str, nn.Module], cfg: ModelConfig, settings: dict
) -> tuple[dict[str, torch.Tensor], list[str], dict[str, int], dict[str, float]]:
    """(PEFT tensors without the `base_model.model.` prefix, target_modules, rank_pattern, alpha_pattern)
    for the adapters `layers` (our module name -> LoRALinear) of a Phi-3 layout model."""
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
    for hf, wrapped in groups.items():
        if phi3.fused_module(wrapped[0]) is None:
            continue
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
    return tensors, list(groups), ranks, alphas
