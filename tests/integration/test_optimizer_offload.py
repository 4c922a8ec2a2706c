"""train.optimizer_offload=cpu (optim/offload.py): the update on host copies equals the plain optimizer's
(AdamW with clipping and accumulation, through lmforge's step), starts from weights changed between steps,
keeps the checkpoint layout (a run resumes with offload switched on or off), and refuses the layouts it
does not support."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.config import load_config
from lmforge.config.schema import ModelConfig
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.errors import ConfigError
from lmforge.metrics.loggers import read_metrics
from lmforge.models.transformer import Transformer
from lmforge.optim.offload import keep_offloaded, start_optimizer_offload
from lmforge.train.trainer import Trainer


def run_steps(offload: bool, steps: int = 4) -> tuple[dict, torch.optim.Optimizer, Transformer]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    stepped_on: list[bool] = []  # per step: did the optimizer step tensors other than the model's?
    if offload:
        keep_offloaded(opt, torch.device("cpu"))
        ids = {id(p) for p in model.parameters()}
        opt.register_step_pre_hook(lambda o, a, k: stepped_on.append(
            not any(id(p) in ids for g in o.param_groups for p in g["params"])))
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        micro = [torch.randint(0, 256, (2, 33), generator=g) for _ in range(2)]
        train_step(model, [(b[:, :-1], b[:, 1:]) for b in micro], opt, Precision("fp32", torch.device("cpu")),
                   grad_clip=0.5)
        if s == 1:  # the weights change outside the optimizer (a checkpoint load, a rollback)
            with torch.no_grad():
                model.norm.weight.mul_(0.9)
    assert stepped_on == ([True] * steps if offload else [])
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt, model


def test_equals_the_plain_optimizer():
    plain, plain_opt, _ = run_steps(False)
    offloaded, opt, model = run_steps(True)
    worst = max(float((plain[k] - offloaded[k]).abs().max()) for k in plain)
    assert worst <= 1e-6
    params = [p for g in opt.param_groups for p in g["params"]]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]  # the groups hold the model's
    assert set(map(id, opt.state)) == set(map(id, params))
    for p in params:  # the moments are host copies' (equal values, other storage than the plain run's)
        assert opt.state[p]["exp_avg"].shape == p.shape
    sd, plain_sd = opt.state_dict(), plain_opt.state_dict()
    assert sd["param_groups"] == plain_sd["param_groups"] and sd["state"].keys() == plain_sd["state"].keys()


def overrides(run, data, *extra):
    return tiny_overrides(run, data, "train.max_steps=6", "checkpoint.every=3", "train.eval_every=0",
                          "train.eval_batches=1", *extra)


@pytest.mark.parametrize("first,then", [("cpu", "cpu"), ("cpu", "none"), ("none", "cpu")])
def test_resumes_with_offload_on_or_off(tmp_path, shared_data_dir, first, then):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    Trainer(load_config(TINY, overrides(straight, shared_data_dir))).fit()
    with pytest.raises(Crash):
        Trainer(load_config(TINY, overrides(crashed, shared_data_dir, f"train.optimizer_offload={first}")),
                callbacks=[CrashAt(4)]).fit()
    Trainer(load_config(TINY, overrides(crashed, shared_data_dir, f"train.optimizer_offload={then}")),
            resume=True).fit()

    def curve(d):
        return [(r["step"], r["loss"]) for r in read_metrics(d / "metrics.jsonl") if "loss" in r]

    a, b = curve(straight), curve(crashed)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 7))
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) <= 1e-6


@pytest.mark.parametrize("dims,extra,message", [
    (dict(fsdp=True), {}, "use parallel.cpu_offload=true"),
    (dict(zero1=True), {}, "ZeRO-1"),
    (dict(tp=2), {}, "tensor"),
    ({}, {"master_weights": "fp32"}, "train.master_weights=fp32"),
])
def test_refusals(dims, extra, message):
    layout = SimpleNamespace(**{"fsdp": False, "zero1": False, "tp": 1, "pp": 1, "ep": 1, **dims})
    train = SimpleNamespace(**{"optimizer_offload": "cpu", "master_weights": "off", **extra})
    with pytest.raises(ConfigError, match=message):
        start_optimizer_offload(SimpleNamespace(train=train), layout, torch.device("cpu"), None)


def test_the_estimator_moves_the_optimizer_state_to_the_host():
    from lmforge.config.schema import Config
    from lmforge.tools.estimate import estimate

    _, opt, model = run_steps(True, steps=1)
    measured = sum(t.nbytes for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    base = {"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "max_seq_len": 32}}
    est = estimate(Config.model_validate({**base, "train": {"optimizer_offload": "cpu"}}), 1, "cuda")
    assert est.rows["optimizer state"] == 0 and est.host["optimizer state"] == measured
    weights = sum(p.nbytes for p in model.parameters())
    assert est.host["optimizer's host copies (weights + gradients)"] == 2 * weights
