"""Feed-forward blocks: SwiGLU (Llama), GeGLU (Gemma) or a two-layer GELU MLP (erf, or GPT-2's tanh
approximation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.models.common.linear import project


class MLP(nn.Module):
    """swiglu: w_down(silu(w_gate x) * w_up x); geglu: w_down(gelu_tanh(w_gate x) * w_up x);
    gelu / gelu_tanh: w_down(gelu(w_up x)).

    Parameter names are part of the checkpoint format: `w_gate` (swiglu and geglu only), `w_up`, `w_down`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, ff = cfg.d_model, cfg.resolved_d_ff
        self.kind = cfg.mlp
        self.gated = self.kind in ("swiglu", "geglu")
        if self.gated:
            self.w_gate = nn.Linear(d, ff, bias=cfg.bias)
        self.w_up = nn.Linear(d, ff, bias=cfg.bias)
        self.w_down = nn.Linear(ff, d, bias=cfg.bias)
        # "tanh" is GPT-2's gelu_new; "none" is the exact erf form.
        self.approximate = "tanh" if self.kind in ("gelu_tanh", "geglu") else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, d_model)
        if self.kind == "swiglu":
            gate, up = project(x, (self.w_gate, self.w_up))  # (B, T, d_ff) each
            h = F.silu(gate) * up
        elif self.kind == "geglu":
            gate, up = project(x, (self.w_gate, self.w_up))  # (B, T, d_ff) each
            h = F.gelu(gate, approximate="tanh") * up
        else:
            h = F.gelu(self.w_up(x), approximate=self.approximate)  # (B, T, d_ff)
        return self.w_down(h)
