"""Optimizers: lion and adafactor match their reference implementations step by step, the adamw
path is unchanged, sgd/adam get their hyperparameters, state_dict round trips continue identically,
and optimizer-state memory per parameter matches the textbook figures."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from lmforge.config import ModelConfig
from lmforge.config.optim import optim_config
from lmforge.models import build_model
from lmforge.optim.adafactor import Adafactor
from lmforge.optim.builder import build_optimizer, param_groups, state_bytes_per_param
from lmforge.optim.lion import Lion


class Tiny(nn.Module):
    """Embedding (2-D, no decay), a linear with bias (2-D decayed + 1-D), a norm (1-D)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.lin = nn.Linear(8, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 11, bias=False)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.lin(self.emb(x)))))


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def loss_at(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 11, (4, 5), generator=g)
    y = torch.randint(0, 11, (4, 5), generator=g)
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def run(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        opt.zero_grad(set_to_none=True)
        loss_at(model, s).backward()
        opt.step()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_lion_matches_lion_pytorch():
    lion_pytorch = pytest.importorskip("lion_pytorch")
    a, b = tiny(), tiny()
    ours = Lion(param_groups(a, 0.5), lr=1e-3, betas=(0.9, 0.99))
    ref = lion_pytorch.Lion(param_groups(b, 0.5), lr=1e-3, betas=(0.9, 0.99))
    for s in range(20):
        run(a, ours, range(s, s + 1))
        run(b, ref, range(s, s + 1))
        assert max_diff(a, b) <= 1e-6, f"step {s}"
    assert max_diff(a, tiny()) > 1e-3  # it moved


def test_lion_via_config_decays_only_matrices():
    model = tiny()
    opt = build_optimizer(model, optim_config(name="lion", lr=1e-3, betas=(0.9, 0.99), weight_decay=0.2))
    assert isinstance(opt, Lion)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("beta1", [None, 0.9])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adafactor_matches_transformers(beta1, wd):
    from transformers.optimization import Adafactor as HFAdafactor

    a, b = tiny(), tiny()
    kw = dict(lr=1e-2, beta1=beta1, scale_parameter=False, relative_step=False, warmup_init=False)
    ours = Adafactor(param_groups(a, wd), **kw)
    ref = HFAdafactor(param_groups(b, wd), **kw)
    for s in range(20):
        run(a, ours, range(s, s + 1))
        run(b, ref, range(s, s + 1))
        assert max_diff(a, b) <= 1e-6, f"step {s}"
    assert max_diff(a, tiny()) > 1e-3
    # both factored (2-D) and unfactored (1-D) state were exercised
    keys = set().union(*(st.keys() for st in ours.state.values()))
    assert {"exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"} <= keys
    assert ("exp_avg" in keys) == (beta1 is not None)


@pytest.mark.parametrize("warmup_init", [False, True])
def test_adafactor_relative_step_matches_transformers(warmup_init):
    from transformers.optimization import Adafactor as HFAdafactor

    a, b = tiny(), tiny()
    kw = dict(lr=None, scale_parameter=True, relative_step=True, warmup_init=warmup_init)
    ours = Adafactor(param_groups(a, 0.0), **kw)
    ref = HFAdafactor(param_groups(b, 0.0), **kw)
    for s in range(20):
        run(a, ours, range(s, s + 1))
        run(b, ref, range(s, s + 1))
        assert max_diff(a, b) <= 1e-6, f"step {s}"


def test_adafactor_via_config():
    cfg = optim_config(
        name="adafactor", lr=1e-2, adafactor={"beta1": 0.9, "clip_threshold": 2.0, "decay_rate": -0.7}
    )
    opt = build_optimizer(tiny(), cfg)
    assert isinstance(opt, Adafactor)
    g = opt.param_groups[0]
    assert (g["lr"], g["beta1"], g["clip_threshold"], g["decay_rate"]) == (1e-2, 0.9, 2.0, -0.7)
    assert (g["relative_step"], g["scale_parameter"], g["warmup_init"]) == (False, False, False)
    rel = build_optimizer(
        tiny(), optim_config(name="adafactor", adafactor={"relative_step": True, "scale_parameter": True})
    )
    assert rel.param_groups[0]["lr"] is None and rel.param_groups[0]["relative_step"]


def test_adamw_path_unchanged():
    a, b = tiny(), tiny()
    cfg = optim_config(lr=1e-2, weight_decay=0.1)
    assert cfg.name == "adamw"
    ours = build_optimizer(a, cfg)
    ref = torch.optim.AdamW(param_groups(b, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    assert type(ours) is torch.optim.AdamW and ours.defaults["fused"] is True
    run(a, ours, range(10))
    run(b, ref, range(10))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_sgd_and_adam_hyperparameters():
    cfg = optim_config(name="sgd", lr=0.1, sgd={"momentum": 0.8, "nesterov": True}, weight_decay=0.01)
    sgd = build_optimizer(tiny(), cfg)
    assert type(sgd) is torch.optim.SGD
    g = sgd.param_groups
    assert (g[0]["lr"], g[0]["momentum"], g[0]["nesterov"]) == (0.1, 0.8, True)
    assert [x["weight_decay"] for x in g] == [0.01, 0.0]
    cfg = optim_config(name="adam", lr=1e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    adam = build_optimizer(tiny(), cfg)
    assert type(adam) is torch.optim.Adam  # L2 decay, not decoupled
    g = adam.param_groups
    assert (g[0]["lr"], g[0]["betas"], g[0]["eps"]) == (1e-3, (0.8, 0.9), 1e-6)
    assert [x["weight_decay"] for x in g] == [0.05, 0.0]
    # and they train identically to hand-built torch optimizers on the same groups
    a, b = tiny(), tiny()
    run(a, build_optimizer(a, optim_config(name="adam", lr=1e-2, weight_decay=0.1, fused=False)), range(5))
    run(b, torch.optim.Adam(param_groups(b, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8), range(5))
    assert max_diff(a, b) == 0.0


def test_config_validation():
    with pytest.raises(ValidationError, match="nesterov"):
        optim_config(name="sgd", sgd={"momentum": 0.0, "nesterov": True})
    with pytest.raises(ValidationError, match="warmup_init"):
        optim_config(name="adafactor", adafactor={"warmup_init": True})
    with pytest.raises(ValidationError, match="fused"):
        optim_config(name="lion", fused=True)
    with pytest.raises(ValidationError):
        optim_config(name="adagrad")
    with pytest.raises(ValidationError):
        optim_config(name="adafactor", adafactor={"decay_rate": 0.5})


@pytest.mark.parametrize(
    "cfg",
    [
        optim_config(name="lion", lr=1e-3, weight_decay=0.3),
        optim_config(name="adafactor", lr=1e-2, adafactor={"beta1": 0.9}, weight_decay=0.1),
        optim_config(name="adafactor", adafactor={"relative_step": True, "scale_parameter": True}),
    ],
    ids=["lion", "adafactor", "adafactor-relative"],
)
def test_state_dict_round_trip_continues_identically(cfg):
    a = tiny()
    opt_a = build_optimizer(a, cfg)
    run(a, opt_a, range(5))
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(opt_a.state_dict())
    run(a, opt_a, range(5, 12))

    b = tiny(seed=7)
    b.load_state_dict(saved_model)
    opt_b = build_optimizer(b, cfg)
    opt_b.load_state_dict(saved_opt)
    run(b, opt_b, range(5, 12))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "cfg, expect",
    [
        (optim_config(name="sgd", sgd={"momentum": 0.0}), (0.0, 0.0)),
        (optim_config(name="sgd", sgd={"momentum": 0.9}), (4.0, 4.0)),
        (optim_config(name="adam"), (8.0, 8.01)),
        (optim_config(name="adamw"), (8.0, 8.01)),
        (optim_config(name="lion"), (4.0, 4.0)),
        (optim_config(name="adafactor"), (0.0, 1.0)),
    ],
    ids=["sgd", "sgd-momentum", "adam", "adamw", "lion", "adafactor"],
)
def test_state_bytes_per_param(cfg, expect):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="debug", vocab_size=256))
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, 256, (2, 16))
    out = model(x)
    logits = out if isinstance(out, torch.Tensor) else out[0]
    nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    opt.step()
    measured = state_bytes_per_param(opt)
    label = f"{cfg.name} momentum={cfg.sgd.momentum}" if cfg.name == "sgd" else cfg.name
    print(f"{label}: {measured:.4f} bytes of optimizer state per parameter")
    lo, hi = expect
    if lo == hi:
        assert measured == pytest.approx(lo, abs=1e-3)
    else:
        assert lo < measured < hi


@pytest.mark.parametrize("name", ["lion", "adafactor", "sgd"])
def test_checkpoint_manager_round_trip(tmp_path, name):
    from lmforge.checkpoint.manager import CheckpointManager

    cfg = optim_config(name=name, lr=1e-2, **({"adafactor": {"beta1": 0.9}} if name == "adafactor" else {}))
    a = tiny()
    opt_a = build_optimizer(a, cfg)
    run(a, opt_a, range(4))
    path = CheckpointManager(tmp_path, keep_last=1).save(4, a, opt_a, {})
    b = tiny(seed=3)
    opt_b = build_optimizer(b, cfg)
    CheckpointManager(tmp_path, keep_last=1).load(path, b, opt_b, {})
    run(a, opt_a, range(4, 8))
    run(b, opt_b, range(4, 8))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["lion", "adafactor"])
def test_trainer_runs_with(tiny_cfg, name):
    """End to end through the trainer (schedule writes group["lr"] every step, checkpoint at the end)."""
    from lmforge.metrics.loggers import read_metrics
    from lmforge.train.trainer import train

    cfg = tiny_cfg(f"optim.name={name}", "optim.lr=1e-3", "train.max_steps=12", "train.log_every=4")
    train(cfg)
    losses = [r["loss"] for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl") if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
