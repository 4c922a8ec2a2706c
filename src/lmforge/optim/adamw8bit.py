"""AdamW with block-wise 8-bit moments (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"), in plain PyTorch for any device, plus the switch to bitsandbytes' CUDA kernels.

Each moment tensor is cut into blocks of `block_size` consecutive elements. A block keeps one fp32
scale (its absmax) and one uint8 code per element: the index of the nearest value of a 256-entry
map in [-1, 1] (exp_avg: signed dynamic map) or [0, 1] (exp_avg_sq: unsigned dynamic map). The
dynamic ("tree") map spends its codes log-uniformly over seven decades, so small moments keep their
relative precision next to a large outlier in the same block, and the per-block scale keeps an
outlier from flattening the rest of the tensor. Every step dequantises both moments to fp32, takes
exactly `torch.optim.AdamW`'s step in fp32, and requantises; state costs 2 bytes per element plus
8 / block_size bytes of scales, against AdamW's 8.

Tensors with fewer than `min_quant_size` elements keep fp32 moments and take torch's own AdamW
step (as bitsandbytes does: they are few bytes and often norms, where 8-bit error matters most).
The maps and the update order (decay, moments, bias-corrected step) are bitsandbytes'; its CPU
quantiser picks the farther of two codes for about 0.2% of values near a code midpoint, ours always
the nearest, so the two track each other closely rather than bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import cache
from itertools import chain

import torch
import torch.nn.functional as F
from torch.optim.adam import adam as adam_functional

from lmforge.errors import ConfigError

# State that load_state_dict restores as saved rather than cast to the parameter's dtype.
_QUANT_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")
BNB_BLOCK_SIZE = 256  # bitsandbytes' 8-bit optimizer kernels hard-code this block size
_CELL_BITS = 17  # sign + 8 exponent + 8 mantissa bits of a float32: the encoder's lookup cells


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic quantisation map (`create_dynamic_map(signed)`, 7 exponent bits):
    256 sorted fp32 values; signed spans [-0.993, 1], unsigned [0, 1].

    Exponent i (0..6) owns 2^i (signed) or 2^(i+1) (unsigned) codes, placed at the midpoints of an
    even grid on [0.1, 1] scaled by 10^(i-6); 0 and 1 are added so both are exact."""
    data: list[float] = []
    for i in range(7):
        n = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, n, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (10 ** (-6 + i) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return torch.tensor(sorted(data), dtype=torch.float32)


@cache
def _codebook(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The map, and a lookup table that encodes to the nearest map value without a search.

    A binary search over the 255 decision boundaries (torch.bucketize) costs ~40 ns per element on
    a CPU. Instead, the top 17 bits of a float32 (sign, exponent, 8 mantissa bits) name a cell of
    relative width <= 2^-8, narrower than the map's closest boundaries (relative gap >= 0.007), so a
    cell holds at most one boundary: code = first_code[cell] + (x > split[cell]), with the same
    result as bucketize (asserted below, for every cell) at a fifth of the cost.
    """
    qmap = dynamic_map(signed)
    bounds = (qmap[1:] + qmap[:-1]) / 2
    cell = torch.arange(2**_CELL_BITS, dtype=torch.int32)
    shift = 32 - _CELL_BITS
    low = cell << shift  # the cell's float with all dropped mantissa bits 0 ...
    high = low | ((1 << shift) - 1)  # ... and all 1: the cell's ends, swapped for negative floats
    negative = cell >= 2 ** (_CELL_BITS - 1)
    vmin = torch.where(negative, high, low).view(torch.float32)
    vmax = torch.where(negative, low, high).view(torch.float32)
    first = torch.bucketize(vmin, bounds)  # codes of the cell's smallest and largest value
    last = torch.bucketize(vmax, bounds)
    finite = torch.isfinite(vmin) & torch.isfinite(vmax)
    assert int((last - first)[finite].max()) <= 1, "a lookup cell spans two code boundaries"
    split = torch.where(last > first, bounds[first.clamp(max=bounds.numel() - 1)], torch.inf)
    return qmap.to(device), first.to(torch.uint8).to(device), split.to(device)


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """(n_blocks, block_size) view of a flat tensor, zero-padded at the end (zeros change no absmax)."""
    pad = -flat.numel() % block_size
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, block_size)


def quantize_blockwise(x: torch.Tensor, signed: bool, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes (shape of x) of the nearest map value to x / absmax of its block, and the
    fp32 absmax per block (n_blocks,)."""
    blocks = _blocks(x.reshape(-1).float(), block_size)
    absmax = blocks.abs().amax(dim=1)
    # An all-zero block has absmax 0: dividing by the smallest normal instead keeps its codes at 0.
    normed = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    _, first_code, split = _codebook(signed, x.device)
    cell = ((normed.view(torch.int32) >> (32 - _CELL_BITS)) & ((1 << _CELL_BITS) - 1)).view(-1)
    # index_select, not tensor[index]: several times faster on CPU for a flat gather.
    above = normed.view(-1) > split.index_select(0, cell)
    codes = first_code.index_select(0, cell).add_(above.view(torch.uint8))
    return codes[: x.numel()].view(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
                         block_size: int) -> torch.Tensor:
    """fp32 tensor (shape of codes): map[code] * absmax of the code's block."""
    qmap = _codebook(signed, codes.device)[0]
    values = _blocks(qmap.index_select(0, codes.reshape(-1).int()), block_size) * absmax.unsqueeze(1)
    return values.view(-1)[: codes.numel()].view(codes.shape)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose moments are block-wise 8-bit for tensors of at least `min_quant_size` elements.

    State of a quantised parameter: `step`, `exp_avg_codes`/`exp_avg_sq_codes` (uint8, shape of p)
    and `exp_avg_absmax`/`exp_avg_sq_absmax` (fp32, one per block); of a small one: torch AdamW's
    `step`, `exp_avg`, `exp_avg_sq`.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block_size: int = BNB_BLOCK_SIZE,
        min_quant_size: int = 4096,
    ):
        if lr <= 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {list(betas)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "block_size": block_size, "min_quant_size": min_quant_size}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            small: list[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients")
                if p.numel() < group["min_quant_size"]:
                    small.append(p)
                else:
                    self._quantized_step(p, group)
            if small:
                self._fp32_step(small, group)
        return loss

    def _fp32_step(self, params: list[torch.Tensor], group: dict) -> None:
        """torch.optim.AdamW's own (default-path) step, so small tensors match it bit for bit."""
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam_functional(
            params, [p.grad for p in params], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
            decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )

    def _quantized_step(self, p: torch.Tensor, group: dict) -> None:
        block = group["block_size"]
        state = self.state[p]
        if not state:
            n_blocks = math.ceil(p.numel() / block)
            state["step"] = torch.tensor(0.0)
            # Zero scales make every code dequantise to 0, whatever its index.
            state["exp_avg_codes"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
            state["exp_avg_absmax"] = torch.zeros(n_blocks, dtype=torch.float32, device=p.device)
            state["exp_avg_sq_codes"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
            state["exp_avg_sq_absmax"] = torch.zeros(n_blocks, dtype=torch.float32, device=p.device)
        state["step"] += 1
        step = state["step"].item()
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]

        exp_avg = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_absmax"], True, block)
        exp_avg_sq = dequantize_blockwise(state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], False, block)
        grad = p.grad.float()
        p32 = p if p.dtype == torch.float32 else p.float()
        # torch's single-tensor AdamW, op for op: the only difference from it is the quantisation.
        p32.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        p32.addcdiv_(exp_avg, denom, value=-step_size)
        if p32 is not p:
            p.copy_(p32)

        for name, value, signed in (("exp_avg", exp_avg, True), ("exp_avg_sq", exp_avg_sq, False)):
            codes, absmax = quantize_blockwise(value, signed, block)
            state[f"{name}_codes"].copy_(codes)
            state[f"{name}_absmax"].copy_(absmax)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the codes and scales as saved: torch casts every state tensor of a
        floating-point parameter to the parameter's dtype, which would turn codes into floats and
        round the scales of a bf16 parameter."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            for key in _QUANT_KEYS:
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, copy=True)


def bitsandbytes_adamw8bit(groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
                           block_size: int, min_quant_size: int) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit (its fused CUDA kernels) over `groups`; a clear error where it
    cannot stand in for ours."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError(
            "optim.adamw8bit.backend=bitsandbytes needs the bitsandbytes package (pip install bitsandbytes); "
            "set optim.adamw8bit.backend=torch (or auto) to use lmforge's own 8-bit AdamW"
        ) from None
    if block_size != BNB_BLOCK_SIZE:
        raise ConfigError(
            f"optim.adamw8bit.backend=bitsandbytes quantises in blocks of {BNB_BLOCK_SIZE}, but "
            f"optim.adamw8bit.block_size={block_size}; set it to {BNB_BLOCK_SIZE} or use backend=torch"
        )
    return bnb.optim.AdamW8bit(groups, lr=lr, betas=tuple(betas), eps=eps, min_8bit_size=min_quant_size)


def use_bitsandbytes(backend: str, device: torch.device, block_size: int) -> bool:
    """auto: bitsandbytes where its CUDA kernels apply (importable, CUDA params, its block size);
    the pure PyTorch optimizer everywhere else."""
    if backend != "auto":
        return backend == "bitsandbytes"
    if device.type != "cuda" or block_size != BNB_BLOCK_SIZE:
        return False
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True
