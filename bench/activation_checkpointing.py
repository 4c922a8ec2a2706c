"""Activation checkpointing: time and memory of one training step with train.activation_checkpointing
none / full / every_k (k = 2) / selective / selective with train.ac_save=alternate_matmuls.

    .venv/bin/python bench/activation_checkpointing.py                 # CPU shape, ~25 minutes on 2 cores
    .venv/bin/python bench/activation_checkpointing.py --rounds 1 --steps 1 --d-model 128 --layers 2 \\
        --seq 128 --batch 2 --vocab 1024                                # a quick check that it runs
    python bench/activation_checkpointing.py --device cuda              # the GPU shape, bf16

Every variant is the run `build_run` assembles from the config as `lmforge train` does (the same seeded
Llama-layout model, AdamW, fp32 on the CPU and bf16 autocast on CUDA, random tokens), stepped by
`run.parallel.step([batch], run.optimizer, run.precision, grad_clip=1.0)`. Each measurement is a fresh
process for one variant; the variants are interleaved, their order rotated every round:

  time      --warmup untimed steps, then --steps timed ones: the worker's median; the table gives the
            median over the --rounds workers of a variant, and its ratio to none.
  peak      the memory one step adds at its fullest moment, measured after the warmup (so AdamW's
            moments exist; the gradients, freed by zero_grad, are part of it, the same for every
            variant). CUDA: max_memory_allocated - memory_allocated before the step. CPU: peak RSS over
            the RSS before the step (VmHWM after /proc/self/clear_refs), with glibc malloc pinned as
            lmforge.tools.estimate_measure pins it (every tensor above 64 KiB its own mapping, returned
            when freed) so that RSS follows the live tensors.
  kept      the bytes of the tensors one forward (model and loss) leaves alive for the backward: the
            distinct storages of every op output still referenced when the forward returns (a
            TorchDispatchMode sees them all, the outputs selective checkpointing keeps included).
  estimate  `lmforge estimate`'s "activations (saved for backward)" for the same config (under bf16
            autocast "kept" also holds the bf16 weight copies, a row of their own in the estimate).

The first step's loss of every variant must be the same (recomputation is the same arithmetic); the
report gives the largest relative difference. Writes bench/results/activation_checkpointing.json
(machine, shape, raw numbers) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lmforge.tools.estimate_measure import LiveOutputs
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

VARIANTS = {
    "none": {"activation_checkpointing": "none"},
    "full": {"activation_checkpointing": "full"},
    "every_2": {"activation_checkpointing": "every_k", "ac_every": 2},
    "selective": {"activation_checkpointing": "selective"},
    "selective_alternate": {"activation_checkpointing": "selective", "ac_save": "alternate_matmuls"},
    # train.activation_offload (CUDA only): saved tensors to pinned host memory, alone and with full
    "offload": {"activation_checkpointing": "none", "activation_offload": True},
    "full_offload": {"activation_checkpointing": "full", "activation_offload": True},
}
# CPU: big enough that activations outweigh the weights and a step takes seconds on 2 cores; CUDA: a
# ~0.9B-parameter model whose uncheckpointed step fits an 80 GB GPU (lmforge estimate: ~46 GB)
SHAPES = {
    "cpu": dict(d_model=512, layers=8, heads=8, vocab=8192, seq=512, batch=8, precision="fp32"),
    "cuda": dict(d_model=2048, layers=16, heads=16, vocab=32768, seq=2048, batch=8, precision="bf16"),
}
RESULTS = Path(__file__).resolve().parent / "results" / "activation_checkpointing.json"
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}
# the worker's parent: exec records the exec-ing process's RSS high-water mark in ru_maxrss (see
# bench/chunked_loss.py); VmHWM after clear_refs does not inherit it, the trampoline keeps it that way
TRAMPOLINE = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def config(shape: dict, variant: str, device: str):
    from lmforge.config.schema import Config

    return Config.model_validate({
        "model": {"d_model": shape["d_model"], "n_layers": shape["layers"], "n_heads": shape["heads"],
                  "vocab_size": shape["vocab"], "max_seq_len": shape["seq"], "tie_embeddings": False},
        "train": {"micro_batch_size": shape["batch"], "precision": shape["precision"], "device": device,
                  **VARIANTS[variant]},
    })


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")




def worker(args) -> int:
    """Fresh process, one variant: the first loss, the peak memory of a step, the kept bytes and the
    step times, printed as one JSON line."""
    import numpy as np

    from lmforge.assembly import build_run

    shape = json.loads(args.shape_json)
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    cfg = config(shape, args.worker, args.device)
    n = shape["batch"] * shape["seq"]
    ids = np.random.default_rng(0).integers(0, shape["vocab"], size=n * (args.warmup + args.steps + 4) + 1)
    run = build_run(cfg, "experiment", train_data=[ids], say=lambda *_: None)
    device = next(run.model.parameters()).device  # the Trainer moves each batch; so does this bench
    batches = [run.train_loader.next_batch().to(device) for _ in range(args.warmup + args.steps + 2)]

    def step(batch) -> float:
        result = run.parallel.step([batch], run.optimizer, run.precision, grad_clip=1.0)
        if cuda:
            torch.cuda.synchronize()
        return result.loss

    first_loss = step(batches[0])
    for b in batches[1:args.warmup]:
        step(b)
    # peak memory of one step
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(batches[args.warmup])
        peak = torch.cuda.max_memory_allocated() - before
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_bytes("VmRSS")
        step(batches[args.warmup])
        peak = _status_bytes("VmHWM") - before
    times = []
    for b in batches[args.warmup + 1:args.warmup + 1 + args.steps]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t0)
    # kept for backward: one forward with the live-output mode on, then its backward (frees it all)
    run.optimizer.zero_grad(set_to_none=True)
    with run.precision.autocast(), LiveOutputs() as live:
        loss = run.parallel.objective(run.model, batches[-1]).loss  # the loader's batches are on the device
    kept = live.live_bytes()
    loss.backward()
    print(json.dumps(dict(first_loss=first_loss, peak_bytes=peak, kept_bytes=kept,
                          step_s_median=statistics.median(times), step_s=times)))
    return 0


def estimate_bytes(shape: dict, variant: str, device: str) -> int:
    from lmforge.tools.estimate import estimate

    est = estimate(config(shape, variant, device), 1, device)
    return est.rows["activations (saved for backward)"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: "
                   + ",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=3, help="fresh workers per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per worker before measuring")
    p.add_argument("--steps", type=int, default=3, help="timed steps per worker")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads per worker")
    for key in ("d_model", "layers", "heads", "vocab", "seq", "batch"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                       help=f"{key} (default: per device)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="default: fp32 CPU, bf16 CUDA")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", choices=list(VARIANTS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    shape = dict(SHAPES[args.device])
    for key in shape:
        if getattr(args, key, None) is not None:
            shape[key] = getattr(args, key)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    machine = machine_info(device=args.device, threads=args.threads if args.device == "cpu" else None,
                           gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    print(f"machine: {machine}\nshape: {shape}", flush=True)
    raw: dict[str, list[dict]] = {v: [] for v in variants}
    env = {**os.environ, **MALLOC_ENV}
    t_start = time.perf_counter()
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            cmd = [sys.executable, "-c", TRAMPOLINE, sys.executable, __file__, "--worker", v,
                   "--shape-json", json.dumps(shape), "--device", args.device, "--threads", str(args.threads),
                   "--warmup", str(args.warmup), "--steps", str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                raise RuntimeError(f"worker {v} failed:\n{out.stderr[-4000:]}")
            m = json.loads(out.stdout.strip().splitlines()[-1])
            raw[v].append(m)
            print(f"[round {r}] {v}: {1e3 * m['step_s_median']:.0f} ms/step, "
                  f"peak +{m['peak_bytes'] / 2**20:.0f} MiB, kept {m['kept_bytes'] / 2**20:.0f} MiB, "
                  f"first loss {m['first_loss']:.6f}", flush=True)
    results: dict[str, dict] = {}
    for v in variants:
        results[v] = dict(
            step_ms_median=1e3 * statistics.median(x["step_s_median"] for x in raw[v]),
            peak_mib_median=statistics.median(x["peak_bytes"] for x in raw[v]) / 2**20,
            kept_mib=statistics.median(x["kept_bytes"] for x in raw[v]) / 2**20,
            estimate_kept_mib=estimate_bytes(shape, v, args.device) / 2**20,
            config=VARIANTS[v], raw=raw[v],
        )
    base = results.get("none")
    if base is not None:
        for r in results.values():
            r["time_ratio"] = r["step_ms_median"] / base["step_ms_median"]
            r["peak_ratio"] = r["peak_mib_median"] / base["peak_mib_median"]
            r["kept_ratio"] = r["kept_mib"] / base["kept_mib"]
    losses = [x["first_loss"] for v in variants for x in raw[v]]
    loss_spread = (max(losses) - min(losses)) / abs(losses[0])

    headers = ["variant", "ms/step", "time / none", "step peak MiB", "peak / none", "kept MiB", "kept / none",
               "estimate kept MiB"]
    rows = []
    for v, r in results.items():
        rows.append([v, f"{r['step_ms_median']:.0f}", f"{r.get('time_ratio', float('nan')):.3f}",
                     f"{r['peak_mib_median']:.0f}", f"{r.get('peak_ratio', float('nan')):.3f}",
                     f"{r['kept_mib']:.0f}", f"{r.get('kept_ratio', float('nan')):.3f}",
                     f"{r['estimate_kept_mib']:.0f}"])
    print(f"\nd {shape['d_model']}, {shape['layers']} layers, {shape['heads']} heads, "
          f"vocab {shape['vocab']}, {shape['batch']} x {shape['seq']} tokens, {shape['precision']}, "
          f"{args.device}; medians of {args.rounds} workers x {args.steps} steps:\n")
    print_markdown_table(headers, rows)
    print(f"\nfirst-step loss: largest relative difference between variants {loss_spread:.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine["loadavg_at_end"] = list(os.getloadavg())
    args.out.write_text(json.dumps(dict(machine=machine, command=" ".join(sys.argv), shape=shape,
                                        device=args.device, first_loss_rel_spread=loss_spread,
                                        wall_s=time.perf_counter() - t_start, results=results), indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
