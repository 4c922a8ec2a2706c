"""How a weight-only quantized model (QuantLinear layers, lmforge.models.quant) runs its decode steps on
a CPU: the execution paths `lmforge serve --quantized` chooses between, their weight memory, and the
in-memory round-to-nearest quantization of a full-precision model.

Paths (measured by bench/quant_decode.py; the numbers below are a 2-core AVX2 EPYC, torch 2.13):
- "kernel-bf16": torch's CPU int kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) fed
  bfloat16 activations, the rest of the model in float32. Those kernels are vectorised for bf16 inputs
  only: at 4 layers of 2048 x 2048 and 1 row, int8 takes 1.5 ms in bf16 against 16 ms in fp32 (fp32
  F.linear: 2.7 ms), int4 2.5 ms against 33 ms. Decode batches above KERNEL_MAX_ROWS rows run in
  chunks of that many rows; a prefill (more than CHUNKED_MAX_ROWS rows) dequantizes to fp32 and runs
  one dense matmul, as QuantLinear does. Weights stay integers in memory.
- "kernel-fp32": QuantLinear as it is (the same kernels fed float32, what `lmforge generate` runs).
- "dequant-fp32": dequantize once and hold fp32 weights (4 bytes a weight; the quantized values, the
  full-precision speed).
- "dequant-bf16": dequantize once to bfloat16 and run the whole model in bfloat16 (2 bytes a weight).

The activations of "kernel-bf16" are rounded to bfloat16 before each quantized matmul, and its outputs
are bf16; TOLERANCE gives the documented logit deviation from the fp32 model per bit width.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import LmforgeError
from lmforge.models.quant import KERNEL_MAX_ROWS, QuantEmbedding, QuantLinear, dequantize_model, quant_targets

PATHS = ("kernel-bf16", "kernel-fp32", "dequant-fp32", "dequant-bf16")
# A decode batch of up to this many rows runs the int kernels in chunks of KERNEL_MAX_ROWS; above it
# (a prompt) one dequantize + dense matmul is cheaper (the kernels cost ~0.8 ms a row per 16M int8
# weights in bf16, a dequantize of them ~100 ms).
CHUNKED_MAX_ROWS = 64
INT4_GROUPS = (128, 64, 32)  # tried in this order for in-memory int4 (group sizes the int4 kernel takes)
# Logit deviation from the fp32 model that every path keeps to: |difference| relative to the std of the
# fp32 logits, its mean and its max over all positions and the vocabulary. Measured on the demo model
# (random prompts of 8-128 tokens, RTN): int8 per-channel mean 0.20-0.43%, max 1.4-4.1%; int4 group 64
# mean 3.1-5.1%, max 21-42%, on every path (the bf16 activations of kernel-bf16 and dequant-bf16 add
# about 0.2% mean to int8, nothing visible to int4). The bounds leave ~3-5x for other models; a random
# (untrained) model's gaussian weights lose more to int4 (the unit tests' tiny model: 19% mean).
TOLERANCE = {8: {"mean_rel": 0.02, "max_rel": 0.12}, 4: {"mean_rel": 0.15, "max_rel": 1.2}}
# What a path adds to the quantization itself: its logits against the exact dequantized model's
# (dequant-fp32, the same integers): fp32 kernels differ in the sums' last bits, bf16 activations by
# their rounding (demo model: mean 0.2%, max 1.6%).
PATH_TOLERANCE = {"mean_rel": 0.01, "max_rel": 0.08}


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """The QuantLinear layers of `model` (a quantized embedding table is a lookup, not a matmul)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)
            and not isinstance(m, QuantEmbedding)}


def model_bits(model: nn.Module) -> int | None:
    """The bit width of `model`'s quantized layers, None when it has none."""
    bits = {m.bits for m in quantized_layers(model).values()}
    if len(bits) > 1:
        raise LmforgeError(f"the model mixes {sorted(bits)}-bit layers; serve --quantized needs one width")
    return bits.pop() if bits else None


@torch.no_grad()
def quantize_in_memory(model: nn.Module, bits: int, targets: list[str]) -> list[str]:
    """Round-to-nearest quantization of `model`'s block linear layers in place, as `lmforge quantize
    --method rtn` would (int8: per output channel; int4: symmetric groups of the largest of 128, 64, 32
    inputs that divides every layer). Returns the names of the layers quantized."""
    names = quant_targets(model, targets, head=False)
    if not names:
        raise LmforgeError("the model has no linear layers to quantize")
    group = None
    if bits == 4:
        ks = {model.get_submodule(n).in_features for n in names}
        group = next((g for g in INT4_GROUPS if all(k % g == 0 for k in ks)), None)
        if group is None:
            raise LmforgeError(f"--quantized int4 needs a group size of {', '.join(map(str, INT4_GROUPS))} "
                               f"dividing every layer's inputs ({sorted(ks)}); use --quantized int8")
    for name in names:
        layer = QuantLinear.from_linear(model.get_submodule(name), bits, group, True)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    return names


# -- the paths ---------------------------------------------------------------------------------------
def _bf16_kernel_forward(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // self.in_features
    if (x.dtype != torch.float32 or rows > CHUNKED_MAX_ROWS
            or self.kernel_name(torch.bfloat16, x.device, 1) == "reference"):
        return QuantLinear.forward(self, x)
    x2 = x.reshape(rows, self.in_features).to(torch.bfloat16)
    parts = [QuantLinear.forward(self, x2[i:i + KERNEL_MAX_ROWS]) for i in range(0, rows, KERNEL_MAX_ROWS)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def apply_path(model: nn.Module, path: str) -> nn.Module:
    """`model` (with QuantLinear layers, fp32 elsewhere) made to run `path`; in place where it can be.
    Returns the model to use."""
    if path not in PATHS:
        raise LmforgeError(f"quantized path {path!r} is not one of {', '.join(PATHS)}")
    if path == "kernel-bf16":
        for layer in quantized_layers(model).values():
            # An instance attribute: the layer's state dict and class stay those of the checkpoint.
            layer.forward = types.MethodType(_bf16_kernel_forward, layer)
        return model
    if path == "kernel-fp32":
        return model
    if path == "dequant-fp32":
        return dequantize_model(model, torch.float32)
    return dequantize_model(model, torch.bfloat16).to(torch.bfloat16)


def weight_bytes(model: nn.Module, path: str) -> int:
    """Bytes of weights `model` (with QuantLinear layers, before apply_path) holds once on `path`:
    the integers, scales and the int4 kernel's repacked copy on the kernel paths, 4 or 2 bytes a weight
    dequantized; everything else at 4 bytes (2 on dequant-bf16). Tied tensors count once."""
    quant = quantized_layers(model)
    seen, total = set(), 0
    for layer in quant.values():
        n_weights = layer.in_features * layer.out_features
        if path.startswith("kernel"):
            total += sum(t.numel() * t.element_size() for t in layer.buffers())
            if layer.kernel_name(torch.bfloat16 if path == "kernel-bf16" else torch.float32) == "int4pack":
                total += n_weights // 2 + 2 * 4 * layer.scale.numel()  # repacked nibbles, (G, N, 2) fp32
        else:
            total += n_weights * (4 if path == "dequant-fp32" else 2)
        if layer.bias is not None:
            seen.add(layer.bias.data_ptr())
            total += 4 * layer.bias.numel()
    per = 2 if path == "dequant-bf16" else 4
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.rpartition(".")[0] in quant or t.data_ptr() in seen or not t.is_floating_point():
            continue
        seen.add(t.data_ptr())
        total += per * t.numel()
    return total


# -- measuring -------------------------------------------------------------------------------------
@torch.no_grad()
def probe(model: nn.Module, rows: tuple[int, ...], paths=PATHS, seconds: float = 3.0) -> dict[str, float]:
    """Seconds that one decode step's quantized matmuls take on each path: every distinct layer shape
    of `model` timed at each of `rows` input rows (a copy of one layer per shape and path, never the
    whole model), weighted by how many layers have that shape, averaged over `rows`. Bounded by
    `seconds` in all (each cell is timed at least twice, interleaved across paths)."""
    import time

    shapes: dict[tuple, list] = {}
    for layer in quantized_layers(model).values():
        key = (layer.in_features, layer.out_features, layer.bits, layer.group_size, layer.symmetric)
        shapes.setdefault(key, [layer, 0])[1] += 1
    if not shapes:
        raise LmforgeError("the model has no quantized layers to measure")
    cells = []  # (path, rows, count, fn)
    for layer, count in shapes.values():
        for path in paths:
            fn = _layer_on(layer, path)
            for r in rows:
                dtype = torch.bfloat16 if path == "dequant-bf16" else torch.float32
                x = torch.randn(r, layer.in_features).to(dtype)
                fn(x)  # first use: the kernel operands are derived here, not timed
                cells.append((path, r, count, fn, x))
    best = {i: math.inf for i in range(len(cells))}
    deadline = time.perf_counter() + seconds
    order, done = list(range(len(cells))), 0
    while done < 2 or time.perf_counter() < deadline:
        for i in order if done % 2 == 0 else reversed(order):  # alternate: no path always runs first
            _, _, _, fn, x = cells[i]
            t0 = time.perf_counter()
            fn(x)
            best[i] = min(best[i], time.perf_counter() - t0)
        done += 1
    out = dict.fromkeys(paths, 0.0)
    for i, (path, _, count, _, _) in enumerate(cells):
        out[path] += count * best[i] / len(rows)
    return out


def _layer_on(layer: QuantLinear, path: str):
    """A callable computing `layer` the way `path` would (a copy: the model is not touched)."""
    if path.startswith("dequant"):
        dtype = torch.float32 if path == "dequant-fp32" else torch.bfloat16
        w = layer.dequantized_weight(dtype)
        b = None if layer.bias is None else layer.bias.to(dtype)
        return lambda x: F.linear(x, w, b)
    copy = QuantLinear(layer.in_features, layer.out_features, layer.bias is not None, layer.bits,
                       layer.group_size, layer.symmetric, layer.scale.dtype)
    copy.load_state_dict(layer.state_dict())
    return apply_path(copy, path)


def choose(measured: dict[str, float], need: dict[str, int], budget: int | None) -> str:
    """The fastest path (least seconds in `measured`) whose weights (`need`, bytes) fit `budget`
    (None: no limit); ties go to the smaller. A clear error when none fits."""
    fits = [p for p in measured if budget is None or need[p] <= budget]
    if not fits:
        small = min(need, key=need.get)
        raise LmforgeError(f"--memory-budget-mb {budget / 2**20:.0f}: no quantized path fits; the smallest "
                           f"({small}) needs {need[small] / 2**20:.1f} MiB of weights; raise the budget")
    return min(fits, key=lambda p: (measured[p], need[p]))
