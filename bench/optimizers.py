"""Optimizers on the debug recipe: final validation loss, optimizer-state bytes per parameter, step time.

    python bench/optimizers.py                        # all 8 optimizers, ~5-8 minutes on 2 cores
    python bench/optimizers.py --only sophia muon --steps 200

Every optimizer trains configs/debug/tiny.yaml's model (debug preset, d_model 64, 2 layers, vocab 512,
seq 64, 8 x 2 micro-batches = 1024 tokens per step, cosine schedule with 5 warm-up steps, weight
decay 0.1, fp32, 1 thread) through lmforge's own trainer (`load_config` + `Trainer(cfg).fit()`, i.e.
`lmforge.train.trainer.train`), each run in its own temp run dir, all for the same token budget
(--steps x 1024 tokens), on the recipe's own corpus (a slice of this Python's docs and stdlib,
prepared once into data/cache/debug-tiny).

Learning rate: a 3-point sweep per optimizer around its usual range (AdamW-like 1e-3..1e-2; Lion and
Sophia, whose per-coordinate step is at most lr, 3x smaller; SGD with momentum 0.1..1), extended by one
more point (x3 or /3) when the best is at an edge; the best final validation loss is reported. Muon
sweeps muon_lr (its matrices) and runs its AdamW groups (embeddings, norms) at AdamW's best lr.

Reported per optimizer: best lr, final val loss at it (and every lr tried), state bytes per parameter
(`state_bytes_per_param` on the run's optimizer: every tensor in its state, step counters included)
next to the textbook figure for this model, and the median step time (from the trainer's per-step
tokens/s, log_every=1; group stats off so they do not cost time). Those come from separate runs one
after another; the step times in the table come from a second, interleaved phase instead: one model
and optimizer per method, the same fixed batches, one `train_step` each per round, round-robin for
--timing-rounds rounds; reported are the mean (Sophia's Hessian refresh every k steps is part of its
cost) and the ratio to AdamW's mean. Writes bench/results/optimizers.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmforge.config.load import load_config  # noqa: E402
from lmforge.metrics.loggers import read_metrics  # noqa: E402
from lmforge.optim.builder import state_bytes_per_param  # noqa: E402
from lmforge.optim.muon import hidden_matrices  # noqa: E402
from lmforge.train.trainer import Trainer  # noqa: E402
from machine import machine_info  # noqa: E402  (bench/machine.py)

RECIPE = ROOT / "configs" / "debug" / "tiny.yaml"
RESULTS = ROOT / "bench" / "results" / "optimizers.json"

GRIDS: dict[str, list[float]] = {
    "adamw": [1e-3, 3e-3, 1e-2],
    "adam": [1e-3, 3e-3, 1e-2],
    "sgd": [0.1, 0.3, 1.0],
    "lion": [1e-4, 3e-4, 1e-3],
    "adafactor": [1e-3, 3e-3, 1e-2],
    "adamw8bit": [1e-3, 3e-3, 1e-2],
    "sophia": [3e-4, 1e-3, 3e-3],
    "muon": [0.01, 0.02, 0.05],  # muon_lr; optim.lr = AdamW's best
}


def textbook_bytes(name: str, model: torch.nn.Module, cfg) -> tuple[float, str]:
    """fp32 optimizer state per parameter as the method defines it (no step counters)."""
    sizes = [p.numel() for p in model.parameters()]
    n = sum(sizes)
    if name in ("adamw", "adam"):
        return 8.0, "m + v"
    if name == "sophia":
        return 8.0, "m + h"
    if name == "sgd":
        return 4.0, "momentum"
    if name == "lion":
        return 4.0, "m"
    if name == "adafactor":  # no beta1: row + column means of g^2 for matrices, full for vectors
        total = sum(4 * (p.shape[0] + p.shape[1]) if p.ndim == 2 else 4 * p.numel()
                    for p in model.parameters())
        return total / n, "row+col of v"
    if name == "adamw8bit":
        block = cfg.optim.adamw8bit.block_size
        return 2 + 8 / block, f"2 codes + 8/{block} scales"
    if name == "muon":
        hidden = sum(p.numel() for p in hidden_matrices(model))
        return (4 * hidden + 8 * (n - hidden)) / n, f"momentum on {hidden / n:.0%}, AdamW m+v on the rest"
    raise ValueError(name)


def run_one(name: str, lr: float, steps: int, data_dir: Path, adamw_lr: float | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"run.dir={tmp}/run", f"data.dir={data_dir}", f"optim.name={name}", f"train.max_steps={steps}",
            "train.log_every=1", "train.log_group_stats=false", "train.eval_every=0", "train.eval_batches=50",
            "checkpoint.every=0", "checkpoint.save_final=false", "logging.progress=none",
            "logging.plot=false",
        ]
        if name == "muon":
            overrides += [f"optim.muon.lr={lr}", f"optim.lr={adamw_lr}"]
        else:
            overrides.append(f"optim.lr={lr}")
        cfg = load_config(RECIPE, overrides)
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        final = trainer.fit()
        wall = time.perf_counter() - t0
        records = list(read_metrics(Path(cfg.run.dir) / "metrics.jsonl"))
        tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.seq_len
        step_ms = [1e3 * tokens_per_step / r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
        losses = [r["loss"] for r in records if "loss" in r]
        textbook, textbook_what = textbook_bytes(name, trainer.model, cfg)
        return dict(
            lr=lr,
            adamw_lr=adamw_lr,
            val_loss=final["loss"],
            val_bpb=final.get("bpb"),
            train_loss_first=losses[0] if losses else None,
            train_loss_last=losses[-1] if losses else None,
            diverged=not math.isfinite(final["loss"]),
            state_bytes_per_param=state_bytes_per_param(trainer.optimizer),
            textbook_bytes_per_param=textbook,
            textbook_what=textbook_what,
            median_step_ms=statistics.median(step_ms),
            step_ms_q25_q75=[statistics.quantiles(step_ms, n=4)[0], statistics.quantiles(step_ms, n=4)[2]],
            optimizer_class=type(trainer.optimizer).__name__,
            params=sum(p.numel() for p in trainer.model.parameters()),
            tokens=steps * tokens_per_step,
            wall_s=wall,
        )


def sweep(name: str, steps: int, data_dir: Path, adamw_lr: float | None) -> dict:
    """The grid, plus one point beyond the edge where the best landed; best by final val loss."""
    grid = list(GRIDS[name])
    runs = {}

    def score(lr: float) -> float:
        v = runs[lr]["val_loss"]
        return v if math.isfinite(v) else float("inf")

    for lr in grid:
        runs[lr] = run_one(name, lr, steps, data_dir, adamw_lr)
        print(f"  {name} lr {lr:g}: val loss {runs[lr]['val_loss']:.4f} "
              f"({runs[lr]['median_step_ms']:.1f} ms/step)", flush=True)
    best = min(runs, key=score)
    if best in (grid[0], grid[-1]):
        extra = best / 3 if best == grid[0] else best * 3
        runs[extra] = run_one(name, extra, steps, data_dir, adamw_lr)
        print(f"  {name} lr {extra:g} (edge extension): val loss {runs[extra]['val_loss']:.4f}", flush=True)
        best = min(runs, key=score)
    return dict(best_lr=best, best=runs[best], runs={f"{lr:g}": r for lr, r in sorted(runs.items())})


def interleaved_step_ms(names: list[str], rounds: int, data_dir: Path) -> dict[str, dict]:
    """Per-step time of every optimizer on one model shape, interleaved round-robin: each side is the
    run `lmforge train` would assemble (build_run without a run dir), stepped as the Trainer steps it."""
    from lmforge.assembly import build_run

    runs = {}
    for name in names:
        cfg = load_config(RECIPE, [f"data.dir={data_dir}", "logging.progress=none", f"optim.name={name}",
                                   "optim.lr=1e-3", "train.precision=fp32"])
        runs[name] = build_run(cfg, "experiment", say=lambda *_: None)
    first = runs[names[0]]
    torch.set_num_threads(first.cfg.train.threads or 1)
    loader = first.train_loader
    batches = [[loader.next_batch() for _ in range(first.cfg.train.grad_accum_steps)] for _ in range(8)]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 3):  # the first 3 rounds warm up allocators and caches
        for name in names:
            run = runs[name]
            t0 = time.perf_counter()
            run.parallel.step(batches[r % len(batches)], run.optimizer, run.precision,
                              grad_clip=run.cfg.train.grad_clip, hooks=run.hooks)
            if r >= 3:
                times[name].append(1e3 * (time.perf_counter() - t0))
    base = statistics.mean(times["adamw"]) if "adamw" in times else None
    return {n: dict(mean_ms=statistics.mean(t), median_ms=statistics.median(t),
                    ratio_to_adamw=statistics.mean(t) / base if base else None) for n, t in times.items()}


def print_table(results: dict) -> None:
    headers = ["optimizer", "best lr", "val loss", "val loss at each lr", "state B/param", "textbook B/param",
               "ms/step (interleaved)", "vs adamw"]
    rows = []
    for name, r in results.items():
        b = r["best"]
        lr = f"{r['best_lr']:g}" + (f" (adamw {b['adamw_lr']:g})" if b["adamw_lr"] is not None else "")
        tried = ", ".join(f"{k}: {v['val_loss']:.3f}" for k, v in r["runs"].items())
        t = r.get("timing", {})
        rows.append([name, lr, f"{b['val_loss']:.4f}", tried, f"{b['state_bytes_per_param']:.3f}",
                     f"{b['textbook_bytes_per_param']:.3f}", f"{t['mean_ms']:.1f}" if t else "-",
                     f"{t['ratio_to_adamw']:.2f}x" if t.get("ratio_to_adamw") else "-"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        cells = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=list(GRIDS), help="run these optimizers only")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run (x 1024 tokens)")
    ap.add_argument("--data-dir", default=str(ROOT / "data" / "cache" / "debug-tiny"))
    ap.add_argument("--timing-rounds", type=int, default=40, help="interleaved timing rounds per optimizer")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    names = args.only or list(GRIDS)
    info = machine_info(threads="1 (the recipe's train.threads)")
    print(f"machine: {info['cpu_model']} ({info['cpu_count']} cores, {info['cpu_capability']}), "
          f"torch {info['torch']}, load average {info['loadavg_at_start']}", flush=True)
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    adamw_lr = None
    if "muon" in names and "adamw" not in names:
        adamw_lr = load_config(RECIPE, []).optim.lr  # the recipe's AdamW lr when AdamW is not swept here
    for name in names:
        print(f"{name}:", flush=True)
        results[name] = sweep(name, args.steps, Path(args.data_dir), adamw_lr if name == "muon" else None)
        if name == "adamw":
            adamw_lr = results[name]["best_lr"]
    print("interleaved step timing:", flush=True)
    for name, t in interleaved_step_ms(names, args.timing_rounds, Path(args.data_dir)).items():
        results[name]["timing"] = t
    info["loadavg_at_end"] = list(os.getloadavg())
    info["wall_s"] = time.perf_counter() - t0
    print()
    print_table(results)
    print(f"\n{args.steps} steps x 1024 tokens per run; total {info['wall_s'] / 60:.1f} min; "
          f"load average at end {info['loadavg_at_end']}")
    out = dict(machine=info, recipe=str(RECIPE.relative_to(ROOT)), steps=args.steps, grids=GRIDS,
               results=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
