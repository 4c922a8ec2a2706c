"""Precision 'auto' follows the measured step speed and never disturbs the run's RNG or gradients."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.engine import precision as prec
from lmforge.models import build_model

CPU = torch.device("cpu")


def test_explicit_names_pass_through_and_auto_without_model_is_fp32():
    for name in ("fp32", "bf16", "fp16"):
        assert prec.resolve_precision(name, CPU) == name
    assert prec.resolve_precision("auto", CPU) == "fp32"


def test_auto_follows_the_measurement(monkeypatch):
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(prec, "bf16_step_speedup", lambda *a, **k: 1.5)
    assert prec.resolve_precision("auto", CPU, model) == "bf16"
    monkeypatch.setattr(prec, "bf16_step_speedup", lambda *a, **k: 1.05)  # within noise: stay fp32
    assert prec.resolve_precision("auto", CPU, model) == "fp32"


def test_probe_leaves_rng_and_grads_alone():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="debug", vocab_size=64, max_seq_len=16, dropout=0.1))
    before = torch.get_rng_state()
    speedup = prec.bf16_step_speedup(model, 2, 16, 64, CPU)
    assert speedup > 0
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in model.parameters())
