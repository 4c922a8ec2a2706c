"""SFT step with the output head over the target positions only, against the head over every position.

    .venv/bin/python bench/sft_target_rows.py                         # the LoRA demo run, ~1 minute
    .venv/bin/python bench/sft_target_rows.py -c configs/sft/full.yaml
    .venv/bin/python bench/sft_target_rows.py --set train.precision=fp32 --set train.loss_chunk_tokens=512

The run is assembled by `lmforge.train.trainer.Trainer` from an SFT config (default: the LoRA run of
`scripts/sft_demo.sh`, which needs what that script makes first: runs/demo and data/sft/tasks_*.jsonl),
in a temporary run dir; its first --batches batches are drawn through the run's own loader. Both sides
run `run.parallel.step` (forward, loss, backward, clipping, optimizer step) of that one run on those
batches; they differ only in the SFT objective's `target_rows` (the hidden states of the positions that
carry a target gathered before the output projection and cross-entropy, or every position through the
head). They share the model and optimizer, so they train one model alternately; the step's work does not
depend on the weights. Method: --warmup steps per side, then --rounds rounds of one step per side, the
order alternating; medians and the median of the per-round ratios. Prints the fraction of positions that
carry a target. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_info  # bench/machine.py (on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from lmforge.config import load_config  # noqa: E402
from lmforge.train.trainer import Trainer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=str(REPO / "configs" / "sft" / "lora.yaml"))
    ap.add_argument("--set", action="append", default=[], help="config overrides")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    machine = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"run.dir={tmp}/run", "train.eval_every=0", "checkpoint.every=0",
                "checkpoint.save_final=false", "logging.progress=plain", *args.set]
        cfg = load_config(args.config, sets)
        trainer = Trainer(cfg)
        run, tc = trainer.run, cfg.train
        objective = run.objective
        if not hasattr(objective, "target_rows"):
            raise SystemExit(f"objective {objective.name} is not sft: nothing to compare")
        batches = [trainer._next_batch() for _ in range(args.batches)]
        positions = sum(b.targets.numel() for b in batches)
        targets = sum(b.target_count() for b in batches)

        def step(rows: bool, i: int) -> float:
            objective.target_rows = rows
            t0 = time.perf_counter()
            run.parallel.step([batches[i % len(batches)]], run.optimizer, run.precision,
                              grad_clip=tc.grad_clip, group_stats=False)
            return time.perf_counter() - t0

        for i in range(args.warmup):
            step(True, i), step(False, i)
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for rows in (True, False) if r % 2 == 0 else (False, True):
                times[rows].append(step(rows, r))
        trainer._release()
    rows_ms, all_ms = (1e3 * statistics.median(times[k]) for k in (True, False))
    per_round = sorted(a / b for a, b in zip(times[False], times[True]))
    out = {
        "machine": machine, "config": args.config, "overrides": args.set, "precision": tc.precision,
        "tokens_per_step": batches[0].targets.numel(), "target_fraction": targets / positions,
        "target_rows_ms": rows_ms, "every_row_ms": all_ms, "speedup": all_ms / rows_ms,
        "per_round_median": per_round[len(per_round) // 2],
        "per_round_q25_q75": [per_round[len(per_round) // 4], per_round[(3 * len(per_round)) // 4]],
        "rounds": args.rounds,
    }
    print(f"{args.config} ({tc.precision}): {100 * targets / positions:.1f}% of the positions carry a "
          f"target; head over target rows {rows_ms:.1f} ms, over every row {all_ms:.1f} ms per step: "
          f"{out['speedup']:.3f}x (per round: median {out['per_round_median']:.3f}, IQR "
          f"{out['per_round_q25_q75'][0]:.3f}-{out['per_round_q25_q75'][1]:.3f}; {args.rounds} rounds)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
