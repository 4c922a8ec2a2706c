"""Each optimizer's memory facts live on its spec (optim/memory.py, OptimizerSpec.memory): the state each
parameter tensor gets equals what the real optimizer allocates for that tensor, and the planner reads
the facts without importing torch."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from lmforge.config.optim import OPTIMIZER_CONFIGS
from lmforge.config.schema import Config
from lmforge.engine.loss import token_loss_sum
from lmforge.models.transformer import build_model
from lmforge.optim.builder import SPECS, build_optimizer
from lmforge.optim.memory import MEMORY
from lmforge.optim.muon import hidden_matrices

TINY = dict(d_model=64, n_layers=1, n_heads=4, vocab_size=300, max_seq_len=32)


@dataclass
class Shape:
    shape: tuple[int, ...]
    local: int
    hidden: bool

    @property
    def numel(self) -> int:
        return self.local


def test_every_optimizer_spec_carries_its_memory_facts():
    assert SPECS.keys() == MEMORY.keys() == OPTIMIZER_CONFIGS.keys()
    assert all(SPECS[name].memory is MEMORY[name] for name in SPECS)


@pytest.mark.parametrize("optim", [
    {"name": "adamw"}, {"name": "adam", "fused": False}, {"name": "sgd"},
    {"name": "sgd", "sgd": {"momentum": 0.0}}, {"name": "lion"}, {"name": "adafactor"},
    {"name": "adafactor", "adafactor": {"beta1": 0.9}},
    {"name": "adamw8bit", "adamw8bit": {"block_size": 64, "min_size": 1024}}, {"name": "sophia"},
    {"name": "muon"},
])
def test_each_tensors_state_is_what_the_optimizer_allocates(optim):
    cfg = Config.model_validate({"model": TINY, "optim": optim}).optim
    torch.manual_seed(0)
    model = build_model(Config.model_validate({"model": TINY}).model)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, 300, (2, 8))
    token_loss_sum(model(x), x).backward()
    opt.step()
    hidden = {id(p) for p in hidden_matrices(model)}
    facts = SPECS[cfg.name].memory
    for name, p in model.named_parameters():
        real = sum(v.numel() * v.element_size() for v in opt.state[p].values() if isinstance(v, torch.Tensor))
        assert facts.state_bytes(Shape(tuple(p.shape), p.numel(), id(p) in hidden), cfg, "cpu") == real, name
    assert facts.step_copies(cfg) >= 0


def test_the_planner_reads_the_facts_without_importing_torch():
    code = ("import sys, lmforge.tools.estimate, lmforge.optim.memory; "
            "print('torch' in sys.modules, 'lmforge.optim.builder' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
