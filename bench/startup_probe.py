"""What `precision: auto` and `threads: auto` cost at start-up, and what bf16 gains, on this machine.

    .venv/bin/python bench/startup_probe.py              # the probes at the demo's and speedrun's shapes
    .venv/bin/python bench/startup_probe.py --startup ../main/src --data-dir data/cache/demo --repeats 2

Per config (configs/demo.yaml, configs/speedrun/cpu-5min.yaml), with the run's model and micro-batch:
the precision probe's cost and verdict on a cold cache and again on a warm one, the threads probe's cost
and choice, and the fp32 / bf16 step-time ratio at the run's shape (> 1: bf16 is faster; the gain the
probe exists to find). On a CPU without bf16 matrix units the ratio is not measured (a bf16 step there is
many times slower, and the probe skips it: that skip is the row) unless --force-ratio.

--startup OTHER_SRC: seconds from starting `lmforge train -c configs/demo.yaml` to its first logged step,
with OTHER_SRC's lmforge (e.g. main before this change) and this tree's, interleaved --repeats times
(each process is stopped after its first step); medians reported. A loaded machine makes these noisy:
the load average is recorded. Writes bench/results/startup_probe.json (or startup_probe_startup.json).
Never asserts on speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = {"demo": REPO / "configs" / "demo.yaml",
           "speedrun": REPO / "configs" / "speedrun" / "cpu-5min.yaml"}
FIRST_STEP = re.compile(r"^step\s+1/")


def probes(name: str, force_ratio: bool) -> dict:
    import torch

    from lmforge.config import load_config
    from lmforge.engine.precision import bf16_step_speedup, probe_deadline, resolve_precision
    from lmforge.engine.threads import resolve_threads
    from lmforge.models import build_model
    from lmforge.utils.machine import ProbeCache, cpu_facts

    cfg = load_config(CONFIGS[name], [])
    vocab = cfg.data.tokenizer.vocab_size
    torch.manual_seed(0)
    model = build_model(cfg.model.model_copy(update={"vocab_size": vocab}))
    mb, seq = cfg.train.micro_batch_size, cfg.seq_len
    row: dict = {"config": name, "shape": f"{mb}x{seq}", "params": sum(p.numel() for p in model.parameters())}
    with tempfile.TemporaryDirectory() as tmp:
        cache = ProbeCache(Path(tmp) / "probes.json")
        for label in ("cold", "cached"):
            lines: list[str] = []
            t0 = time.perf_counter()
            verdict = resolve_precision("auto", torch.device("cpu"), model, mb, seq, vocab, say=lines.append,
                                        deadline_s=probe_deadline(cfg.train.max_time), cache=cache)
            row[f"precision_probe_{label}_s"] = round(time.perf_counter() - t0, 4)
            row[f"precision_{label}"], row[f"precision_lines_{label}"] = verdict, lines
        lines = []
        t0 = time.perf_counter()
        threads = resolve_threads("auto", rows=mb * seq, d_model=cfg.model.d_model,
                                  d_ff=cfg.model.resolved_d_ff, say=lines.append, cache=cache)
        row["threads_probe_s"], row["threads"], row["threads_lines"] = (
            round(time.perf_counter() - t0, 4), threads, lines)
    if cpu_facts().bf16_units is False and not force_ratio:
        row["fp32_over_bf16_step"] = None
        row["ratio_note"] = "not measured: this CPU has no bf16 matrix units (the probe skips bf16)"
    else:
        row["fp32_over_bf16_step"] = round(bf16_step_speedup(model, mb, seq, vocab, torch.device("cpu"),
                                                             repeats=2), 3)
    return row


def first_step_seconds(src: Path, data_dir: Path, work: Path) -> float:
    """Seconds from starting `lmforge train` on the demo config (with `src` first on the path) to its first
    logged step; the process is stopped there."""
    env = {**os.environ, "PYTHONPATH": str(src), "LMFORGE_CACHE_DIR": tempfile.mkdtemp(dir=work)}
    cmd = [sys.executable, "-u", "-m", "lmforge", "train", "-c", str(CONFIGS["demo"]),
           "--set", f"data.dir={data_dir}", "--set", f"run.dir={work / 'run'}", "--set", "run.overwrite=true",
           "--set", "train.max_steps=5", "--set", "train.log_every=1", "--set", "logging.progress=plain"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=env)
    seen = []
    try:
        for line in proc.stdout:
            if FIRST_STEP.match(line):
                return time.perf_counter() - t0
            seen.append(line)
        raise RuntimeError(f"{src}: lmforge train ended (status {proc.wait()}) before its first step:\n"
                           + "".join(seen[-20:]))
    finally:
        proc.terminate()
        proc.wait()


def startup(other: Path, data_dir: Path, repeats: int) -> dict:
    sides = {"other": other.resolve(), "this": (REPO / "src").resolve()}
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for side in (("other", "this") if i % 2 == 0 else ("this", "other")):
                s = first_step_seconds(sides[side], data_dir.resolve(), Path(tmp))
                seconds[side].append(round(s, 2))
                print(f"{side:5s} {sides[side]}: first step after {s:.1f} s", flush=True)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    return {"sides": {k: str(v) for k, v in sides.items()}, "seconds": seconds, "median_s": med,
            "other_over_this": round(med["other"] / med["this"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--force-ratio", action="store_true", help="time bf16 even without bf16 units (slow)")
    ap.add_argument("--startup", type=Path, help="another lmforge src dir to compare the demo's start-up to")
    ap.add_argument("--data-dir", type=Path, help="the demo's prepared data (default data/cache/demo)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from lmforge.utils.machine import cpu_facts
    from machine import machine_info

    facts = cpu_facts()
    info = machine_info(bf16_units=facts.bf16_units, physical_cores=facts.physical_cores,
                        logical_cores=facts.logical_cores)
    if args.startup:
        data_dir = args.data_dir or REPO / "data" / "cache" / "demo"
        result = {"machine": info, "startup": startup(args.startup, data_dir, args.repeats)}
        out = HERE / "results" / "startup_probe_startup.json"
        s = result["startup"]
        print(f"median seconds to the first step: other {s['median_s']['other']:.1f}, this "
              f"{s['median_s']['this']:.1f} ({s['other_over_this']}x)")
    else:
        rows = [probes(name, args.force_ratio) for name in args.configs]
        result = {"machine": info, "rows": rows}
        out = HERE / "results" / "startup_probe.json"
        for r in rows:
            ratio = r["fp32_over_bf16_step"]
            print(f"{r['config']:9s} {r['shape']:7s} precision {r['precision_cold']} (probe "
                  f"{r['precision_probe_cold_s']:.3f} s cold, {r['precision_probe_cached_s']:.3f} s cached), "
                  f"threads {r['threads']} (probe {r['threads_probe_s']:.3f} s), fp32/bf16 step "
                  + (f"{ratio:.2f}x" if ratio is not None else "not measured (no bf16 units)"))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
