"""What each `logging.monitor` metric costs a CPU training run: logging on vs off, interleaved.

    .venv/bin/python bench/monitoring_cost.py                 # tiny + demo shapes, ~2 min on 2 cores
    .venv/bin/python bench/monitoring_cost.py --rounds 12 --shapes demo

Per shape (`tiny`: configs/debug/tiny.yaml's model, 8 x 64 tokens a step; `demo`: configs/demo.yaml's
model, 8 x 256: half its batch, to keep the run near 2 minutes), the run `lmforge train` assembles
takes windows of `--window` steps (train.log_every's default, 10), one torch thread (--threads).
Each side is a window of steps plus what one metric adds to such a window in the trainer,
through the same code (train/monitor.py): `off` nothing; `param_norm` one norm of all weights at the log
step; `data_time` the clock read around every step's batches and the window's sum; `grad_sync_time` the
DDP hook's timer calls (one bucket a step: these models fit DDP's first 25 MiB bucket; the all-reduce
itself is paid with or without the timer); `checkpoint_time` two clock reads around a save (one window);
`attention_entropy` one extra forward of one row (logging.monitor.attention_entropy_tokens) with the
layer's probabilities, at every log step (attention_entropy_every = the window; its direct share is also
given for 10 windows). Rounds run every side once in an
order that rotates; reported per side: the median window, the overhead (median(on) / median(off) - 1),
and the direct cost: the median time of the metric's own work alone, as a share of a window (the A/B
overhead is below the noise of a shared machine for most; the direct cost is not). `memory` is CUDA only
(torch.cuda.memory_stats at the log step) and is not measured on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train_throughput as tt  # noqa: E402
from lmforge.config.model import ModelConfig  # noqa: E402
from lmforge.config.schema import Config  # noqa: E402
from lmforge.data.batch import TokenBatch  # noqa: E402
from lmforge.engine.comm import LOCAL  # noqa: E402
from lmforge.parallel.data_parallel import SyncTimer  # noqa: E402
from lmforge.train.monitor import Monitor, param_norm  # noqa: E402
from machine import machine_info, print_markdown_table  # noqa: E402

RESULTS = HERE / "results" / "monitoring_cost.json"
SHAPES = {
    "tiny": dict(model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, vocab_size=512),
                 batch=8),
    "demo": dict(model=dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256,
                            vocab_size=4096), batch=8),
}
ENTROPY_EVERY_WINDOWS = 10
SIDES = ("off", "param_norm", "data_time", "grad_sync_time", "checkpoint_time", "attention_entropy")


def shape_sides(name: str, window: int):
    """(sides: name -> fn(round) running one window, direct: name -> fn() running the metric alone)."""
    s = SHAPES[name]
    cfg = ModelConfig(**s["model"])
    data, raw = tt.batches_of(cfg.vocab_size, s["batch"], cfg.max_seq_len)
    batches = [TokenBatch(x, y) for x, y in raw]
    run = tt.assemble(cfg, data)
    def monitor(**keys) -> tuple[Config, Monitor]:
        config = Config.model_validate({"model": cfg.model_dump(), "train": {"log_every": window},
                                        "logging": {"monitor": {"param_norm": False, **keys}}})
        return config, Monitor(config, run.model, LOCAL, torch.device("cpu"))

    _, mon = monitor()  # data time alone (and samples/s, which has no switch)
    config, ent = monitor(attention_entropy_every=window)
    timer = SyncTimer()

    def steps(i: int, per_step=None) -> None:
        for j in range(window):
            if per_step is not None:
                per_step(j)
            run.parallel.step([batches[(i * window + j) % len(batches)]], run.optimizer, run.precision,
                              grad_clip=1.0)

    def data_step(j: int) -> None:
        t0 = time.perf_counter()
        batch = [batches[j % len(batches)]]
        mon.batches(batch, time.perf_counter() - t0, j + 1)

    def sync_step(j: int) -> None:  # noqa: ARG001
        timer.launched()
        timer.done()
        timer.end_step()

    def entropy() -> float:
        ent._entropy_row = batches[0].input_ids[:1, : config.logging.monitor.attention_entropy_tokens]
        return ent._entropy()

    def save_clock() -> float:
        t0 = time.perf_counter()
        return time.perf_counter() - t0

    direct = {
        "param_norm": lambda: param_norm(run.model, LOCAL),
        "data_time": lambda: [data_step(j) for j in range(window)] and mon.collect(1.0),
        "grad_sync_time": lambda: [sync_step(j) for j in range(window)] and timer.take(),
        "checkpoint_time": save_clock,
        "attention_entropy": entropy,
    }
    sides = {
        "off": lambda i: steps(i),
        "param_norm": lambda i: (steps(i), direct["param_norm"]()),
        "data_time": lambda i: (steps(i, data_step), mon.collect(1.0)),
        "grad_sync_time": lambda i: (steps(i, sync_step), timer.take()),
        "checkpoint_time": lambda i: (steps(i), save_clock()),
        "attention_entropy": lambda i: (steps(i), entropy()),  # every log step: its worst case
    }
    return sides, direct


def bench_shape(name: str, rounds: int, window: int) -> dict:
    sides, direct = shape_sides(name, window)
    sides["off"](1)  # warm-up: one window of steps, and every metric's own work once
    for fn in direct.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    order = list(sides)
    for r in range(rounds):
        k = r % len(order)
        for side in order[k:] + order[:k]:
            t0 = time.perf_counter()
            sides[side](r)
            times[side].append(time.perf_counter() - t0)
    off = statistics.median(times["off"])
    out = {"window_steps": window, "rounds": rounds, "off_window_s": off}
    for side in SIDES[1:]:
        med = statistics.median(times[side])
        op = statistics.median(_timed(direct[side]) for _ in range(7))
        out[side] = {"window_s": med, "overhead_ab": med / off - 1, "direct_s": op, "direct_share": op / off}
        if side == "attention_entropy":
            every = ENTROPY_EVERY_WINDOWS * window
            out[side][f"direct_share_every_{every}"] = op / off / ENTROPY_EVERY_WINDOWS
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="tiny,demo")
    p.add_argument("--rounds", type=int, default=None, help="rounds per shape (default: tiny 20, demo 2)")
    p.add_argument("--window", type=int, default=10, help="steps per window (train.log_every)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (configs/debug/tiny.yaml's 1)")
    p.add_argument("--json", default=str(RESULTS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = machine_info(threads=torch.get_num_threads())
    print(json.dumps(info), flush=True)
    results = {"machine": info, "shapes": {}}
    rows = []
    for name in args.shapes.split(","):
        rounds = args.rounds or {"tiny": 20, "demo": 2}[name]
        res = results["shapes"][name] = bench_shape(name, rounds, args.window)
        for side in SIDES[1:]:
            r = res[side]
            rows.append([name, side, f"{res['off_window_s'] * 1e3:.1f}", f"{r['window_s'] * 1e3:.1f}",
                         f"{r['overhead_ab']:+.2%}", f"{r['direct_s'] * 1e3:.3f}",
                         f"{r['direct_share']:.3%}"])
    results["loadavg_at_end"] = list(os.getloadavg())
    print_markdown_table(["shape", "metric", "off ms/window", "on ms/window", "on/off - 1", "direct ms",
                          "direct share"], rows)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
