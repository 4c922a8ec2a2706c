"""lmforge.models.quant's primitives against torchao's quant_primitives at equal settings: the same
scales, zero points and integers bit for bit, and the same dequantized values, for int8 per-channel and
int4 group-wise (32 / 64 / 128), symmetric and asymmetric, with float32 and bfloat16 scales."""

from __future__ import annotations

import pytest
import torch

from lmforge.models.quant import QuantLinear, choose_qparams, dequantize, qrange, quantize

qp = pytest.importorskip("torchao.quantization.quant_primitives")

CASES = [(8, None), (4, 32), (4, 64), (4, 128)]


def _torchao(w: torch.Tensor, bits: int, group: int, symmetric: bool, scale_dtype: torch.dtype):
    qmin, qmax = qrange(bits, symmetric)
    target = torch.uint8 if qmin >= 0 else torch.int8
    mapping = qp.MappingType.SYMMETRIC if symmetric else qp.MappingType.ASYMMETRIC
    block = (1, group)
    scale, zero = qp.choose_qparams_affine(w, mapping, block, target, qmin, qmax, scale_dtype=scale_dtype)
    q = qp.quantize_affine(w, block, scale, zero, target, qmin, qmax)
    deq = qp.dequantize_affine(q, block, scale, zero, target, qmin, qmax, output_dtype=torch.float32)
    return scale, zero, q, deq


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits,group", CASES)
def test_primitives_bit_exact_with_torchao(bits, group, symmetric, scale_dtype):
    torch.manual_seed(bits * 1000 + (group or 0))
    # outliers and an all-zero group too: the eps clamp and the zero point's clamp are exercised
    w = torch.randn(96, 512) * 0.05
    w[3, 17] = 1.5
    w[5, :128] = 0.0
    w[7] = w[7].abs()  # an all-positive row: min(w, 0) = 0
    g = group or w.shape[1]
    scale, zero = choose_qparams(w, bits, g, symmetric, scale_dtype)
    q = quantize(w, scale, zero, bits, symmetric)
    t_scale, t_zero, t_q, t_deq = _torchao(w, bits, g, symmetric, scale_dtype)
    assert scale.dtype == t_scale.dtype == scale_dtype
    assert torch.equal(scale, t_scale.reshape(scale.shape))
    if symmetric:
        assert zero is None and bool((t_zero == 0).all())  # torchao's symmetric zero point is 0
    else:
        assert torch.equal(zero, t_zero.reshape(zero.shape).to(zero.dtype))
    assert torch.equal(q.to(torch.int32), t_q.to(torch.int32))
    assert torch.equal(dequantize(q, scale, zero), t_deq)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits,group", CASES)
def test_quantlinear_weight_equals_torchao_dequantized(bits, group, symmetric):
    torch.manual_seed(7)
    lin = torch.nn.Linear(256, 64, bias=False)
    layer = QuantLinear.from_linear(lin, bits, group, symmetric, scale_dtype=torch.bfloat16)
    *_, t_deq = _torchao(lin.weight.detach(), bits, group or 256, symmetric, torch.bfloat16)
    assert torch.equal(layer.dequantized_weight(), t_deq)
