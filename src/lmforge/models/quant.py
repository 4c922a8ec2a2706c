"""Weight-only affine quantization: the primitives and `QuantLinear`, the drop-in for nn.Linear that a
quantized run (config `model.quant`) is built with.

A weight W (N out, K in) is cut into groups of `group_size` consecutive inputs per output row (one group
per row: per-channel). Each group g has a scale s and, asymmetric, an integer zero point z:

    q = clamp(round(w * (1 / s)) + z, qmin, qmax)        w ~ (q - z) * s

with torchao's conventions (torchao.quantization.quant_primitives, zero-point domain INT), so the integers
are bit-identical to its `choose_qparams_affine` / `quantize_affine` at equal settings (tests/parity):
symmetric s = max|w| / ((qmax - qmin) / 2), z = 0; asymmetric s = (max(w, 0) - min(w, 0)) / (qmax - qmin),
z = qmin - round(min(w, 0) / s); s clamped to the smallest normal float; round half to even.
Ranges: int8 [-128, 127] (both mappings); int4 symmetric [-8, 7], asymmetric [0, 15].

Storage (the state dict, plain tensors that safetensors / DCP hold): int8 weights as int8 (N, K); int4
weights two per byte, uint8 (N, K / 2), the even input in the low nibble, each nibble q - qmin; scales
(N, K / group_size) in `scale_dtype`; asymmetric zero points int8 (N, K / group_size). The layouts that
torch's CPU kernels want are derived from these on first use, never stored.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError

# (bits, symmetric) -> (qmin, qmax)
_RANGES = {(8, True): (-128, 127), (8, False): (-128, 127), (4, True): (-8, 7), (4, False): (0, 15)}
_INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes torch's int4 CPU kernel takes
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch's CPU int kernels are matrix-vector kernels: measured on a 2-core AVX2 EPYC at 4096 x 4096 they
# beat dequantize + F.linear up to a few rows and lose by 10-20x at 256 rows (bench/quantize.py). Decoding
# (one row per sequence) takes them; a prompt's prefill dequantizes once and runs a dense matmul.
KERNEL_MAX_ROWS = 8


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """(qmin, qmax) of the integers a weight is stored as."""
    if (bits, symmetric) not in _RANGES:
        raise ValueError(f"bits={bits} is not supported; valid: 4 or 8")
    return _RANGES[(bits, symmetric)]


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={K}")
    return w.reshape(N, K // group_size, group_size)  # (N, G, g)


def choose_qparams(
    w: torch.Tensor, bits: int, group_size: int, symmetric: bool, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (N, G) in `scale_dtype` and, asymmetric, int32 zero points (N, G) (else None) of w (N, K)."""
    qmin, qmax = qrange(bits, symmetric)
    wg = _groups(w, group_size)
    lo = torch.clamp(wg.amin(-1), max=0.0)  # (N, G): the range always holds 0, so 0 is exact
    hi = torch.clamp(wg.amax(-1), min=0.0)
    eps = torch.finfo(w.dtype).smallest_normal
    if symmetric:
        scale = torch.clamp(torch.maximum(-lo, hi) / (float(qmax - qmin) / 2), min=eps)
        return scale.to(scale_dtype), None
    scale = torch.clamp((hi - lo) / float(qmax - qmin), min=eps)
    # The zero point comes from the scale before its cast to scale_dtype, as in torchao.
    zero = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    return scale.to(scale_dtype), zero.to(torch.int32)


def quantize(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, symmetric: bool
) -> torch.Tensor:
    """Integers (N, K) int8 of w (N, K) for scales / zero points (N, G)."""
    qmin, qmax = qrange(bits, symmetric)
    G = scale.shape[-1]
    wg = _groups(w, w.shape[1] // G)
    # w * (1 / s), not w / s: the reciprocal is what torchao rounds with (the last bit can differ).
    q = torch.round(wg * (1.0 / scale[..., None]))
    if zero is not None:
        q = q + zero[..., None]
    return torch.clamp(q, qmin, qmax).to(torch.int8).reshape(w.shape)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(q - z) * s as `dtype` (N, K), computed in `dtype` like torchao's dequantize_affine."""
    N, K = q.shape
    G = scale.shape[-1]
    w = q.reshape(N, G, K // G).to(dtype)
    if zero is not None:
        w = w - zero[..., None].to(dtype)
    return (w * scale[..., None].to(dtype)).reshape(N, K)


def pack_int4(q: torch.Tensor, qmin: int) -> torch.Tensor:
    """int8 (N, K) in [qmin, qmin + 15] -> uint8 (N, K / 2): input 2i in the low nibble, 2i+1 high."""
    u = (q.to(torch.int16) - qmin).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, qmin: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 (N, K / 2) -> int8 (N, K)."""
    lo = (packed & 0x0F).to(torch.int16)
    hi = (packed >> 4).to(torch.int16)
    return (torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1) + qmin).to(torch.int8)


class QuantLinear(nn.Module):
    """y = x W^T + b with W held as `bits`-bit integers and group-wise scales (see the module docstring).

    Buffers: qweight (int8 (N, K), or uint8 (N, K / 2) for 4 bits), scale (N, G), zero (N, G) int8 when
    asymmetric; bias a frozen parameter. forward uses torch's CPU int kernels where they apply
    (`_weight_int8pack_mm`: int8 per-channel; `_weight_int4pack_mm_for_cpu`: int4, N % 16 == 0, group size
    32-256), else dequantizes and calls F.linear (the reference; `kernel = "reference"` forces it).
    Inference only: nothing trains.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, bits: int = 4,
                 group_size: int | None = 128, symmetric: bool = True,
                 scale_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        group_size = group_size or in_features
        if in_features % group_size:
            raise ValueError(f"group_size={group_size} does not divide in_features={in_features}")
        if bits == 4 and in_features % 2:
            raise ValueError(f"int4 packs two weights per byte: in_features={in_features} must be even")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.qmin, self.qmax = qrange(bits, symmetric)
        self.kernel = "auto"  # "reference": always dequantize + F.linear; "int": the int kernels at any size
        G = in_features // group_size
        packed = (out_features, in_features // 2) if bits == 4 else (out_features, in_features)
        self.register_buffer("qweight", torch.zeros(packed, dtype=torch.uint8 if bits == 4 else torch.int8))
        self.register_buffer("scale", torch.ones(out_features, G, dtype=scale_dtype))
        self.register_buffer("zero", None if symmetric else torch.zeros(out_features, G, dtype=torch.int8))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self._fast: tuple | None = None  # (key, kernel operands) derived from the buffers on first use
        self.register_load_state_dict_pre_hook(_forget_fast)

    def extra_repr(self) -> str:
        mapping = "sym" if self.symmetric else "asym"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, {mapping}, bias={self.bias is not None}")

    # -- building -----------------------------------------------------------------------------
    @torch.no_grad()
    def set_quantized(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
        """Fill the buffers from integers q (N, K) int8, scales and zero points (N, G)."""
        self.qweight.copy_(pack_int4(q, self.qmin) if self.bits == 4 else q)
        self.scale.copy_(scale)
        if self.zero is not None:
            self.zero.copy_(zero)
        self._fast = None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int | None, symmetric: bool,
                    scale_dtype: torch.dtype = torch.bfloat16) -> QuantLinear:
        """Round-to-nearest quantization of `linear`'s weight."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, bits, group_size,
                    symmetric, scale_dtype).to(linear.weight.device)
        w = linear.weight.detach().float()
        scale, zero = qparams_for(w, bits, layer.group_size, symmetric, scale_dtype)
        layer.set_quantized(quantize(w, scale, zero, bits, symmetric), scale, zero)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias)
        return layer

    # -- reading ------------------------------------------------------------------------------
    def int_weight(self) -> torch.Tensor:
        """The integers (N, K) int8."""
        return unpack_int4(self.qweight, self.qmin) if self.bits == 4 else self.qweight

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W (N, K) as `dtype` (the same values as dequantize(int_weight(), ...), in fewer passes)."""
        return self._dequantize_rows(self.qweight, self.scale, self.zero, dtype)

    def _dequantize_rows(self, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                         dtype: torch.dtype) -> torch.Tensor:
        """Rows of W from their stored integers, scales and zero points (any subset of the rows)."""
        if self.bits == 8:
            return dequantize(qweight, scale, zero, dtype)
        N, G = scale.shape
        u = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1)  # (N, K / 2, 2) nibbles q - qmin
        w = u.view(N, G, self.group_size).to(dtype)
        shift = self.qmin if zero is None else self.qmin - zero.to(dtype)[..., None]  # q - z
        return ((w + shift) * scale.to(dtype)[..., None]).view(N, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (float32), for code that reads `.weight` (e.g. a tied head)."""
        return self.dequantized_weight()

    def kernel_name(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    rows: int = 1) -> str:
        """Which path forward takes for `rows` input rows of `dtype` on `device`: int8pack, int4pack or
        reference (kernel "auto": the int kernels for at most KERNEL_MAX_ROWS rows; "int": always)."""
        if self.kernel == "reference" or torch.device(device).type != "cpu" or dtype not in _KERNEL_DTYPES:
            return "reference"
        if self.kernel == "auto" and rows > KERNEL_MAX_ROWS:
            return "reference"
        if self.bits == 8 and self.group_size == self.in_features:
            return "int8pack"
        if (self.bits == 4 and self.group_size in _INT4_KERNEL_GROUPS and self.out_features % 16 == 0
                and self.in_features % self.group_size == 0):
            return "int4pack"
        return "reference"

    def _operands(self, kernel: str, dtype: torch.dtype) -> tuple:
        key = (kernel, dtype, self.qweight.data_ptr(), self.scale.data_ptr())
        if self._fast is not None and self._fast[0] == key:
            return self._fast[1]
        scale = self.scale.to(torch.float32)
        if kernel == "int8pack":
            # Asymmetric: x (q - z)^T s = s * (x q^T) - s z * sum(x), so the symmetric kernel serves both.
            shift = None if self.zero is None else (scale[:, 0] * self.zero[:, 0].float()).to(dtype)
            ops = (self.qweight.contiguous(), scale[:, 0].to(dtype).contiguous(), shift)
        else:
            # The kernel computes w = (u - 8) * s + m on the stored nibble u = q - qmin; so
            # m = (8 + qmin - z) * s, and 0 for symmetric weights (qmin = -8, z = 0).
            zero = torch.zeros_like(scale) if self.zero is None else self.zero.float()
            m = (8 + self.qmin - zero) * scale  # (N, G)
            sz = torch.stack([scale, m], dim=-1).transpose(0, 1).contiguous().to(dtype)  # (G, N, 2)
            u = (self.int_weight().to(torch.int32) - self.qmin).contiguous()
            ops = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1), sz)
        self._fast = (key, ops)
        return ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel_name(x.dtype, x.device, x.numel() // self.in_features)
        if kernel == "reference":
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()  # (M, K)
        if kernel == "int8pack":
            w, s, shift = self._operands(kernel, x.dtype)
            y = torch.ops.aten._weight_int8pack_mm(x2, w, s)  # (M, N)
            if shift is not None:
                y = y - x2.sum(-1, keepdim=True) * shift
        else:
            packed, sz = self._operands(kernel, x.dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self.group_size, sz)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def _forget_fast(module: QuantLinear, *_args) -> None:
    module._fast = None


class QuantEmbedding(QuantLinear):
    """A token embedding table (num_embeddings, embedding_dim) stored as QuantLinear stores a weight
    (groups of `group_size` along the embedding dimension): a lookup dequantizes only the rows of its
    ids; `.weight` (the whole table, dequantized) serves a tied output head. Its outputs take the dtype
    the model is cast to (a non-persistent probe buffer follows `model.to(dtype)`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int = 4, group_size: int | None = 128,
                 symmetric: bool = True, scale_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(embedding_dim, num_embeddings, False, bits, group_size, symmetric, scale_dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)

    @classmethod
    @torch.no_grad()
    def from_embedding(cls, emb: nn.Embedding, bits: int, group_size: int | None, symmetric: bool,
                       scale_dtype: torch.dtype = torch.bfloat16) -> QuantEmbedding:
        """Round-to-nearest quantization of `emb`'s table."""
        layer = cls(emb.num_embeddings, emb.embedding_dim, bits, group_size, symmetric,
                    scale_dtype).to(emb.weight.device)
        w = emb.weight.detach().float()
        scale, zero = qparams_for(w, bits, layer.group_size, symmetric, scale_dtype)
        layer.set_quantized(quantize(w, scale, zero, bits, symmetric), scale, zero)
        return layer

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantized_weight(self.dtype_probe.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, "
                f"group_size={self.group_size}, {'sym' if self.symmetric else 'asym'}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, embedding_dim)
        rows = ids.reshape(-1)
        zero = None if self.zero is None else self.zero[rows]
        out = self._dequantize_rows(self.qweight[rows], self.scale[rows], zero, self.dtype_probe.dtype)
        return out.view(*ids.shape, self.embedding_dim)


def qparams_for(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales as stored (`scale_dtype`) and zero points as int8: what the integers must be rounded with.

    The zero point is chosen with the float32 scale (torchao's convention); the integers are then
    rounded with the stored (possibly bfloat16) scale, so that what is stored reproduces them."""
    scale, zero = choose_qparams(w, bits, group_size, symmetric, scale_dtype)
    return scale, None if zero is None else zero.to(torch.int8)


# -- a model's layout -------------------------------------------------------------------------------
def quant_targets(model: nn.Module, targets: list[str], head: bool) -> list[str]:
    """Names of the nn.Linear modules of `model` that `targets` (fnmatch globs over module names) pick,
    plus the untied output head when `head`."""
    names = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if name in ("output", "score", "value"):
            if head and name == "output":
                names.append(name)
            continue
        if any(fnmatch.fnmatchcase(name, t) for t in targets):
            names.append(name)
    return names


def scale_dtype_of(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def apply_quant_layout(model: nn.Module, qcfg) -> list[str]:
    """Replace the Linear layers `qcfg` (a QuantConfig) picks with empty QuantLinear layers on their
    device (meta included): the structure a quantized checkpoint loads into. Returns their names."""
    names = quant_targets(model, qcfg.targets, qcfg.head)
    if qcfg.embeddings:
        emb = model.get_submodule("tok_embeddings")
        if qcfg.group_size is not None and emb.embedding_dim % qcfg.group_size:
            raise ConfigError(f"model.quant.group_size={qcfg.group_size} does not divide the embedding size "
                              f"{emb.embedding_dim}; use a group size that divides it, or none")
        table = QuantEmbedding(emb.num_embeddings, emb.embedding_dim, qcfg.bits, qcfg.group_size,
                               qcfg.symmetric, scale_dtype_of(qcfg.scale_dtype))
        model.tok_embeddings = table.to(emb.weight.device)
    for name in names:
        lin = model.get_submodule(name)
        if qcfg.group_size is not None and lin.in_features % qcfg.group_size:
            raise ConfigError(f"model.quant.group_size={qcfg.group_size} does not divide the "
                              f"{lin.in_features} inputs of {name}; use a group size that divides every "
                              "quantized layer's in_features, or none (per-channel)")
        layer = QuantLinear(lin.in_features, lin.out_features, lin.bias is not None, qcfg.bits,
                            qcfg.group_size, qcfg.symmetric, scale_dtype_of(qcfg.scale_dtype))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer.to(lin.weight.device))
    return names


@torch.no_grad()
def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """`model` with every QuantLinear replaced by an nn.Linear holding its dequantized weight, and
    `model.cfg.quant` cleared (when it has a cfg): a plain model with the quantized model's outputs."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantEmbedding):
            emb = nn.Embedding(m.num_embeddings, m.embedding_dim, device=m.scale.device, dtype=dtype)
            emb.weight.copy_(m.dequantized_weight(dtype))
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, emb)
        elif isinstance(m, QuantLinear):
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.scale.device,
                            dtype=dtype)
            lin.weight.copy_(m.dequantized_weight(dtype))
            if m.bias is not None:
                lin.bias.copy_(m.bias)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, lin)
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "quant", None) is not None:
        model.cfg = cfg.model_copy(update={"quant": None})
    return model
