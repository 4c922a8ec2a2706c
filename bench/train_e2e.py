"""End to end: `lmforge train`'s step rate against the bare training step at the same shape.

The issue's target: the tokens/s of a whole `lmforge train` run (data loader, lr schedule, stability
guards, metrics logging, console, callbacks) within 5% of the step rate the benchmarks measure (the
`run.parallel.step` of the same assembled run on batches prepared in advance). One process, one run,
in blocks that alternate: bare steps, then the Trainer's own loop for as many steps, again and again;
medians of per-step wall times (the loop's: the time between consecutive on_step_end calls, so it
includes everything the loop does between steps).

    python bench/train_e2e.py                      # configs/speedrun/cpu-5min.yaml's shape, fp32
    python bench/train_e2e.py --blocks 6 --steps 20 --set train.precision=auto

Writes bench/results/train_e2e.json.
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
from lmforge.train.callbacks import Callback  # noqa: E402
from lmforge.train.trainer import Trainer  # noqa: E402

RESULTS = REPO / "bench" / "results" / "train_e2e.json"


class StepClock(Callback):
    """Wall time between consecutive steps of the Trainer's loop; stops the loop after `limit` steps."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.limit = 0
        self._last = 0.0

    def arm(self, steps: int) -> None:
        self.limit, self._last = steps, time.perf_counter()

    def on_step_end(self, trainer, step, result) -> None:
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now
        self.limit -= 1
        if self.limit == 0:
            trainer.request_stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=str(REPO / "configs" / "speedrun" / "cpu-5min.yaml"))
    ap.add_argument("--set", action="append", default=[], help="config overrides")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="steps per block and side")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"run.dir={tmp}/run", "train.max_time=null", "schedule.unit=steps", "schedule.name=cosine",
                "schedule.warmup_seconds=null", "schedule.cooldown_fraction=null", "schedule.warmup_steps=10",
                "train.max_steps=1000000", "train.precision=fp32", "train.log_every=10", "train.eval_every=0",
                "checkpoint.every=0", "checkpoint.save_final=false", "logging.progress=plain", *args.set]
        cfg = load_config(args.config, sets)
        clock = StepClock()
        trainer = Trainer(cfg, callbacks=[clock])
        run, tc = trainer.run, cfg.train
        batches = [trainer._next_batch() for _ in range(8)]

        def bare(n: int) -> list[float]:
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                run.parallel.step([batches[i % len(batches)]], run.optimizer, run.precision,
                                  grad_clip=tc.grad_clip, group_stats=False)
                out.append(time.perf_counter() - t0)
            return out

        def loop(n: int) -> list[float]:
            clock.times.clear()
            clock.arm(n)
            trainer.control.stop = None
            trainer._loop()
            return list(clock.times)

        trainer._emit("on_train_start")  # what fit() does before its loop: logger, console
        bare(args.warmup)
        loop(args.warmup)
        t_bare, t_loop = [], []
        for b in range(args.blocks):
            for side in ((bare, t_bare), (loop, t_loop)) if b % 2 == 0 else ((loop, t_loop), (bare, t_bare)):
                side[1].extend(side[0](args.steps))
        trainer._release()
    tokens = tc.micro_batch_size * tc.grad_accum_steps * cfg.seq_len
    mb, ml = statistics.median(t_bare), statistics.median(t_loop)
    out = {
        "machine": machine_info(), "config": args.config, "overrides": args.set, "tokens_per_step": tokens,
        "model": {k: getattr(cfg.model, k)
                  for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len")},
        "precision": tc.precision,
        "bare_step_ms": mb * 1e3, "train_loop_step_ms": ml * 1e3, "bare_tokens_per_s": tokens / mb,
        "train_tokens_per_s": tokens / ml, "loop_over_bare": ml / mb, "steps_per_side": len(t_bare),
    }
    print(f"bare step {mb * 1e3:.2f} ms ({tokens / mb:,.0f} tok/s); lmforge train loop {ml * 1e3:.2f} ms "
          f"({tokens / ml:,.0f} tok/s): the loop takes {100 * (ml / mb - 1):+.1f}% per step "
          f"({len(t_bare)} steps each, medians)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
