"""Run real multi-process jobs on gloo and the single-process reference they must equal.

`launch(n, scenarios, tmp)` starts n worker processes (this file run as a script) with the
environment torchrun gives its workers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT,
OMP_NUM_THREADS=1). Each worker joins one process group and runs every scenario in turn, each
with its own DeviceMesh and a freshly built model (so one start-up of torch serves many
scenarios: importing torch costs several seconds per process on a 2-core machine). Returns
{scenario name: [result of rank 0, rank 1, ...]}; a scenario that raised has {"error": text}.

`reference(spec)` trains the same model on the same global batches in this process with the
plain single-process `train_step`.

A scenario is a JSON-able dict: name; model / parallel / train / optim overrides of the tiny
model below; steps; rows (sequences per global micro-batch); clip; first_step (index of the
first batch, for resumed runs); save_at + save_dir (checkpoint after that many steps);
load_dir (resume from there first); defer (steps keep their loss on the device: train_step's defer);
probe_no_sync (record what each micro-batch's backward
left behind in the first step); export (write the consolidated safetensors file there);
eval (summed loss of one held-out global batch via evaluate_loss over the ParallelModel).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from lmforge.parallel.local_ranks import free_port, run_ranks  # noqa: F401 (free_port: for other tests)

TINY_MODEL = dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32,
                  tie_embeddings=False)
SEQ = 32
SRC = Path(__file__).resolve().parents[2] / "src"
CPU = torch.device("cpu")


def make_config(spec: dict):
    from lmforge.config.schema import Config

    return Config.model_validate({
        "model": {**TINY_MODEL, **spec.get("model", {})},
        "optim": {"lr": 1e-3, "weight_decay": 0.1, **spec.get("optim", {})},
        "train": {"grad_accum_steps": 2, "grad_clip": spec.get("clip", 0.5), "precision": "fp32",
                  **spec.get("train", {})},
        "parallel": spec.get("parallel", {}),
    })


def global_batches(spec: dict, step: int, n_micro: int,
                   vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's global micro-batches; uneven ignore masks make the global target count matter."""
    rows = spec.get("rows", 4)
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for k in range(n_micro):
        x = torch.randint(0, vocab, (rows, SEQ), generator=g)
        y = torch.randint(0, vocab, (rows, SEQ), generator=g)
        y[k % rows, : 8 + 5 * k] = -100
        out.append((x, y))
    return out


def reference(spec: dict, steps: int | None = None, load_dir: Path | None = None,
              first_step: int = 0) -> dict:
    """Single process, plain train_step on the whole global batch of every step (from step
    `first_step`, after loading checkpoint `load_dir` when given).

    Runs on one thread: the tiny model gains nothing from two, and a second OpenMP thread
    spinning beside other busy processes made a 0.1 s run take 8 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(spec, steps, load_dir, first_step)
    finally:
        torch.set_num_threads(threads)


def _reference(spec: dict, steps: int | None, load_dir: Path | None, first_step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lmforge.engine.objectives import build_objective
    from lmforge.engine.precision import Precision
    from lmforge.engine.step import train_step
    from lmforge.models import build_model
    from lmforge.optim.builder import build_optimizer
    from lmforge.parallel.checkpointing import apply_activation_checkpointing

    cfg = make_config(spec)
    torch.manual_seed(spec.get("seed", 0))
    model = build_model(cfg.model)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing, cfg.train.ac_every)
    opt = build_optimizer(model, cfg.optim)
    if load_dir is not None:
        from lmforge.checkpoint.manager import load_states

        load_states(load_dir, model, opt)
    losses, norms = [], []
    for step in range(first_step, first_step + (steps if steps is not None else spec["steps"])):
        batches = global_batches(spec, step, cfg.train.grad_accum_steps, cfg.model.vocab_size)
        r = train_step(model, batches, opt, Precision("fp32", CPU), grad_clip=cfg.train.grad_clip,
                       objective=build_objective(cfg))
        losses.append(r.loss)
        norms.append(r.grad_norm)
    from lmforge.data.batch import IGNORE_INDEX
    from lmforge.engine.loss import token_loss_sum

    x, y = global_batches(spec, 99, 1, cfg.model.vocab_size)[0]
    with torch.no_grad():
        held_out = (float(token_loss_sum(model(x), y)), int((y != IGNORE_INDEX).sum()))
    return {"losses": losses, "grad_norms": norms, "params": get_model_state_dict(model), "eval": held_out}


def merged_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """Union of every rank's gathered parameters; replicas (dp / tp peers, or ranks sharing a
    stage) must hold identical values."""
    full: dict[str, torch.Tensor] = {}
    for r in results:
        for k, v in r["params"].items():
            if k in full:
                assert torch.equal(full[k], v), f"replicas disagree on {k}"
            else:
                full[k] = v
    return full


def assert_matches(results: list[dict], ref: dict, loss_tol: float, norm_rtol: float,
                   param_tol: float) -> float:
    """Every rank reports the reference's losses and gradient norms (the whole job's), and the
    gathered parameters equal the reference's. Returns the largest parameter difference."""
    import pytest

    for r in results:
        assert "error" not in r, r.get("trace")
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], abs=loss_tol)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=norm_rtol)
    full = merged_params(results)
    assert set(full) == set(ref["params"])
    diff = max((full[k] - v).abs().max().item() for k, v in ref["params"].items())
    assert diff <= param_tol, f"parameters differ by {diff:.2e} > {param_tol:.0e}"
    return diff


def selected(request) -> list[tuple[str, dict]]:
    """(test function name, parameters) of every test of the requesting module that this session runs,
    after -m / -k deselection. A module fixture launches only the scenarios those tests check, so the
    slow tier's scenarios cost the default tier nothing and the other way round."""
    out = []
    for item in request.session.items:
        if item.module is request.module:
            callspec = getattr(item, "callspec", None)
            out.append((item.originalname, dict(callspec.params) if callspec else {}))
    return out


def launch(n: int, scenarios: list[dict], tmp: Path, timeout: float = 600.0) -> dict[str, list[dict]]:
    tmp.mkdir(parents=True, exist_ok=True)
    spec_file = tmp / "scenarios.json"
    spec_file.write_text(json.dumps(scenarios))
    env = {"OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    run_ranks(n, [sys.executable, __file__, str(spec_file), str(tmp)], tmp, env, timeout)
    per_rank = [torch.load(tmp / f"result_{r}.pt", weights_only=False) for r in range(n)]
    return {s["name"]: [res[s["name"]] for res in per_rank] for s in scenarios}


# ---- worker side ------------------------------------------------------------------------------

_REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")
_calls: dict[str, int] = {}


def _count_collectives() -> None:
    """Count the gradient-reduction collectives FSDP and our DDP hook issue (both go through
    torch.distributed's Python functions, looked up at call time)."""
    import torch.distributed as dist

    for name in _REDUCTIONS:
        fn = getattr(dist, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            _calls[_name] = _calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)


def _local_sq(model) -> tuple[int, float]:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = sum(float((g.to_local() if isinstance(g, DTensor) else g).double().square().sum()) for g in grads)
    return len(grads), sq


class _Probe:
    """Wraps a Comm: after each micro-batch's backward, records whether it synchronised."""

    def __init__(self, inner) -> None:
        self.inner, self.events = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def grad_sync(self, model, enabled):
        before = sum(_calls.values())
        with self.inner.grad_sync(model, enabled):
            yield
        n_set, sq = _local_sq(model)
        self.events.append({"sync": enabled, "reductions": sum(_calls.values()) - before,
                            "grads_set": n_set, "sq": sq})


def _run(spec: dict, world) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lmforge.checkpoint.manager import CheckpointManager, load_states
    from lmforge.engine.objectives import build_objective
    from lmforge.engine.precision import Precision
    from lmforge.models import build_model
    from lmforge.optim.builder import build_optimizer
    from lmforge.parallel.api import parallelize
    from lmforge.parallel.dims import ParallelDims

    cfg = make_config(spec)
    dims = ParallelDims.resolve(cfg.parallel, world.world_size, cfg.model, cfg.train.grad_accum_steps)
    dims.build_mesh("cpu")
    torch.manual_seed(spec.get("seed", 0))
    pm = parallelize(build_model(cfg.model), cfg, dims, "fp32", build_objective(cfg))
    opt = pm.wrap_optimizer(build_optimizer(pm.model, cfg.optim))
    if spec.get("count_twin"):
        # What a CUDA (NCCL) job sums its target counts over: a gloo twin of the dp group, forced here
        # where the dp group is gloo already.
        from lmforge.parallel.process_group import host_twin

        pm.comm.count_group = host_twin(pm.comm.dp_group, force=True)
    if spec.get("load_dir"):
        load_states(Path(spec["load_dir"]), pm.model, opt)
    probe = None
    if spec.get("probe_no_sync"):
        probe = pm.comm = _Probe(pm.comm)
    first = spec.get("first_step", 0)
    losses, norms, deferred = [], [], []
    for step in range(first, first + spec["steps"]):
        batches = global_batches(spec, step, cfg.train.grad_accum_steps, cfg.model.vocab_size)
        b = batches[0][0].shape[0] // dims.dp_size
        rows = slice(dims.dp_rank * b, (dims.dp_rank + 1) * b)
        local = [(x[rows], y[rows]) for x, y in batches]
        r = pm.step(local, opt, Precision("fp32", CPU), grad_clip=cfg.train.grad_clip,
                    defer=spec.get("defer", False))
        deferred.append(not r.settled)
        if probe is not None:
            pm.comm, probe_events = probe.inner, probe.events
            probe = None
        losses.append(r.loss)
        norms.append(r.grad_norm)
        if spec.get("save_at") == step + 1:
            CheckpointManager(Path(spec["save_dir"]), keep_last=2, rank=world.rank,
                              world_size=world.world_size).save(step + 1, pm.model, opt, {})
    if spec.get("export"):
        from lmforge.parallel.export import save_consolidated

        save_consolidated(pm.model, Path(spec["export"]), dims)
    extra = {}
    if spec.get("eval"):
        x, y = global_batches(spec, 99, 1, cfg.model.vocab_size)[0]
        b = x.shape[0] // dims.dp_size
        rows = slice(dims.dp_rank * b, (dims.dp_rank + 1) * b)
        from lmforge.engine.evaluate import evaluate_loss

        # The Trainer's validation path: each dp rank its own rows, sums over the job.
        ev = evaluate_loss(pm, [(x[rows], y[rows])], pm.objective, pm.comm, precision=Precision("fp32", CPU))
        extra["eval"] = (ev["loss"] * ev["tokens"], ev["tokens"])
    out = {**extra, "losses": losses, "grad_norms": norms, "deferred": deferred, "dp_rank": dims.dp_rank,
           "pp_rank": dims.pp_rank, "tp_rank": dims.tp_rank,
           "params": get_model_state_dict(pm.model, options=StateDictOptions(full_state_dict=True))}
    if spec.get("probe_no_sync"):
        out["no_sync"] = probe_events
    if spec.get("count_twin"):
        import torch.distributed as dist

        out["count_group"] = {"ranks": dist.get_process_group_ranks(pm.comm.count_group),
                              "dp_ranks": dist.get_process_group_ranks(pm.comm.dp_group),
                              "distinct": pm.comm.count_group is not pm.comm.dp_group,
                              "backend": dist.get_backend(pm.comm.count_group)}
    if cfg.parallel.ep > 1:  # what this rank itself holds of each expert tensor
        out["local_experts"] = {k: p.to_local().detach().clone() for k, p in pm.model.named_parameters()
                                if ".experts." in k}
    return out


def _worker(spec_file: str, out_dir: str) -> None:
    from lmforge.parallel.process_group import init_distributed, shutdown

    _count_collectives()
    scenarios = json.loads(Path(spec_file).read_text())
    # Generous: a rank compiling (zero3_ac_compile) or importing on a busy 2-core machine keeps the
    # others waiting inside a collective for tens of seconds.
    world = init_distributed(timeout_s=300)
    results = {}
    for spec in scenarios:
        t0 = time.perf_counter()
        try:
            results[spec["name"]] = {**_run(spec, world), "seconds": time.perf_counter() - t0}
        except Exception as e:
            results[spec["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    torch.save(results, Path(out_dir) / f"result_{world.rank}.pt")
    shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
