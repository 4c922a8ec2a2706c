"""`train.keep_host_memory`: lmforge's CPU train step with freed host memory kept for reuse, against
glibc's default allocator behaviour, each in its own processes.

    .venv/bin/python bench/host_memory.py                          # shapes nanogpt, a, nanochat (~3 min)
    .venv/bin/python bench/host_memory.py --shapes a --processes 6 --steps 40

The setting is process-wide (glibc's mallopt), so the two sides cannot share a process: per shape,
`--processes` pairs of fresh processes run one after the other, the order alternating per pair. Each
builds the run `lmforge train` assembles for the shape (`train_throughput.py`'s shapes: `nanogpt` is
nanoGPT's CPU shape in the GPT-2 layout, `a` the small Llama layout, `nanochat` lmforge's model of
that row with optim.name=muon; fp32, the torch default thread count), takes 3 warm-up steps and times
`--steps` steps, all inside `keep_freed_memory(enabled)` (what `Trainer.fit` holds around its loop),
and reports its median step, its minor page faults per step and its peak resident memory (VmHWM).
Reported per shape: the median over processes of each side's medians and the ratio default / kept
(> 1: keeping is faster). Never asserts on speed.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SHAPES = ("nanogpt", "a", "nanochat")
STEPS = {"nanogpt": 60, "a": 40, "nanochat": 8}


def worker(shape: str, keep: bool, steps: int) -> dict:
    """One process's measurement (printed as JSON by --worker)."""
    sys.path.insert(0, str(HERE))
    import torch

    import nanochat_ref
    import train_throughput as tt
    from lmforge.utils.host_memory import keep_freed_memory
    from nanogpt_ref import gpt2_config

    s = tt.SHAPES[shape]
    dims = (s["n_layers"], s["n_heads"], s["d_model"], s["seq_len"], s["vocab"])
    optim = None
    if shape == "nanogpt":
        cfg = gpt2_config(*dims)
    elif shape == "nanochat":
        cfg, optim = nanochat_ref.lmforge_config(*dims), {"name": "muon"}
    else:
        cfg = tt.lmforge_config(s)
    data, batches = tt.batches_of(cfg.vocab_size, s["batch"], s["seq_len"])
    with keep_freed_memory(keep) as took:
        run = tt.assemble(cfg, data, optim=optim)
        step = tt.stepper(run, batches)
        for i in range(3):
            step(i)
        times = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for i in range(steps):
            t0 = time.perf_counter()
            step(3 + i)
            times.append(time.perf_counter() - t0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return dict(shape=shape, keep=keep, took_effect=took, threads=torch.get_num_threads(),
                median_ms=statistics.median(times) * 1e3, faults_per_step=faults / steps,
                peak_rss_mib=peak_rss())


def peak_rss_mib_of(status: str) -> float:
    """VmHWM (the process's peak resident memory) of a /proc/PID/status text, in MiB."""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss() -> float:
    try:
        return peak_rss_mib_of(Path("/proc/self/status").read_text())
    except OSError:
        return float("nan")


def spawn(shape: str, keep: bool, steps: int) -> dict:
    mode = "keep" if keep else "default"
    out = subprocess.run([sys.executable, __file__, "--worker", shape, mode, str(steps)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    p.add_argument("--processes", type=int, default=4, help="process pairs per shape")
    p.add_argument("--steps", type=int, default=None, help="timed steps per process (default: per shape)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", nargs=3, metavar=("SHAPE", "MODE", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        shape, mode, steps = args.worker
        print(json.dumps(worker(shape, mode == "keep", int(steps))))
        return 0
    sys.path.insert(0, str(HERE))
    from machine import machine_info, print_markdown_table

    info = machine_info()
    print(json.dumps(info), flush=True)
    results = {}
    for shape in args.shapes.split(","):
        steps = args.steps or STEPS[shape]
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for i in range(args.processes):
            for keep in ((True, False) if i % 2 == 0 else (False, True)):
                runs[keep].append(spawn(shape, keep, steps))
        side = {("kept" if keep else "default"): dict(
            median_ms=statistics.median(r["median_ms"] for r in rs),
            faults_per_step=statistics.median(r["faults_per_step"] for r in rs),
            peak_rss_mib=statistics.median(r["peak_rss_mib"] for r in rs),
            per_process_ms=[r["median_ms"] for r in rs], took_effect=all(r["took_effect"] for r in rs))
            for keep, rs in runs.items()}
        side["ratio"] = side["default"]["median_ms"] / side["kept"]["median_ms"]
        results[shape] = side
        print(f"[{shape}] default {side['default']['median_ms']:.1f} ms, kept "
              f"{side['kept']['median_ms']:.1f} ms: {side['ratio']:.3f}x", flush=True)
    print(f"\nlmforge train step, glibc defaults vs train.keep_host_memory (fp32, {args.processes} process "
          "pairs per shape, medians)")
    print_markdown_table(
        ["shape", "default ms", "faults/step", "peak RSS MiB", "kept ms", "faults/step", "peak RSS MiB",
         "speed-up"],
        [[k, f"{v['default']['median_ms']:.1f}", f"{v['default']['faults_per_step']:.0f}",
          f"{v['default']['peak_rss_mib']:.0f}", f"{v['kept']['median_ms']:.1f}",
          f"{v['kept']['faults_per_step']:.0f}", f"{v['kept']['peak_rss_mib']:.0f}", f"{v['ratio']:.3f}x"]
         for k, v in results.items()])
    if not all(v["kept"]["took_effect"] for v in results.values()):
        print("note: not glibc: keep_freed_memory did nothing here")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(machine=info, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
