"""How well the budget planner's probe predicts the speed a shape then trains at.

For each shape of the planner's ladder asked for, in rounds (shapes interleaved, so a slow minute of a
shared machine falls on every shape rather than on one):
- probe: `tools.planner_probe._step_seconds`, the library's own measurement (the fastest of the first
  2-8 steps that fit in PROBE_SHAPE_S, 1 s, or in --shape-seconds, at most 8 a second, the cold first
  step among them), in this process after one tiny step (as `probe` does);
- median and warm-min: on a fresh model, one untimed step, then the steps that fit in --shape-seconds (at
  least two): their median (the rule 17fadf3 tried and 3de03c6 reverted) and their fastest;
- train: `lmforge train` of that shape for --seconds on a prepared corpus (builtin:python at vocabulary
  4096 unless --corpus), fp32, 16 x 256 tokens as the planner's CPU runs: the median of its 10-step
  tokens/s windows after the first.

Each ratio is a probe's tokens/s over the training's: 1.0 is a probe that predicts the run.

    python bench/planner_probe_accuracy.py                       # d64-L2, d96-L3, d128-L4; 2 rounds of 20 s
    python bench/planner_probe_accuracy.py --rounds 3 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from machine import write_results  # bench/ (on sys.path)
from planner_quality import lmforge, sets

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
RESULTS = REPO / "bench" / "results" / "planner_probe_accuracy.json"
VOCAB, MICRO, SEQ = 4096, 16, 256


def data_sets(work: Path, corpus: str) -> list[str]:
    return [f"data.sources=[{json.dumps(corpus)}]", f"data.dir={work / 'data'}",
            f"data.tokenizer.vocab_size={VOCAB}"]


def prepare(work: Path, corpus: str) -> list[str]:
    """The corpus prepared once (BPE at VOCAB): the data keys every training run then gives."""
    proc = lmforge("prepare", *sets(*data_sets(work, corpus)))
    if proc.returncode != 0:
        raise SystemExit(f"prepare {corpus}: {proc.stderr.strip()[-500:]}")
    return data_sets(work, corpus)


def after_warm(shape, shape_s: float) -> tuple[float, float]:
    """tokens/s by the median and by the fastest of the steps that fit in `shape_s` of the start (at least
    two, at most PROBE_STEPS a second) after one untimed step."""
    import torch

    from lmforge.data.batch import TokenBatch
    from lmforge.engine.precision import Precision
    from lmforge.engine.step import train_step
    from lmforge.models import build_model
    from lmforge.tools.planner import model_config
    from lmforge.tools.planner_probe import PROBE_STEPS, probe_optimizer
    from lmforge.utils.host_memory import keep_freed_memory

    cpu = torch.device("cpu")
    model = build_model(model_config(shape, VOCAB, SEQ), device=cpu)
    opt, prec = probe_optimizer(model.parameters(), cpu), Precision("fp32", cpu)
    x = torch.randint(0, VOCAB, (MICRO, SEQ + 1))
    batch, times, start = TokenBatch(x[:, :-1], x[:, 1:]), [], time.perf_counter()
    with keep_freed_memory(True):
        for i in range(max(2, round(PROBE_STEPS * shape_s)) + 1):
            t0 = time.perf_counter()
            train_step(model, [batch], opt, prec).loss  # noqa: B018
            now = time.perf_counter()
            if i:
                times.append(now - t0)
            if len(times) >= 2 and now + times[-1] > start + shape_s:
                break
    return MICRO * SEQ / statistics.median(times), MICRO * SEQ / min(times)


def train_speed(shape, data: list[str], work: Path, seconds: float) -> tuple[float, int]:
    """The median tokens/s of `lmforge train`'s 10-step windows after the first, and how many there were."""
    from lmforge.tools.planner import model_config

    mc, run = model_config(shape, VOCAB, SEQ), work / "run"
    proc = lmforge("train", *sets(
        *data, f"run.dir={run}", "run.overwrite=true", f"model.vocab_size={VOCAB}",
        f"model.d_model={mc.d_model}", f"model.n_layers={mc.n_layers}", f"model.n_heads={mc.n_heads}",
        f"model.n_kv_heads={mc.n_kv_heads}", f"model.max_seq_len={SEQ}", f"train.micro_batch_size={MICRO}",
        "train.precision=fp32", f"train.max_time={seconds:g}", "train.max_steps=1000000000",
        "train.log_every=10", "train.eval_every=0", "train.eval_batches=1", "checkpoint.every=0",
        "schedule.name=wsd", "schedule.unit=time", "schedule.warmup_seconds=2", "logging.progress=none",
        "logging.plot=false"))
    if proc.returncode != 0:
        raise SystemExit(f"train {shape.name}: {proc.stderr.strip()[-500:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
    if not windows:
        raise SystemExit(f"train {shape.name}: fewer than two logged windows in {seconds:g}s: give more "
                         "--seconds")
    return statistics.median(windows), len(windows)


def summary(rows: list[dict]) -> dict:
    """Per shape: the median, lowest and highest ratio of each probe to the training's speed."""
    out: dict = {}
    for name in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == name]
        out[name] = {k: {"median": round(statistics.median(r[k] for r in mine), 3),
                         "low": round(min(r[k] for r in mine), 3), "high": round(max(r[k] for r in mine), 3)}
                     for k in ("probe_ratio", "median_ratio", "warm_min_ratio")}
    return out


def main(argv: list[str] | None = None) -> dict:
    import torch

    from lmforge.tools.planner import LADDER, Shape
    from lmforge.tools.planner_probe import PROBE_SHAPE_S, _step_seconds

    ladder = {s.name: s for s in LADDER}
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="d64-L2,d96-L3,d128-L4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0, help="of training per shape and round")
    ap.add_argument("--corpus", default="builtin:python")
    ap.add_argument("--shape-seconds", type=float, default=None, help="time each probe statistic this long "
                    "a shape (default: the planner's PROBE_SHAPE_S): does a longer probe predict better?")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    shapes = [ladder.get(n) for n in args.shapes.split(",")]
    if None in shapes or args.rounds < 1 or args.seconds < 5 or not 0.1 <= (args.shape_seconds or 1) <= 60:
        ap.error(f"--shapes from {', '.join(ladder)}; --rounds >= 1; --seconds >= 5; --shape-seconds 0.1-60")
    shape_s = args.shape_seconds or PROBE_SHAPE_S
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmforge-probe-") as tmp:
        work = Path(tmp)
        data = prepare(work, args.corpus)
        cpu = torch.device("cpu")
        _step_seconds(Shape(32, 1, 1, 1), VOCAB, 1, 16, cpu, "fp32", 0.0)  # one-time costs, as probe() pays
        for r in range(args.rounds):
            for shape in shapes:
                step, _, _ = _step_seconds(shape, VOCAB, MICRO, SEQ, cpu, "fp32", time.perf_counter() + 60,
                                           shape_s=shape_s)
                probe, (median, warm_min) = MICRO * SEQ / step, after_warm(shape, shape_s)
                train, windows = train_speed(shape, data, work, args.seconds)
                rows.append({"round": r, "shape": shape.name, "probe": round(probe), "median": round(median),
                             "warm_min": round(warm_min), "train": round(train), "train_windows": windows,
                             "probe_ratio": round(probe / train, 3), "median_ratio": round(median / train, 3),
                             "warm_min_ratio": round(warm_min / train, 3)})
                print(json.dumps(rows[-1]), flush=True)
    return write_results(args.results, args, rows, summary(rows))


if __name__ == "__main__":
    main()
