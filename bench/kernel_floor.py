"""How fast could a training step be? Every kernel of one step, timed alone: the bound on the ratio
against a baseline that no framework work (Python, autograd, dispatch, allocation) can beat.

    .venv/bin/python bench/kernel_floor.py --nanogpt ~/nanoGPT     # nanoGPT's CPU shape (~1 minute)
    .venv/bin/python bench/kernel_floor.py --nanogpt ~/nanoGPT --json out.json

Shape: `train_throughput.py`'s `nanogpt` (nanoGPT's documented CPU run: 4 layers, 4 heads, 128 wide,
64-token context, batch 12, vocab 65) with lmforge's GPT-2 layout on both sides, fp32, the sides of that
bench: lmforge's `lmforge train` step (fused AdamW, clip 1.0) and nanoGPT's own model and loop step
(`bench/nanogpt_ref.py`; a checkout the user provides).

Method:
1. Kernels: after the warm-up, one step of each side runs under a `TorchDispatchMode` that records
   every aten op it dispatches (forward, the autograd backward, clipping and the optimizer) with
   copies of its inputs.
2. Step time: four sides interleaved, one call each per round, medians (as `train_throughput.py`):
   each tool's step, and each tool's recorded ops replayed in their order on the copies ("replay": the
   same kernels on the same operand sizes with no Python model code, no autograd engine and no
   optimizer logic around them). step - replay is what the framework itself costs.
3. Each recorded op run alone on its copies (3 warm-up calls, then the median of 15): its kernel time
   with the operands hot in cache and nothing around it. Ops are grouped as GEMM (mm, addmm, bmm,
   baddbmm), attention (scaled_dot_product_*) and the rest (element-wise, norms, reductions, the
   loss, the optimizer, copies, views). replay - (sum alone) is what running them one after another
   costs: operands that come from memory instead of cache, thread wake-ups, fresh outputs.
4. Bounds on lmforge / baseline (the issue's ratio), all with the baseline's measured step:
   - `replayed kernels`: lmforge's step cut to its replay, the framework at zero.
   - `eager kernels`: lmforge's step cut to the sum of its own kernels timed alone, hot in cache and
     with nothing between them: out of reach of any real step that runs those kernels.
   - `GEMM + attention`: everything but lmforge's GEMMs and attention free as well, as if every
     element-wise op, norm, loss and optimizer update were fused away into nothing. No real step
     reaches it; a target above it needs faster GEMMs than the BLAS torch calls, or less arithmetic.
Never asserts on speed; prints machine info and the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, print_markdown_table  # noqa: E402  (bench/machine.py)
from nanogpt_ref import (  # noqa: E402  (bench/nanogpt_ref.py)
    build_nanogpt,
    find_nanogpt,
    gpt2_config,
    load_nanogpt,
    nanogpt_optimizer,
    nanogpt_stepper,
)
from train_throughput import SHAPES, assemble, batches_of, interleave, stepper  # noqa: E402

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addmv", "addbmm"}


def kind_of(op_name: str) -> str:
    """"gemm", "attention" or "other" for an aten op's name (overload packet, e.g. "mm")."""
    if op_name in GEMMS:
        return "gemm"
    return "attention" if "scaled_dot_product" in op_name else "other"


def _copy(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


class Recorder(TorchDispatchMode):
    """Records every aten op dispatched inside it: (op, copies of its args and kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, tree_map(_copy, args), tree_map(_copy, kwargs)))
        return func(*args, **kwargs)


def replayer(calls: list[tuple]):
    """A side for `interleave` that runs the recorded ops in order (returns a dummy loss)."""
    def run(i: int) -> float:
        for func, args, kwargs in calls:
            func(*args, **kwargs)
        return 0.0

    return run


def record_step(step) -> list[tuple]:
    """The aten ops of one call of `step` (its argument 0), in dispatch order."""
    rec = Recorder()
    with rec:
        step(0)
    return rec.calls


def op_seconds(func, args, kwargs, warmup: int = 3, reps: int = 15) -> float:
    """Median seconds of `func(*args, **kwargs)` alone (in-place ops run on the recorded copies again)."""
    for _ in range(warmup):
        func(*args, **kwargs)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        func(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_times(calls: list[tuple]) -> dict:
    """{"gemm"|"attention"|"other": seconds, "ops": {kind: count}, "top": [(op, calls, seconds)]}: every
    recorded op timed alone, summed by kind."""
    by_kind: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    by_op: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for func, args, kwargs in calls:
        name = func.overloadpacket.__name__
        s = op_seconds(func, args, kwargs)
        kind = kind_of(name)
        by_kind[kind] += s
        counts[kind] += 1
        by_op[name][0] += 1
        by_op[name][1] += s
    top = sorted(((k, n, s) for k, (n, s) in by_op.items()), key=lambda t: -t[2])
    return {**{k: by_kind.get(k, 0.0) for k in ("gemm", "attention", "other")}, "ops": dict(counts),
            "top": top[:12]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", default=None, metavar="PATH",
                   help="a nanoGPT checkout (default: $LMFORGE_NANOGPT)")
    p.add_argument("--rounds", type=int, default=120, help="interleaved rounds of the step timing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root, why = find_nanogpt(args.nanogpt)
    if root is None:
        print(f"skipped: {why}")
        return 2
    s = SHAPES["nanogpt"]
    cfg = gpt2_config(s["n_layers"], s["n_heads"], s["d_model"], s["seq_len"], s["vocab"])
    data, batches = batches_of(cfg.vocab_size, s["batch"], s["seq_len"])
    cpu = torch.device("cpu")
    run = assemble(cfg, data)
    torch.manual_seed(0)
    nano = build_nanogpt(load_nanogpt(root), cfg, cpu)
    sides = {"lmforge": stepper(run, batches),
             "nanogpt": nanogpt_stepper(nano, nanogpt_optimizer(nano, cpu), contextlib.nullcontext, batches)}
    info = machine_info(threads=torch.get_num_threads())
    print(json.dumps(info))
    for i in range(s["warmup"]):
        for fn in sides.values():
            fn(i)
    calls = {k: record_step(fn) for k, fn in sides.items()}
    timing = interleave({**sides, **{f"{k}_replay": replayer(c) for k, c in calls.items()}}, 2, args.rounds,
                        None, 1024)
    step_ms = {k: statistics.median(v) * 1e3 for k, v in timing["times"].items()}
    kernels = {k: kernel_times(c) for k, c in calls.items()}

    rows = []
    for k in sides:
        kt = kernels[k]
        total = (kt["gemm"] + kt["attention"] + kt["other"]) * 1e3
        replay = step_ms[f"{k}_replay"]
        rows.append([k, str(sum(kt["ops"].values())), f"{step_ms[k]:.2f}", f"{replay:.2f}",
                     f"{step_ms[k] - replay:.2f}", f"{kt['gemm'] * 1e3:.2f}", f"{kt['attention'] * 1e3:.2f}",
                     f"{kt['other'] * 1e3:.2f}", f"{total:.2f}", f"{replay - total:.2f}"])
    print(f"\nnanoGPT shape, fp32, {torch.get_num_threads()} threads, {len(timing['peaks'])} rounds "
          "(ms per step)")
    print_markdown_table(["side", "aten ops", "step", "replay", "framework", "alone: GEMM", "attention",
                          "other", "all", "in sequence"], rows)
    base = step_ms["nanogpt"]
    lm = kernels["lmforge"]
    bounds = {
        "measured": base / step_ms["lmforge"],
        "replayed kernels": base / step_ms["lmforge_replay"],
        "eager kernels": base / ((lm["gemm"] + lm["attention"] + lm["other"]) * 1e3),
        "GEMM + attention": base / ((lm["gemm"] + lm["attention"]) * 1e3),
    }
    print("\nlmforge / nanoGPT: measured, and the bounds (nanoGPT's measured step over lmforge's floor)")
    print_markdown_table(["", "ratio"], [[k, f"{v:.3f}"] for k, v in bounds.items()])
    print("\nlmforge's costliest ops (alone, per step)")
    print_markdown_table(["op", "calls", "ms"], [[n, str(c), f"{t * 1e3:.2f}"] for n, c, t in lm["top"]])
    if args.json:
        out = dict(machine=info, step_ms=step_ms, bounds=bounds,
                   kernels={k: {kk: vv for kk, vv in v.items()} for k, v in kernels.items()},
                   rounds=len(timing["peaks"]), nanogpt_checkout=str(root))
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
