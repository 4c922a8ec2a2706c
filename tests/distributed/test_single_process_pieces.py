"""Single-process pieces of the distributed layer: checkpoints written before optimizer state was
flattened still load, `parallelize` is a no-op layout for one process, threads per process."""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from dist_harness import make_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint.state_dict import get_state_dict

from lmforge.checkpoint.manager import load_states, param_shapes
from lmforge.engine.comm import LOCAL
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.models import build_model
from lmforge.optim.builder import build_optimizer
from lmforge.parallel import process_group as init
from lmforge.parallel.api import parallelize
from lmforge.parallel.dims import ParallelDims
from lmforge.parallel.world import World


def _trained():
    cfg = make_config({})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    x = torch.randint(0, 128, (2, 32))
    train_step(model, [(x, x)], opt, Precision("fp32", torch.device("cpu")), grad_clip=1.0)
    return cfg, model, opt


def test_format_1_checkpoint_with_nested_optimizer_state_loads(tmp_path):
    cfg, model, opt = _trained()
    model_sd, optim_sd = get_state_dict(model, [opt])  # format 1: nested, not flattened
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "state"))
    (tmp_path / "meta.json").write_text(json.dumps(
        {"format": 1, "step": 1, "world_size": 1, "param_shapes": param_shapes(model)}))
    torch.manual_seed(1)
    other = build_model(cfg.model)
    other_opt = build_optimizer(other, cfg.optim)
    assert load_states(tmp_path, other, other_opt) == 1
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], other_opt.state[q]["exp_avg"])


def test_one_process_layout_is_the_plain_step():
    cfg = make_config({"train": {"activation_checkpointing": "full"}})
    dims = ParallelDims.resolve(cfg.parallel, 1, cfg.model, 2)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    pm = parallelize(model, cfg, dims)
    assert pm.model is model and pm.comm is LOCAL and pm.pipeline is None
    assert dims.dp_rank == 0 and dims.dp_size == 1 and dims.is_last_stage and dims.is_logging_rank
    opt = build_optimizer(model, cfg.optim)
    assert pm.wrap_optimizer(opt) is opt
    assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == cfg.model.n_layers


def test_threads_split_between_local_processes(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    try:
        init._set_threads(World(0, 2, 0), torch.device("cpu"), None)
        assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)
        torch.set_num_threads(before)
        init._set_threads(World(0, 2, 0), torch.device("cpu"), 3)  # the user's train.threads wins
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_single_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    w = init.init_distributed(timeout_s=10)
    assert w.world_size == 1 and not torch.distributed.is_initialized()
