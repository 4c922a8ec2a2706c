"""Per-rank memory and communication of each parallel strategy, and the pipeline bubble.

    .venv/bin/python bench/parallel_memory.py                 # ~1-2 minutes on 2 cores
    .venv/bin/python bench/parallel_memory.py --steps 8 --bubble-steps 12

Starts 2 gloo worker processes (this file with --worker, the environment torchrun would give
them, 1 OpenMP thread each) that train the same model with each strategy: DDP, ZeRO-1, ZeRO-2,
ZeRO-3, TP (+ sequence parallel), PP (1F1B). The baseline is the same model in one process.

Measured per rank, from the tensors themselves (exact, unlike RSS on a shared machine):
  params     bytes of the parameters this rank holds between steps (a DTensor's local shard)
  grads      bytes of the gradients present when the optimizer steps
  optim      bytes of the optimizer state (ZeRO-1: the local optimizer's)
  gathered   bytes of whole (unsharded) FSDP parameters still held when forward ends: the
             difference between ZeRO-2 (kept for backward) and ZeRO-3 (re-gathered)
  comm       bytes this rank sends per optimizer step, from every c10d / functional collective
             seen by a TorchDispatchMode: ring all-reduce 2(k-1)/k N, all-gather and
             reduce-scatter (k-1)/k N (N = whole tensor), broadcast (k-1) N from the root,
             send N. Medians over --steps steps (all identical here: no data-dependent comm).

Pipeline bubble: for PP = 2 with GPipe and 1F1B and m = 2, 4, 8 micro-batches, each rank's busy
time (its stages' forward and backward compute, timed around PipelineStage.forward_one_chunk /
backward_one_chunk) against the step's wall time; idle = 1 - busy / wall, median over steps,
mean over ranks, next to the textbook (p-1)/(m+p-1). Idle time also holds send/recv and the
optimizer step, so the measured fraction sits above the textbook one by a fixed part.

Writes bench/results/parallel_memory.json (machine, model, rows, raw per-step numbers).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096, max_seq_len=128,
             tie_embeddings=False)
SEQ, ROWS, MICRO = 128, 8, 2  # global rows per micro-batch, micro-batches per step
STRATEGIES = {
    "DDP": {"dp_replicate": 2},
    "ZeRO-1": {"dp_shard": 2, "zero": 1},
    "ZeRO-2": {"dp_shard": 2, "zero": 2},
    "ZeRO-3": {"dp_shard": 2, "zero": 3},
    "TP": {"tp": 2, "sequence_parallel": True},
    "PP": {"pp": 2, "pp_schedule": "1f1b"},
}
BUBBLE = [(kind, m) for kind in ("gpipe", "1f1b") for m in (2, 4, 8)]


def make_config(parallel: dict, micro: int = MICRO):
    from lmforge.config.schema import Config

    return Config.model_validate({
        "model": MODEL, "optim": {"lr": 1e-3, "weight_decay": 0.1},
        "train": {"grad_accum_steps": micro, "grad_clip": 1.0, "precision": "fp32"}, "parallel": parallel,
    })


def batches(step: int, micro: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randint(0, MODEL["vocab_size"], (rows, SEQ), generator=g),
             torch.randint(0, MODEL["vocab_size"], (rows, SEQ), generator=g)) for _ in range(micro)]


# ---- measurement ------------------------------------------------------------------------------

def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _group_size_rank(pg) -> tuple[int, int]:
    import torch.distributed as dist

    if isinstance(pg, str):  # functional collectives name their group
        pg = dist.distributed_c10d._resolve_process_group(pg)
    elif not isinstance(pg, dist.ProcessGroup):
        pg = dist.ProcessGroup.unbox(pg)
    return pg.size(), pg.rank()


class CommBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes this rank sends through collectives, by op, under the ring model."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, float] = {}

    def _add(self, name: str, n: float) -> None:
        self.sent[name] = self.sent.get(name, 0.0) + n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ns, name = func.namespace, func.__name__.split(".")[0]
        if ns == "c10d":
            self._c10d(name, args)
        elif ns == "_c10d_functional":
            self._functional(name, args)
        return out

    def _c10d(self, name, args) -> None:
        def nbytes(ts) -> int:
            return sum(t.numel() * t.element_size() for t in (ts if isinstance(ts, (list, tuple)) else [ts]))

        if name == "allreduce_":
            k, _ = _group_size_rank(args[1])
            self._add("all_reduce", 2 * (k - 1) / k * nbytes(args[0]))
        elif name == "_allgather_base_":
            k, _ = _group_size_rank(args[2])
            self._add("all_gather", (k - 1) / k * nbytes(args[0]))
        elif name == "_reduce_scatter_base_":
            k, _ = _group_size_rank(args[2])
            self._add("reduce_scatter", (k - 1) / k * nbytes(args[1]))
        elif name == "broadcast_":
            k, r = _group_size_rank(args[1])
            self._add("broadcast", (k - 1) * nbytes(args[0]) if r == args[2] else 0.0)
        elif name == "send":
            self._add("send", nbytes(args[0]))

    def _functional(self, name, args) -> None:
        t = args[0]
        n = t.numel() * t.element_size()
        if name == "all_reduce":
            k, _ = _group_size_rank(args[2])
            self._add("all_reduce", 2 * (k - 1) / k * n)
        elif name == "all_gather_into_tensor":
            k, _ = _group_size_rank(args[2])
            self._add("all_gather", (k - 1) * n)  # input is 1/k of the gathered tensor
        elif name == "reduce_scatter_tensor":
            k, _ = _group_size_rank(args[3])
            self._add("reduce_scatter", (k - 1) / k * n)


def _memory(model, optimizer, grads_at_step: list[int], gathered: list[int]) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = sum(_local_bytes(p) for p in model.parameters())
    opt = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    state = sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    return {"params": params, "grads": statistics.median(grads_at_step), "optim": state,
            "gathered": statistics.median(gathered) if gathered else 0}


def _instrument(pm, optimizer) -> tuple[list[int], list[int]]:
    """Record grad bytes when the optimizer steps, and whole parameters left when forward ends."""
    from torch.distributed.tensor import DTensor

    grads, gathered = [], []
    inner_step = optimizer.step

    def step(*a, **k):
        grads.append(sum(_local_bytes(p.grad) for p in pm.model.parameters() if p.grad is not None))
        return inner_step(*a, **k)

    optimizer.step = step

    def after_forward(module, inputs, output):
        # FSDP swaps a module's parameters to whole plain tensors while they are gathered.
        gathered.append(sum(p.numel() * p.element_size() for p in module.parameters()
                            if not isinstance(p, DTensor)))

    if pm.dims.fsdp:
        for part in pm.parts:
            part.register_forward_hook(after_forward)
    return grads, gathered


def assemble(parallel: dict, micro: int = MICRO):
    """The run `lmforge train` would assemble for this layout (no run dir; the bench feeds its own
    batches, so the data handed over only has to exist)."""
    from lmforge.assembly import build_run

    ids = list(range(MODEL["vocab_size"])) * 4
    return build_run(make_config(parallel, micro), "experiment", train_data=[ids], say=lambda *_: None)


def run_strategy(name: str, parallel: dict, steps: int, world) -> dict:
    run = assemble(parallel)
    cfg, dims, pm, optimizer, precision = run.cfg, run.dims, run.parallel, run.optimizer, run.precision
    grads, gathered = _instrument(pm, optimizer)
    b = ROWS // dims.dp_size
    comm, seconds = [], []
    for step in range(steps + 1):  # step 0 warms up (lazy init, first-call metadata exchange)
        local = [(x[dims.dp_rank * b:(dims.dp_rank + 1) * b], y[dims.dp_rank * b:(dims.dp_rank + 1) * b])
                 for x, y in batches(step, MICRO, ROWS)]
        mode = CommBytes()
        t0 = time.perf_counter()
        with mode:
            pm.step(local, optimizer, precision, grad_clip=cfg.train.grad_clip)
        if step:
            seconds.append(time.perf_counter() - t0)
            comm.append(mode.sent)
    out = _memory(pm.model, optimizer, grads[1:], gathered[MICRO:])
    out["comm"] = {k: statistics.median(c.get(k, 0.0) for c in comm) for k in set().union(*comm)}
    out["comm_total"] = statistics.median(sum(c.values()) for c in comm)
    out["step_s"] = statistics.median(seconds)
    return out


def run_bubble(kind: str, m: int, steps: int, world) -> dict:
    run = assemble({"pp": 2, "pp_schedule": kind}, micro=m)
    cfg, pm, optimizer, precision = run.cfg, run.parallel, run.optimizer, run.precision
    busy = [0.0]
    stage = pm.pipeline.schedule._stage
    for meth in ("forward_one_chunk", "backward_one_chunk"):
        inner = getattr(stage, meth)

        def timed(*a, _inner=inner, **k):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                busy[0] += time.perf_counter() - t0

        setattr(stage, meth, timed)
    idle = []
    for step in range(steps + 1):
        busy[0] = 0.0
        t0 = time.perf_counter()
        pm.step(batches(step, m, 2), optimizer, precision, grad_clip=cfg.train.grad_clip)
        wall = time.perf_counter() - t0
        if step:
            idle.append(1.0 - busy[0] / wall)
    return {"idle": statistics.median(idle), "theory": (2 - 1) / (m + 2 - 1), "raw": idle}


# ---- processes ----------------------------------------------------------------------------------

def worker(args) -> None:
    from lmforge.parallel.process_group import init_distributed, shutdown

    world = init_distributed(timeout_s=300)
    out = {"strategies": {}, "bubble": {}}
    for name, parallel in STRATEGIES.items():
        out["strategies"][name] = run_strategy(name, parallel, args.steps, world.world_size)
    for kind, m in BUBBLE:
        out["bubble"][f"{kind}/m={m}"] = run_bubble(kind, m, args.bubble_steps, world.world_size)
    torch.save(out, Path(args.out) / f"rank_{world.rank}.pt")
    shutdown()


def launch(args, tmp: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--out", str(tmp),
                                       "--steps", str(args.steps), "--bubble-steps", str(args.bubble_steps)],
                                      env=env))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a worker failed")
    return [torch.load(tmp / f"rank_{r}.pt", weights_only=False) for r in range(2)]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--bubble-steps", type=int, default=6)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import tempfile

    torch.set_num_threads(1)
    load_start = os.getloadavg()
    base = run_strategy("single process", {}, args.steps, 1)
    with tempfile.TemporaryDirectory() as d:
        ranks = launch(args, Path(d))
    mib = lambda b: f"{b / 2**20:.2f}"
    base_total = base["params"] + base["grads"] + base["optim"]
    rows = [["strategy", "rank", "params MiB", "grads MiB", "optim MiB", "P+G+O MiB", "vs 1 proc",
             "gathered MiB", "sent MiB/step", "step s"]]
    rows.append(["1 process", "-", mib(base["params"]), mib(base["grads"]), mib(base["optim"]),
                 mib(base_total), "1.00", "-", "0", f"{base['step_s']:.3f}"])
    for name in STRATEGIES:
        for r, res in enumerate(ranks):
            m = res["strategies"][name]
            total = m["params"] + m["grads"] + m["optim"]
            rows.append([name, str(r), mib(m["params"]), mib(m["grads"]), mib(m["optim"]), mib(total),
                         f"{total / base_total:.2f}", mib(m["gathered"]), mib(m["comm_total"]),
                         f"{m['step_s']:.3f}"])
    print(table(rows))
    brows = [["schedule", "m", "idle rank0", "idle rank1", "(p-1)/(m+p-1)"]]
    for kind, m in BUBBLE:
        key = f"{kind}/m={m}"
        brows.append([kind, str(m), *(f"{res['bubble'][key]['idle']:.3f}" for res in ranks),
                      f"{ranks[0]['bubble'][key]['theory']:.3f}"])
    print()
    print(table(brows))
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
                    "date": _dt.datetime.now().isoformat(timespec="seconds"),
                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "model": MODEL, "seq": SEQ, "rows_per_microbatch": ROWS, "microbatches": MICRO,
        "single_process": base, "ranks": ranks,
    }
    out = ROOT / "bench" / "results" / "parallel_memory.json"
    out.write_text(json.dumps(result, indent=1, default=float))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
