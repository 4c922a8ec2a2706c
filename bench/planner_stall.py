"""Does a stall of the machine during the planner's probe change the plan? A/B of two source trees.

Each run is `lmforge train --budget B --plan-only` on the same corpus (the plan, without preparing or
training: the probe and the rules are the whole of it), from each tree in turn, quiet and stalled. A
stall is what a busy small machine does to the probe: --burners processes that spin on the CPU from
when the run says it begins measuring (a tiny step, then the first shape, d64-L2 at 16 x 256) until it
says the first shape's speed. The bench counts the shapes each side chose and keeps the tokens/s each
probe read.

    python bench/planner_stall.py --before /path/to/older/src            # 5 runs of each, 2 minutes
    python bench/planner_stall.py --before OLD/src --runs 8 --budget 5m
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from machine import write_results  # bench/ (on sys.path)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "planner_stall.json"
START = "planning: measuring training speed"


def burn(seconds: float, n: int, duty: float) -> list[subprocess.Popen]:
    """`n` processes that spin `duty` of every 10 ms (and sleep the rest) for `seconds`."""
    code = (f"import time\nend = time.perf_counter() + {seconds}\nwhile time.perf_counter() < end:\n"
            f"    t = time.perf_counter() + {0.01 * duty}\n    while time.perf_counter() < t: pass\n"
            f"    time.sleep({0.01 * (1 - duty)})\n")
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def plan_once(src: Path, budget: str, corpus: str, out: Path, stall: float, burners: int,
              duty: float) -> dict:
    """One --plan-only run from the tree `src`: the chosen shape and each candidate's probed tokens/s."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONUNBUFFERED": "1"}  # each line as it is said
    cmd = [sys.executable, "-m", "lmforge", "train", "--budget", budget, "--plan-only", "--plan-dir",
           str(out), "--overwrite", *sum((["--set", s] for s in (f"data.sources=[{json.dumps(corpus)}]",
                                                                  f"run.dir={out}-run")), [])]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    spinning: list[subprocess.Popen] = []
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if stall and not spinning and START in line:
            spinning = burn(stall, burners, duty)
        elif spinning and "tok/s" in line:  # the first shape is read: the stall ends
            for p in spinning:
                p.kill()
    rc = proc.wait()
    for p in spinning:
        p.kill()
        p.wait()
    if rc != 0:
        raise SystemExit(f"{src}: lmforge train --plan-only exited {rc}: {''.join(lines)[-800:]}")
    plan = json.loads((out / "plan.json").read_text())
    chosen = {c["key"]: c["value"] for c in plan["choices"]}
    return {"shape": f"d{chosen['model.d_model']}-L{chosen['model.n_layers']}",
            "probed": {c["shape"]: c["tokens_per_s"] for c in plan["candidates"] if c["tokens_per_s"]}}


def summary(rows: list[dict]) -> dict:
    """Per side and condition: how often each shape was chosen."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["side"], {}).setdefault(r["condition"], Counter())[r["shape"]] += 1
    return {side: {cond: dict(c) for cond, c in conds.items()} for side, conds in out.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the src/ of the tree to compare against")
    ap.add_argument("--after", type=Path, default=REPO / "src", help="the src/ of the tree to measure")
    ap.add_argument("--budget", default="2m")
    ap.add_argument("--corpus", default="builtin:python")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stall-for", type=float, default=10.0, help="seconds the burners spin at most (they "
                    "stop when the first shape's speed is said)")
    ap.add_argument("--burners", type=int, default=2, help="spinning processes (2: both of 2 cores)")
    ap.add_argument("--duty", type=float, default=0.5, help="the share of each 10 ms a burner spins")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    bad = [f"--{k} {v}" for k, v in sides.items() if not (v / "lmforge" / "__init__.py").is_file()]
    if bad or args.runs < 1 or not 0 < args.stall_for <= 30 or not 1 <= args.burners <= 64 \
            or not 0 < args.duty <= 1:
        ap.error(f"{', '.join(bad) or 'arguments'}: --before/--after name a tree's src/ (holding lmforge/); "
                 "--runs >= 1; --stall-for 0-30 s; --burners 1-64; --duty 0-1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmforge-stall-") as tmp:
        for i in range(args.runs):  # sides and conditions interleaved: a slow minute falls on all of them
            for condition, stall in (("quiet", 0.0), ("stalled", args.stall_for)):
                for side, src in sides.items():
                    t0 = time.perf_counter()
                    r = plan_once(src, args.budget, args.corpus, Path(tmp) / f"{side}-{condition}-{i}", stall,
                                  args.burners, args.duty)
                    rows.append({"run": i, "side": side, "condition": condition, **r,
                                 "wall_s": round(time.perf_counter() - t0, 1)})
                    print(json.dumps(rows[-1]), flush=True)
    return write_results(args.results, args, rows, summary(rows))


if __name__ == "__main__":
    main()
