"""What the operating-system sandbox costs per program: the built-in `code_functions` pass@5 programs
(reference solution + asserts, 5 samples per problem) run by lmforge's sandbox today (bubblewrap +
seccomp + the audit hook) and by the audit-hook-only executor it replaced (eval/sandbox.py at a git
revision, loaded from `git show`), interleaved rounds, medians.

    .venv/bin/python bench/sandbox_cost.py                  # 20 problems x 5 samples, 7 rounds
    .venv/bin/python bench/sandbox_cost.py --rounds 11 --workers 1 --before 8e961b3

Prints and writes bench/results/sandbox_cost.json: per side the wall time of the whole pass@5 run (run_many
with --workers threads, as `lmforge eval` runs it), per-program latency, and the ratio (sandbox / before).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lmforge.eval import sandbox  # noqa: E402
from lmforge.eval.bundle import build_bundle  # noqa: E402
from machine import machine_info  # noqa: E402


def old_executor(rev: str):
    """eval/sandbox.py as it was at `rev` (the audit-hook-only sandbox), as a module."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:src/lmforge/eval/sandbox.py"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "old_sandbox.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_sandbox"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def programs(samples: int) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        build_bundle(Path(d), n=40)
        docs = [json.loads(line) for line in (Path(d) / "code_functions.jsonl").read_text().splitlines()]
    return [d["prompt"] + d["canonical_solution"] + "\n" + d["test"] for d in docs for _ in range(samples)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--workers", type=int, default=2, help="programs at a time (lmforge eval uses 2)")
    ap.add_argument("--samples", type=int, default=5, help="samples per problem (pass@5)")
    ap.add_argument("--before", default="8e961b3", help="git revision of the audit-hook-only sandbox")
    args = ap.parse_args()
    progs = programs(args.samples)
    old = old_executor(args.before)
    print(f"{sandbox.check_isolation()}; {len(progs)} programs, {args.workers} at a time")
    sides = {
        "sandbox": lambda: sandbox.run_many(progs, workers=args.workers, timeout_s=5),
        "before": lambda: old.run_many(progs, workers=args.workers, timeout_s=5),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds):
        for name, run in sides.items() if r % 2 == 0 else reversed(sides.items()):
            t0 = time.perf_counter()
            outs = run()
            times[name].append(time.perf_counter() - t0)
            assert all(o.passed for o in outs), [o for o in outs if not o.passed][:1]
    med = {k: statistics.median(v) for k, v in times.items()}
    per = {k: med[k] / len(progs) * args.workers for k in med}
    ratio = med["sandbox"] / med["before"]
    for k in sides:
        print(f"{k:8s} pass@{args.samples} run {med[k]:.2f} s (median of {args.rounds}), "
              f"{per[k] * 1000:.0f} ms per program")
    extra = (per["sandbox"] - per["before"]) * 1000
    print(f"ratio sandbox / before: {ratio:.2f}x; extra per program {extra:.0f} ms")
    out = REPO / "bench" / "results" / "sandbox_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "machine": machine_info(), "programs": len(progs), "workers": args.workers, "rounds": args.rounds,
        "before": args.before, "seconds": times, "median_s": med, "per_program_s": per, "ratio": ratio,
        "layers": sandbox.check_isolation(),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
