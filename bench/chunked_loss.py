"""Memory and time of the loss alone: F.linear + F.cross_entropy vs chunked_linear_cross_entropy.

    .venv/bin/python bench/chunked_loss.py              # shapes a and b, ~7.5 minutes on 2 busy cores
    .venv/bin/python bench/chunked_loss.py --rounds 3   # ~6 minutes
    .venv/bin/python bench/chunked_loss.py --shapes b --chunk 256 --mem-repeats 1

Both sides compute the summed fp32 cross-entropy of hidden (N, d) @ weight (V, d).T against random
targets (every 10th ignored) and its gradients with respect to hidden and weight, fp32 on CPU:
  plain    loss = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum"); loss.backward()
  chunked  loss = chunked_linear_cross_entropy(h, w, t, chunk_tokens); loss.backward()

Peak memory: each measurement is a fresh process (this file with --mem-worker) that allocates the
inputs, records ru_maxrss, runs one forward + backward and records ru_maxrss again; the growth is what
the loss needed at its peak (logits, log-probabilities, their gradient, the parameter gradients).
--mem-repeats processes per side, interleaved plain/chunked, medians reported. Linux carries a
process's RSS high-water mark into its child's ru_maxrss across exec, so each worker is started
through a small Python trampoline process (checked against /proc/self/status VmHWM, the worker's own
address space's mark, which is recorded too).

Time: in this process, --warmup untimed forward + backward per side, then --rounds rounds of one
forward + backward per side (the order alternates every round); median per side, ratio = chunked / plain.
Before timing, the two sides' losses and gradients are checked to agree (rtol 1e-5).

A whole training step as `lmforge train` runs it (--steps): the run `build_run` assembles for a small
Llama-layout model with a 32k vocabulary (d 256, 2 layers, 8 x 512 tokens, fp32 AdamW), once with
train.loss_chunk_tokens=0 and once with 1024; each side in fresh processes (interleaved), peak RSS
growth over setup of its first optimizer step (which also allocates the gradients and AdamW's moments,
the same on both sides) and the median time of the following steps.

Writes bench/results/chunked_loss.json (machine, shapes, raw numbers) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lmforge.engine.chunked_loss import chunked_linear_cross_entropy
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

# a: a realistic small-model pretraining shape (8 x 1024 tokens, a 32k vocabulary, d 512);
# b: GPT-2's vocabulary with a larger width and fewer tokens
SHAPES = {
    "a": dict(n=8 * 1024, d=512, v=32000, chunk=1024),
    "b": dict(n=2 * 1024, d=768, v=50257, chunk=512),
}
STEP_SHAPE = dict(d_model=256, n_layers=2, n_heads=4, vocab=32000, seq=512, batch=8, chunk=1024)
RESULTS = Path(__file__).resolve().parent / "results" / "chunked_loss.json"
IGNORE = -100
# the worker's parent: exec records the exec-ing process's RSS high-water mark in ru_maxrss, so the
# worker must not be exec'ed straight from this (large) process
TRAMPOLINE = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def make_inputs(s: dict, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s["n"], s["d"], generator=g).requires_grad_()
    weight = (0.02 * torch.randn(s["v"], s["d"], generator=g)).requires_grad_()
    targets = torch.randint(0, s["v"], (s["n"],), generator=g)
    targets[::10] = IGNORE
    return hidden, weight, targets


def step(variant: str, hidden, weight, targets, chunk: int) -> float:
    """One forward + backward of the loss; the gradients land in hidden.grad and weight.grad."""
    if variant == "plain":
        logits = F.linear(hidden, weight).float()  # (N, V)
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    else:
        loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk, ignore_index=IGNORE)
    loss.backward()
    return loss.item()


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def vmhwm_mib() -> float:
    """This address space's own RSS high-water mark (ru_maxrss also holds the parent's, see below)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def mem_worker(args) -> int:
    """Fresh process: peak RSS growth of one forward + backward, printed as one JSON line."""
    torch.set_num_threads(args.threads)
    s = dict(SHAPES[args.shape], chunk=args.chunk or SHAPES[args.shape]["chunk"])
    hidden, weight, targets = make_inputs(s)
    setup, setup_hwm = maxrss_mib(), vmhwm_mib()
    step(args.mem_worker, hidden, weight, targets, s["chunk"])
    after, after_hwm = maxrss_mib(), vmhwm_mib()
    res = dict(setup_mib=setup, after_mib=after, growth_mib=after - setup)
    res.update(setup_vmhwm_mib=setup_hwm, after_vmhwm_mib=after_hwm, growth_vmhwm_mib=after_hwm - setup_hwm)
    print(json.dumps(res))
    return 0


def step_worker(args) -> int:
    """Fresh process: one run assembled as `lmforge train` would; peak RSS growth of its first step and
    the time of the next ones, printed as one JSON line."""
    import numpy as np

    from lmforge.assembly import build_run
    from lmforge.config.schema import Config

    torch.set_num_threads(args.threads)
    s = STEP_SHAPE
    chunk = s["chunk"] if args.step_worker == "chunked" else 0
    cfg = Config.model_validate({
        "model": {"d_model": s["d_model"], "n_layers": s["n_layers"], "n_heads": s["n_heads"],
                  "vocab_size": s["vocab"], "max_seq_len": s["seq"], "tie_embeddings": False},
        "train": {"micro_batch_size": s["batch"], "precision": "fp32", "loss_chunk_tokens": chunk},
    })
    ids = np.random.default_rng(0).integers(0, s["vocab"], size=s["batch"] * s["seq"] * 8 + 1)
    run = build_run(cfg, "experiment", train_data=[ids], say=lambda *_: None)
    batches = [run.train_loader.next_batch() for _ in range(args.steps + 1)]
    setup, setup_hwm = maxrss_mib(), vmhwm_mib()
    first = run.parallel.step([batches[0]], run.optimizer, run.precision, grad_clip=1.0)
    after, after_hwm = maxrss_mib(), vmhwm_mib()
    times = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        run.parallel.step([b], run.optimizer, run.precision, grad_clip=1.0)
        times.append(time.perf_counter() - t0)
    print(json.dumps(dict(setup_mib=setup, growth_mib=after - setup, setup_vmhwm_mib=setup_hwm,
                          growth_vmhwm_mib=after_hwm - setup_hwm, first_loss=first.loss,
                          step_s_median=statistics.median(times), step_s=times)))
    return 0


def measure_step(repeats: int, steps: int, threads: int) -> dict:
    raw: dict[str, list[dict]] = {"plain": [], "chunked": []}
    for r in range(repeats):
        for variant in ("plain", "chunked") if r % 2 == 0 else ("chunked", "plain"):
            cmd = [sys.executable, "-c", TRAMPOLINE, sys.executable, __file__, "--step-worker", variant,
                   "--steps", str(steps), "--threads", str(threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            m = json.loads(out.stdout.strip().splitlines()[-1])
            if m["setup_mib"] > m["setup_vmhwm_mib"] + 16:
                raise RuntimeError(f"worker ru_maxrss starts at the parent's high-water mark: {m}")
            raw[variant].append(m)
            print(f"[step] {variant}: first step +{m['growth_mib']:.0f} MiB, loss {m['first_loss']:.6f}, "
                  f"{1e3 * m['step_s_median']:.0f} ms/step", flush=True)
    res: dict = {"shape": STEP_SHAPE}
    for k, v in raw.items():
        res[k] = dict(growth_mib_median=statistics.median(x["growth_mib"] for x in v),
                      step_ms_median=1e3 * statistics.median(x["step_s_median"] for x in v), raw=v)
    res["memory_ratio"] = res["chunked"]["growth_mib_median"] / res["plain"]["growth_mib_median"]
    res["time_ratio"] = res["chunked"]["step_ms_median"] / res["plain"]["step_ms_median"]
    first = {k: raw[k][0]["first_loss"] for k in raw}
    res["first_loss_rel_diff"] = abs(first["chunked"] - first["plain"]) / abs(first["plain"])
    return res


def measure_memory(name: str, chunk: int, repeats: int, threads: int) -> dict:
    raw: dict[str, list[dict]] = {"plain": [], "chunked": []}
    for r in range(repeats):
        for variant in ("plain", "chunked") if r % 2 == 0 else ("chunked", "plain"):
            cmd = [sys.executable, "-c", TRAMPOLINE, sys.executable, __file__, "--mem-worker", variant]
            cmd += ["--shape", name]
            cmd += ["--chunk", str(chunk), "--threads", str(threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            m = json.loads(out.stdout.strip().splitlines()[-1])
            # a high-water mark inherited from a big parent would hide the growth: refuse it
            if m["setup_mib"] > m["setup_vmhwm_mib"] + 16:
                raise RuntimeError(f"worker ru_maxrss starts at the parent's high-water mark: {m}")
            raw[variant].append(m)
            print(f"[{name}] memory {variant}: +{raw[variant][-1]['growth_mib']:.0f} MiB", flush=True)
    res: dict = {}
    for k, v in raw.items():
        res[k] = dict(growth_mib_median=statistics.median(x["growth_mib"] for x in v), raw=v)
    res["ratio"] = res["chunked"]["growth_mib_median"] / res["plain"]["growth_mib_median"]
    return res


def check_same(s: dict) -> dict:
    """Both sides give the same loss and gradients on these inputs (fp32 rounding only)."""
    out = {}
    for variant in ("plain", "chunked"):
        hidden, weight, targets = make_inputs(s)
        loss = step(variant, hidden, weight, targets, s["chunk"])
        out[variant] = (loss, hidden.grad, weight.grad)
    (lp, hp, wp), (lc, hc, wc) = out["plain"], out["chunked"]
    torch.testing.assert_close(lc, lp, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(hc, hp, rtol=1e-5, atol=1e-5 * float(hp.abs().max()))
    torch.testing.assert_close(wc, wp, rtol=1e-5, atol=1e-5 * float(wp.abs().max()))
    return dict(
        loss_plain=lp,
        loss_chunked=lc,
        max_abs_grad_hidden_diff=float((hc - hp).abs().max()),
        max_abs_grad_weight_diff=float((wc - wp).abs().max()),
    )


def measure_time(name: str, s: dict, rounds: int, warmup: int) -> dict:
    hidden, weight, targets = make_inputs(s)

    def run(variant: str) -> float:
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        step(variant, hidden, weight, targets, s["chunk"])
        return time.perf_counter() - t0

    for _ in range(warmup):
        run("plain")
        run("chunked")
    times: dict[str, list[float]] = {"plain": [], "chunked": []}
    for r in range(rounds):
        for variant in ("plain", "chunked") if r % 2 == 0 else ("chunked", "plain"):
            times[variant].append(run(variant))
        print(f"[{name}] round {r}: plain {times['plain'][-1]:.2f} s, chunked {times['chunked'][-1]:.2f} s",
              flush=True)
    res: dict = {k: dict(median_ms=1e3 * statistics.median(v), raw_s=v) for k, v in times.items()}
    res["ratio"] = res["chunked"]["median_ms"] / res["plain"]["median_ms"]
    return res


def print_table(results: dict) -> None:
    headers = ["shape", "N", "d", "V", "chunk", "N x V fp32 MiB", "plain +MiB", "chunked +MiB", "mem ratio",
               "plain ms", "chunked ms", "time ratio"]
    rows = []
    for name, r in results.items():
        s, m, t = r["shape"], r["memory"], r["time"]
        rows.append([
            name, str(s["n"]), str(s["d"]), str(s["v"]), str(s["chunk"]),
            f"{s['n'] * s['v'] * 4 / 2**20:.0f}",
            f"{m['plain']['growth_mib_median']:.0f}", f"{m['chunked']['growth_mib_median']:.0f}",
            f"{m['ratio']:.3f}", f"{t['plain']['median_ms']:.0f}", f"{t['chunked']['median_ms']:.0f}",
            f"{t['ratio']:.3f}",
        ])
    print_markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="a,b", help="comma-separated subset of: " + ",".join(SHAPES))
    p.add_argument("--chunk", type=int, default=None, help="chunk_tokens (default: per shape, a 1024, b 512)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per shape")
    p.add_argument("--warmup", type=int, default=1, help="untimed forward + backward per side")
    p.add_argument("--mem-repeats", type=int, default=3, help="fresh processes per side for peak memory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--steps", type=int, default=3, help="timed training steps per worker in the step "
                   "measurement (0: skip it)")
    p.add_argument("--mem-worker", choices=["plain", "chunked"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--step-worker", choices=["plain", "chunked"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mem_worker:
        return mem_worker(args)
    if args.step_worker:
        return step_worker(args)

    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    for n in names:
        if n not in SHAPES:
            p.error(f"unknown shape {n!r}; choose from {', '.join(SHAPES)}")
    machine = machine_info(threads=args.threads)
    print(f"machine: {machine}", flush=True)
    shapes = {n: dict(SHAPES[n], chunk=args.chunk or SHAPES[n]["chunk"]) for n in names}
    # every memory worker first, before this process holds gigabytes
    results: dict[str, dict] = {}
    step = measure_step(args.mem_repeats, args.steps, args.threads) if args.steps else None
    for n, s in shapes.items():
        results[n] = dict(shape=s, memory=measure_memory(n, s["chunk"], args.mem_repeats, args.threads))
    for n, s in shapes.items():
        t0 = time.perf_counter()
        check = check_same(s)
        print(f"[{n}] same loss and gradients: {check}", flush=True)
        timing = measure_time(n, s, args.rounds, args.warmup)
        results[n].update(time=timing, check=check, timing_wall_s=time.perf_counter() - t0)
    print()
    print_table(results)
    if step is not None:
        sh = step["shape"]
        print(f"\nwhole training step (d {sh['d_model']}, {sh['n_layers']} layers, vocab {sh['vocab']}, "
              f"{sh['batch']} x {sh['seq']} tokens, chunk {sh['chunk']}):")
        print("| side | peak RSS growth of the first step MiB | ms/step |")
        print("|---|---|---|")
        for k in ("plain", "chunked"):
            print(f"| {k} | {step[k]['growth_mib_median']:.0f} | {step[k]['step_ms_median']:.0f} |")
        print(f"memory ratio {step['memory_ratio']:.3f}, time ratio {step['time_ratio']:.3f}, "
              f"first-step loss relative difference {step['first_loss_rel_diff']:.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine["loadavg_at_end"] = list(os.getloadavg())
    args.out.write_text(
        json.dumps(dict(machine=machine, command=" ".join(sys.argv), results=results, step=step), indent=1)
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
