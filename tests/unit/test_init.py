"""Initialisation schemes: each gives the standard deviations its paper prescribes."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.models import build_model

D, L = 256, 4


def model(init: str, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=D, n_layers=L, n_heads=4, vocab_size=4096, max_seq_len=16, init=init, **kw)
    return build_model(cfg)


def std(t: torch.Tensor) -> float:
    return t.detach().float().std().item()


def close(a: float, b: float) -> bool:
    return abs(a - b) / b < 0.03  # >= 65k samples per tensor: sampling error of a std is < 0.6%


def test_normal_scales_residual_projections():
    m = model("normal")
    assert close(std(m.layers[0].attn.wq.weight), 0.02)
    assert close(std(m.layers[0].attn.wo.weight), 0.02 / math.sqrt(2 * L))
    assert close(std(m.layers[1].mlp.w_down.weight), 0.02 / math.sqrt(2 * L))
    assert close(std(m.tok_embeddings.weight), 0.02)


def test_xavier_is_glorot_uniform():
    m = model("xavier")
    w = m.layers[0].mlp.w_up.weight  # (d_ff, d)
    fan_out, fan_in = w.shape
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    assert w.abs().max().item() <= bound
    assert close(std(w), bound / math.sqrt(3.0))


def test_kaiming_is_he_normal_fan_in():
    m = model("kaiming")
    w = m.layers[0].mlp.w_down.weight  # (d, d_ff): fan_in = d_ff
    assert close(std(w), math.sqrt(2.0 / w.shape[1]))
    assert close(std(m.layers[0].attn.wq.weight), math.sqrt(2.0 / D))


def test_small_init_embeddings_and_output():
    m = model("small_init", tie_embeddings=False)
    assert close(std(m.tok_embeddings.weight), 1e-4)
    assert close(std(m.output.weight), 1e-4)
    assert close(std(m.layers[0].attn.wk.weight), math.sqrt(2.0 / (5 * D)))
    assert close(std(m.layers[0].attn.wo.weight), 2.0 / (L * math.sqrt(D)))


@pytest.mark.parametrize("init", ["normal", "xavier", "kaiming", "small_init"])
def test_norms_and_biases(init):
    m = model(init, bias=True, norm="layernorm", mlp="gelu")
    for name, p in m.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        if "norm" in name and name.endswith("weight"):
            assert torch.all(p == 1), name
