"""What `logging.monitor.pipeline_bubble` costs a CPU pipeline run: logging on vs off, interleaved.

    .venv/bin/python bench/pipeline_bubble_cost.py                 # 2 gloo ranks, ~2 min on 2 cores
    .venv/bin/python bench/pipeline_bubble_cost.py --rounds 12 --shapes demo

Two ranks (parallel.pp=2, the default 1F1B schedule, --micro micro-batches of 4 rows) build the pipeline
`lmforge train` builds (parallel.parallelize) and run windows of --window steps. A round runs each side
once, in an order that rotates: `off` the pipeline as built; `on` the same pipeline with the timer
attached (parallel/pipeline_timing.attach: every stage call and the loss wrapped, the schedule's step
timed) and its value taken at the window's end (one all-reduce of two numbers), then detached again.
Reported per shape: the median window of each side, the overhead median(on) / median(off) - 1, the
direct cost of `take` (the log step's all-reduce) as a share of a window, and the logged bubble.
`tiny` / `demo` are bench/monitoring_cost.py's model shapes. Writes bench/results/pipeline_bubble_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "pipeline_bubble_cost.json"
SHAPES = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, vocab_size=512),
    "demo": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256, vocab_size=4096),
}
ROWS = 4
WRAPPED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "step", "_compute_loss")


def build(shape: str, micro: int, world_size: int):
    from lmforge.config.schema import Config
    from lmforge.engine.objectives import build_objective
    from lmforge.engine.precision import Precision
    from lmforge.models import build_model
    from lmforge.optim.builder import build_optimizer
    from lmforge.parallel.api import parallelize
    from lmforge.parallel.dims import ParallelDims

    cfg = Config.model_validate({"model": SHAPES[shape], "optim": {"lr": 1e-3},
                                 "train": {"grad_accum_steps": micro, "precision": "fp32", "grad_clip": 1.0},
                                 "parallel": {"pp": 2, "dp_shard": 1}})
    dims = ParallelDims.resolve(cfg.parallel, world_size, cfg.model, micro)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    pm = parallelize(build_model(cfg.model), cfg, dims, "fp32", build_objective(cfg))
    return pm, pm.wrap_optimizer(build_optimizer(pm.model, cfg.optim)), Precision("fp32", torch.device("cpu"))


def detach(pipeline) -> None:
    """Undo pipeline_timing.attach: the instance attributes it set go, the class methods show again."""
    schedule = pipeline.schedule
    for obj in [*(getattr(schedule, "_stages", None) or [schedule._stage]), schedule]:
        for name in WRAPPED:
            obj.__dict__.pop(name, None)


def measure(shape: str, args, world) -> dict:
    from lmforge.parallel.pipeline_timing import attach

    pm, optimizer, precision = build(shape, args.micro, world.world_size)
    seq, vocab = SHAPES[shape]["max_seq_len"], SHAPES[shape]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, vocab, (ROWS, seq), generator=g), torch.randint(0, vocab, (ROWS, seq),
                                                                                  generator=g))
               for _ in range(args.micro)]

    def window(on: bool) -> tuple[float, float, float | None]:
        timer = attach(pm.pipeline, torch.device("cpu")) if on else None
        t0 = time.perf_counter()
        for _ in range(args.window):
            pm.step(batches, optimizer, precision, grad_clip=1.0)
        t1 = time.perf_counter()
        bubble = timer.take() if on else None
        t2 = time.perf_counter()
        if on:
            detach(pm.pipeline)
        return t2 - t0, t2 - t1, bubble

    window(False)  # warm-up: the stages' first-call shape exchange
    sides: dict[str, list[float]] = {"off": [], "on": []}
    takes, bubbles = [], []
    for r in range(args.rounds):
        for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
            seconds, take, bubble = window(side == "on")
            sides[side].append(seconds)
            if side == "on":
                takes.append(take)
                bubbles.append(bubble)
    off, on = statistics.median(sides["off"]), statistics.median(sides["on"])
    return {"window_s": {"off": off, "on": on}, "overhead": on / off - 1,
            "take_share": statistics.median(takes) / off, "bubble": statistics.median(bubbles),
            "raw": {**sides, "bubbles": bubbles}}


def worker(args) -> None:
    from lmforge.parallel.process_group import init_distributed, shutdown

    torch.set_num_threads(1)
    world = init_distributed(timeout_s=600)
    out = {shape: measure(shape, args, world) for shape in args.shapes}
    shutdown()
    if world.rank == 0:
        Path(args.out).write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import os
    import tempfile

    sys.path.insert(0, str(HERE))
    from lmforge.parallel.local_ranks import run_ranks
    from machine import machine_info, print_markdown_table

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--rounds", str(args.rounds),
               "--window", str(args.window), "--micro", str(args.micro), "--shapes", *args.shapes]
        load = os.getloadavg()[0]
        run_ranks(2, cmd, Path(tmp), {"OMP_NUM_THREADS": "1"}, timeout=1800)
        res = json.loads(out.read_text())
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine_info(), "load_at_start": load, "args": vars(args),
                                   "results": res}, indent=1))
    headers = ["shape", "window off (s)", "window on (s)", "on/off - 1", "take() share", "bubble"]
    rows = []
    for shape, r in res.items():
        rows.append([shape, f"{r['window_s']['off']:.3f}", f"{r['window_s']['on']:.3f}",
                     f"{100 * r['overhead']:+.2f}%", f"{100 * r['take_share']:.3f}%", f"{r['bubble']:.3f}"])
    print_markdown_table(headers, rows)
    print(f"load average at start {load:.1f}; wrote {RESULTS}")


if __name__ == "__main__":
    main()
