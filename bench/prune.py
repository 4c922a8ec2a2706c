"""Pruning quality and speed on the demo model: `lmforge prune` by each method, with a short recovery.

    .venv/bin/python bench/prune.py                          # runs/demo, 100 recovery steps per method
    .venv/bin/python bench/prune.py --recover-steps 200 --only heads-25,channels-50

For every method (below) `lmforge.compress.prune.prune_run` prunes --src (default runs/demo, its data
in data/cache/demo) into a temporary run dir and fine-tunes it for --recover-steps steps on the run's
own training data (its config, with the recovery defaults: 10% warm-up, no EMA). Reported, all from
prune_report.json: parameters (total and non-zero), the sparsity of the blocks' linear weights counted
from the weights, validation loss / perplexity of the source, of the pruned model and of the recovered
one (the whole val split, as `lmforge eval`).

Speed: the forward of the source model and of each recovered model, no grad, batch --batch x
max_seq_len, fp32, measured interleaved right after that method's run (one forward of each model per
round, the order alternating, --repeats rounds after --warmup), medians; ratio = source median /
pruned median (> 1: the pruned model is faster).
Unstructured sparsity (magnitude, 2:4) runs on the same dense kernels, so its ratio is ~1 by design:
2:4 needs sparse tensor cores (torch's to_sparse_semi_structured, CUDA only) to pay off.
--eval-batches caps the validation batches (a loaded machine; default: the whole val split). Never
asserts; prints machine info and a markdown table, writes bench/results/prune.json (after every method,
so that a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmforge.compress.prune import PruneSpec, prune_run  # noqa: E402
from lmforge.eval.open_run import load_run  # noqa: E402
from machine import machine_info, print_markdown_table  # noqa: E402

METHODS = {
    "magnitude-50": PruneSpec("magnitude", sparsity=0.5),
    "wanda-50": PruneSpec("magnitude", sparsity=0.5, score="wanda"),
    "2:4": PruneSpec("2:4"),
    "2:4-wanda": PruneSpec("2:4", score="wanda"),
    "heads-25": PruneSpec("heads", ratio=0.25),
    "channels-25": PruneSpec("channels", ratio=0.25),
    "channels-50": PruneSpec("channels", ratio=0.5),
}


@torch.no_grad()
def forward_times(models: dict[str, torch.nn.Module], ids: torch.Tensor, warmup: int, repeats: int
                  ) -> dict[str, float]:
    """Median seconds per forward of each model, interleaved round by round (order alternating)."""
    for m in models.values():
        m.eval()
        for _ in range(warmup):
            m(ids)
    times: dict[str, list[float]] = {k: [] for k in models}
    names = list(models)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            models[name](ids)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default="runs/demo")
    ap.add_argument("--recover-steps", type=int, default=100)
    ap.add_argument("--only", help="comma-separated method names: " + ", ".join(METHODS))
    ap.add_argument("--eval-batches", type=int, default=None, help="cap the validation batches (of 8 x 256; "
                    "default: the whole val split, as lmforge eval)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="bench/results/prune.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chosen = args.only.split(",") if args.only else list(METHODS)
    info = machine_info(threads=args.threads, src=args.src, recover_steps=args.recover_steps)
    print(json.dumps(info))
    source = load_run(args.src).model
    cfg = source.cfg
    ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len),
                        generator=torch.Generator().manual_seed(0))
    results: dict = {}
    out_json = {"machine": info, "batch": args.batch, "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="prune-bench-") as root:
        for name in chosen:
            out = Path(root) / name.replace(":", "_")
            t0 = time.perf_counter()
            report = prune_run(args.src, out, METHODS[name], recover_steps=args.recover_steps,
                               eval_batches=args.eval_batches,
                               overrides=["logging.progress=none", "logging.plot=false"],
                               say=lambda m, n=name: print(f"[{n}] {m}", flush=True))
            report["wall_seconds"] = round(time.perf_counter() - t0, 1)
            # Speed: this method's model against the source, interleaved in the same rounds.
            pair = {"source": source, name: load_run(out).model}
            speed = forward_times(pair, ids, args.warmup, args.repeats)
            report["forward_seconds"] = {"source": speed["source"], "pruned": speed[name]}
            report["speedup"] = speed["source"] / speed[name]
            print(f"[{name}] forward {speed['source'] * 1e3:.1f} ms -> {speed[name] * 1e3:.1f} ms "
                  f"({report['speedup']:.2f}x)", flush=True)
            results[name] = report
            Path(args.json).write_text(json.dumps(out_json, indent=2) + "\n")  # partial results survive
    rows = []
    for name, r in results.items():
        e, p = r["eval"], r["params"]
        rec = e["recovered"]
        rows.append([
            name, f"{p['after']['total'] / 1e6:.2f}M", f"{p['after']['nonzero'] / 1e6:.2f}M",
            f"{r['sparsity']['overall']:.1%}",
            f"{e['before']['loss']:.3f} / {e['before']['ppl']:.1f}",
            f"{e['pruned']['loss']:.3f} / {e['pruned']['ppl']:.1f}",
            "-" if rec is None else f"{rec['loss']:.3f} / {rec['ppl']:.1f}",
            f"{r['speedup']:.2f}x",
        ])
    print(f"\nforward batch {args.batch} x {cfg.max_seq_len}, fp32, {args.threads} threads; recovery "
          f"{args.recover_steps} steps per method\n")
    print_markdown_table(["method", "params", "non-zero", "sparsity", "val loss / ppl before",
                          "pruned", f"recovered ({args.recover_steps} steps)", "forward speed-up"], rows)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
