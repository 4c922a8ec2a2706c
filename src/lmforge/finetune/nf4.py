"""NF4 4-bit frozen base weights with double quantisation: the base layer of QLoRA, in plain torch.

The storage format and the rounding are bitsandbytes' (`quantize_4bit(quant_type="nf4",
compress_statistics=True)`), reproduced bit for bit so that codes and dequantised weights are the same
as bitsandbytes' on the same weight, while this file needs no bitsandbytes, runs on any device and
traces under torch.compile:

  level 1  the flattened (out * in) weight is cut into blocks of `blocksize` (64) values; each block
           is divided by its absmax and every value is rounded to the nearest of the 16 NF4 levels
           (QLoRA's normal-quantile table); two 4-bit codes are packed per byte, the first value in
           the high nibble. A last partial block has its own absmax; an odd count is padded with
           the code of 0.0.
  level 2  (double_quant) the fp32 block absmaxes minus their mean are quantised again with
           bitsandbytes' signed 8-bit dynamic code in blocks of 256 (one fp32 absmax per 256 blocks
           and one fp32 offset per tensor), so the scales cost 1 byte per block instead of 4.

Rounding of level 2 follows bitsandbytes' CPU kernel, which finds the nearest code through a
65536-entry lookup table over [-1, 1] rather than by exact search; its CUDA kernel (binary search)
and its pure-torch fallback (bucketize) pick the neighbouring code for about 0.2% of the scales.
We follow the CPU kernel because it is the reference the test suite can run everywhere; the two
choices are equally valid states of the same format, and dequantisation (a table look-up and a
multiply) is identical on every backend.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import LmforgeError

# QLoRA's NF4 levels (bitsandbytes' `get_4bit_type("nf4")`), code i -> value; sorted ascending.
NF4_LEVELS: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes accepts, so files stay portable
ABSMAX_BLOCKSIZE = 256  # level-2 block size, fixed by bitsandbytes' format
_LUT_SIZE = 65536  # bitsandbytes' CPU kernel: [-1, 1] is cut into this many points for the 8-bit look-up


def nf4_code(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 NF4 levels as fp32, code index -> value."""
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def dynamic_code(device: torch.device | str | None = None) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code (`create_dynamic_map()`): 256 sorted fp32 values in
    [-0.99297, 1]; each decade 10^-k holds means of a linear grid, finer decades having fewer values."""
    values: list[float] = []
    exponent_bits, non_sign_bits = 7, 7
    for i in range(exponent_bits):
        edges = torch.linspace(0.1, 1, 2 ** (i + non_sign_bits - exponent_bits) + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (-(exponent_bits - 1) + i)
        # the same fp32 ops as bitsandbytes, so the table matches to the bit
        values += (scale * means).tolist() + (-scale * means).tolist()
    values += [0.0, 1.0]
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32, device=device)


def nf4_byte_table(code: torch.Tensor) -> torch.Tensor:
    """(256, 2) fp32: packed byte -> (value of its high nibble, value of its low nibble). Decoding one
    look-up per byte takes half the index memory and a third of the time of one per nibble."""
    byte = torch.arange(256, device=code.device)
    return torch.stack((code[byte >> 4], code[byte & 0xF]), dim=-1)


def _midpoints(code: torch.Tensor) -> torch.Tensor:
    return (code[:-1] + code[1:]) * 0.5


@functools.lru_cache(maxsize=8)
def _dynamic_lut(device: str) -> torch.Tensor:
    """(65536,) uint8: grid point i of [-1, 1] -> index of the nearest dynamic-code value, built as
    bitsandbytes' CPU kernel builds it (value = -1 + 2i / 65535 in fp32; index = #midpoints < value)."""
    mid = _midpoints(dynamic_code(device))
    grid = (2.0 * torch.arange(_LUT_SIZE, dtype=torch.float32, device=device)) / float(_LUT_SIZE - 1) - 1.0
    return torch.searchsorted(mid, grid, side="left").to(torch.uint8)


def _check_blocksize(blocksize: int) -> None:
    if blocksize not in BLOCKSIZES:
        raise LmforgeError(
            f"NF4 blocksize {blocksize!r} is not supported; use one of {BLOCKSIZES} (QLoRA: 64)"
        )


def nf4_storage_bytes(numel: int, blocksize: int = 64, double_quant: bool = True) -> int:
    """Bytes NF4 stores for a weight of `numel` values: packed codes, plus per block an fp32 absmax,
    or with double quantisation a uint8 code per block, an fp32 absmax per 256 blocks and one fp32 offset."""
    blocks = -(-numel // blocksize)
    codes = -(-numel // 2)
    if not double_quant:
        return codes + 4 * blocks
    return codes + blocks + 4 * -(-blocks // ABSMAX_BLOCKSIZE) + 4


# ---------------------------------------------------------------------------------------------------------
# quantise / dequantise (pure functions on tensors)


def _quantize_level1(w: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat weight -> (packed uint8 codes (ceil(n/2),), fp32 absmax (blocks,)); bitsandbytes' op order."""
    flat = w.reshape(-1).float()
    n = flat.numel()
    full = n - n % blocksize
    body = flat[:full].view(-1, blocksize)
    absmax = body.abs().amax(dim=1)
    # x * (1 / absmax), and a plain division for the last partial block: the exact ops bitsandbytes
    # uses, since either can differ in the last bit and move a value across a rounding boundary
    scaled = torch.clamp(body * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1), -1, 1).reshape(-1)
    if full < n:
        tail_max = flat[full:].abs().max().clamp(min=1e-38)  # stored clamped, as bitsandbytes does
        absmax = torch.cat([absmax, tail_max.view(1)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / tail_max, -1, 1)])
    if n % 2:
        scaled = F.pad(scaled, (0, 1))  # the pad value 0.0 gets code 7
    # ties at a midpoint go to the lower level (bucketize right=False), as in bitsandbytes
    codes = torch.bucketize(scaled, _midpoints(nf4_code(w.device)), out_int32=True).to(torch.uint8)
    return (codes[0::2] << 4) | codes[1::2], absmax


def _quantize_absmax(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 absmax (blocks,) -> uint8 codes (blocks,), fp32 level-2 absmax (ceil(blocks / 256),) and
    fp32 offset (1,), as bitsandbytes' CPU kernel computes them."""
    offset = absmax.mean()
    x = absmax - offset
    blocks = x.numel()
    padded = F.pad(x, (0, (-blocks) % ABSMAX_BLOCKSIZE)).view(-1, ABSMAX_BLOCKSIZE)  # zeros never raise a max
    scale = padded.abs().amax(dim=1)
    # a block whose absmaxes all equal the mean (one block only, or a constant weight) has scale 0
    empty = (scale == 0).view(-1, 1)
    scaled = torch.where(empty, 0.0, (padded * (1.0 / scale).view(-1, 1)).clamp(-1, 1))
    # bitsandbytes' CPU look-up: index = trunc((v + 1) * 0.5 * 65535 + 0.5), then the table
    index = ((scaled + 1.0) * 0.5 * float(_LUT_SIZE - 1) + 0.5).to(torch.int64)
    codes = _dynamic_lut(str(absmax.device))[index]
    codes = torch.where(empty, torch.zeros_like(codes), codes)  # bitsandbytes stores code 0 there
    return codes.reshape(-1)[:blocks].contiguous(), scale, offset.view(1)


def _dequantize_absmax(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, code: torch.Tensor
) -> torch.Tensor:
    blocks = codes.numel()
    values = torch.index_select(code, 0, codes.int())  # index_select: far faster than code[idx] on CPU
    if blocks % ABSMAX_BLOCKSIZE:
        values = F.pad(values, (0, ABSMAX_BLOCKSIZE - blocks % ABSMAX_BLOCKSIZE))
    values = values.view(-1, ABSMAX_BLOCKSIZE)
    # multiply, then add the offset as a second rounding (bitsandbytes does the same two steps)
    return (values * scale.view(-1, 1)).reshape(-1)[:blocks] + offset


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...],
    blocksize: int,
    dtype: torch.dtype = torch.float32,
    *,
    absmax_scale: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
    byte_table: torch.Tensor | None = None,
    absmax_code: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed NF4 codes -> weight of `shape` in `dtype` (computed in fp32, then cast). With double
    quantisation `absmax` is the uint8 level-2 codes and `absmax_scale` / `absmax_offset` are given.
    `byte_table` (`nf4_byte_table`) and `absmax_code` (`dynamic_code`) default to bitsandbytes' tables."""
    table = nf4_byte_table(nf4_code(packed.device)) if byte_table is None else byte_table
    if absmax_scale is not None:
        assert absmax_offset is not None, "double-quantised absmax needs its offset"
        absmax_code = dynamic_code(packed.device) if absmax_code is None else absmax_code
        absmax = _dequantize_absmax(absmax, absmax_scale, absmax_offset, absmax_code)
    n, padded = math.prod(shape), absmax.numel() * blocksize
    values = torch.index_select(table, 0, packed.int()).view(-1)  # (2 * bytes,) fp32
    if values.numel() != padded:  # odd count or a partial last block (never for 64-aligned layers)
        values = F.pad(values[:n], (0, padded - n))
    values = values.view(-1, blocksize).mul_(absmax.view(-1, 1))
    return values.view(-1)[:n].view(shape).to(dtype)


def quantize_nf4(w: torch.Tensor, blocksize: int = 64, double_quant: bool = True) -> dict[str, torch.Tensor]:
    """A float weight -> its NF4 state: `qweight` (packed uint8), `absmax` (uint8 with double_quant,
    else fp32) and, with double_quant, `absmax_scale` and `absmax_offset` (fp32)."""
    _check_blocksize(blocksize)
    if not w.is_floating_point():
        raise LmforgeError(f"NF4 quantises float weights; got dtype {w.dtype}")
    if w.numel() == 0 or not bool(torch.isfinite(w).all()):
        raise LmforgeError(
            f"NF4 needs a non-empty, finite weight; got shape {tuple(w.shape)} with NaN/inf or no values "
            "(quantise a trained or initialised model, not one on the meta device or diverged)"
        )
    packed, absmax = _quantize_level1(w.detach(), blocksize)
    if not double_quant:
        return dict(qweight=packed, absmax=absmax)
    codes, scale, offset = _quantize_absmax(absmax)
    return dict(qweight=packed, absmax=codes, absmax_scale=scale, absmax_offset=offset)


# ---------------------------------------------------------------------------------------------------------
# the layer


class _FrozenNF4Linear(torch.autograd.Function):
    """y = x W^T + b with W dequantised on the fly, in forward and again in backward, so autograd keeps
    the packed codes (which the module holds anyway) instead of a full-size float W per layer. Only x
    gets a gradient: the base is frozen."""

    @staticmethod
    def forward(ctx, x, bias, dequant_args, packed, absmax, absmax_scale, absmax_offset, table, absmax_code):
        ctx.dequant_args = dequant_args
        ctx.save_for_backward(packed, absmax, absmax_scale, absmax_offset, table, absmax_code)
        w = _dequant(dequant_args, packed, absmax, absmax_scale, absmax_offset, table, absmax_code, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return (None,) * 9
        w = _dequant(ctx.dequant_args, *ctx.saved_tensors, grad_out.dtype)  # (out, in)
        return (grad_out @ w,) + (None,) * 8


def _dequant(args, packed, absmax, absmax_scale, absmax_offset, table, absmax_code, dtype):
    shape, blocksize = args
    return dequantize_nf4(
        packed, absmax, shape, blocksize, dtype,
        absmax_scale=absmax_scale, absmax_offset=absmax_offset, byte_table=table, absmax_code=absmax_code,
    )  # fmt: skip


# buffers whose fp32 values are part of the format: `model.to(torch.bfloat16)` must not round them
_FP32_BUFFERS = ("absmax", "absmax_scale", "absmax_offset", "byte_table", "absmax_code")


class NF4Linear(nn.Module):
    """A frozen nn.Linear stored as NF4 (bitsandbytes' layout): `forward(x) = F.linear(x,
    dequantized_weight().to(x.dtype), bias)`, with gradients for x only.

    Build with `NF4Linear.from_linear(linear)`; the constructor makes an empty layer of the right shape
    to `load_state_dict` into. The state dict holds only tensors (safetensors-ready):
    `qweight` uint8 (ceil(out*in/2),), `absmax` uint8 (blocks,) [fp32 without double_quant],
    `absmax_scale` fp32 (ceil(blocks/256),), `absmax_offset` fp32 (1,) [double_quant only], `bias`.
    The module has no parameters; `.to(dtype)` casts the bias only, never the fp32 scales.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        blocksize: int = 64,
        double_quant: bool = True,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        _check_blocksize(blocksize)
        self.in_features, self.out_features = in_features, out_features
        self.blocksize, self.double_quant, self.compute_dtype = blocksize, double_quant, compute_dtype
        n = in_features * out_features
        blocks = -(-n // blocksize)
        self.register_buffer("qweight", torch.zeros(-(-n // 2), dtype=torch.uint8, device=device))
        if double_quant:
            self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8, device=device))
            level2 = -(-blocks // ABSMAX_BLOCKSIZE)
            self.register_buffer("absmax_scale", torch.zeros(level2, dtype=torch.float32, device=device))
            self.register_buffer("absmax_offset", torch.zeros(1, dtype=torch.float32, device=device))
            self.register_buffer("absmax_code", dynamic_code(device), persistent=False)
        else:
            self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.float32, device=device))
            self.absmax_scale = self.absmax_offset = self.absmax_code = None
        self.register_buffer("byte_table", nf4_byte_table(nf4_code(device)), persistent=False)
        b = torch.zeros(out_features, dtype=compute_dtype, device=device) if bias else None
        self.register_buffer("bias", b)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        blocksize: int = 64,
        double_quant: bool = True,
        compute_dtype: torch.dtype | None = None,
    ) -> NF4Linear:
        """Quantise `linear` (left untouched) into a new NF4Linear on the same device;
        compute_dtype defaults to the linear's weight dtype."""
        if not isinstance(linear, nn.Linear):
            raise LmforgeError(f"NF4Linear.from_linear takes an nn.Linear; got {type(linear).__name__}")
        w = linear.weight
        state = quantize_nf4(w, blocksize, double_quant)
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            blocksize=blocksize,
            double_quant=double_quant,
            compute_dtype=compute_dtype or w.dtype,
            device=w.device,
        )
        with torch.no_grad():
            for name, tensor in state.items():
                getattr(module, name).copy_(tensor)
            if linear.bias is not None:
                module.bias.copy_(linear.bias)
        return module

    def _dequant_args(self) -> tuple[tuple[int, int], int]:
        return (self.out_features, self.in_features), self.blocksize

    def dequantized_weight(self) -> torch.Tensor:
        """The (out, in) weight in compute_dtype (no grad: the base is frozen)."""
        return _dequant(
            self._dequant_args(), self.qweight, self.absmax, self.absmax_scale, self.absmax_offset,
            self.byte_table, self.absmax_code, self.compute_dtype,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenNF4Linear.apply(
            x, self.bias, self._dequant_args(), self.qweight, self.absmax, self.absmax_scale,
            self.absmax_offset, self.byte_table, self.absmax_code,
        )  # fmt: skip

    def storage_bytes(self) -> int:
        """Bytes of the quantised weight (codes and scales; not the bias or the constant code tables)."""
        names = ("qweight", "absmax", "absmax_scale", "absmax_offset")
        return sum(t.nbytes for t in (getattr(self, k) for k in names) if t is not None)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) / .half() would round the fp32 scales and code tables and silently change
        # every dequantised value; they follow device moves only.
        kept = {k: t for k in _FP32_BUFFERS if (t := self._buffers.get(k)) is not None}
        super()._apply(fn, recurse)
        for k, old in kept.items():
            new = self._buffers[k]
            if new.dtype != old.dtype:
                self._buffers[k] = old.to(new.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, blocksize={self.blocksize}, double_quant={self.double_quant}, "
            f"compute_dtype={self.compute_dtype}"
        )


# ---------------------------------------------------------------------------------------------------------
# whole models


def in_layers(name: str, module: nn.Module) -> bool:
    """The default selection: every nn.Linear inside `model.layers` (not embeddings, not `output`)."""
    return isinstance(module, nn.Linear) and name.split(".", 1)[0] == "layers"


def quantize_model_nf4(
    model: nn.Module,
    include: Callable[[str, nn.Module], bool] = in_layers,
    blocksize: int = 64,
    double_quant: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> dict:
    """Replace, in place, every nn.Linear of `model` for which `include(name, module)` is true by an
    NF4Linear. Returns stats: modules, params (weight values quantised), quantized_bytes,
    bytes_per_param, fp32_bytes (what those weights took in fp32) and compression (fp32 / quantised).
    Biases stay in compute_dtype and are not counted."""
    _check_blocksize(blocksize)
    chosen = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and include(n, m)]
    if not chosen:
        raise LmforgeError(
            f"quantize_model_nf4: no nn.Linear of {type(model).__name__} matched `include`; the default "
            "takes those under `layers.` (pass include=lambda name, module: ... to choose others)"
        )
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for name, m in chosen:
        if uses[id(m.weight)] > 1:
            raise LmforgeError(
                f"quantize_model_nf4: {name}.weight is shared with another module (tied weights); "
                "quantising it would untie them: leave it out of `include`"
            )
    params = quantized = 0
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        q = NF4Linear.from_linear(linear, blocksize, double_quant, compute_dtype)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
        params += linear.weight.numel()
        quantized += q.storage_bytes()
    return dict(
        modules=len(chosen),
        params=params,
        quantized_bytes=quantized,
        bytes_per_param=quantized / params,
        fp32_bytes=4 * params,
        compression=4 * params / quantized,
    )
