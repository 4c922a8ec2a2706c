"""`lmforge sft --budget`'s quality: exact match on held-out shipped tasks of the planned run against the
best of a hand grid (LoRA rank x lr, GRID) at the same whole-process budget, one base model.

The base is bench/sft_planner_rules.py's (pretrained there, or here with the same settings when --work
has none); the task data come from another seed than the rules' (the rules were not chosen on these
prompts). Each grid configuration runs as `lmforge sft --budget B` with its rank, alpha and lr set (the
keys a user sets: everything else is planned around them, so the grid and the planned run differ only
in what the grid fixes); the planned run sets nothing. Every run is scored afterwards, outside its
budget, by `lmforge eval exact` on the whole held-out file.

    python bench/sft_planner_quality.py [--budget 2m] [--work DIR]   # ~7 x (budget + 20 s)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_info  # bench/machine.py (on sys.path)
from sft_planner_rules import exact_match, lmforge, pretrain  # bench/ (on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
RESULTS = REPO / "bench" / "results" / "sft_planner_quality.json"
GRID = [(r, lr) for r in (4, 16, 64) for lr in (1e-3, 4e-3)]
N_TRAIN, N_TEST, SEED = 4000, 240, 2


def budget_run(base: Path, data: Path, test: Path, where: Path, budget: str, sets: list[str]) -> dict:
    keys = [f"model.init_from={base}", f"sft.data=[{data}]", f"sft.val_data=[{test}]", "sft.template=chatml",
            f"run.dir={where}", "run.overwrite=true", "logging.progress=none", *sets]
    t0 = time.perf_counter()
    lmforge("sft", "--budget", budget, *[a for k in keys for a in ("--set", k)])
    wall = time.perf_counter() - t0
    plan = json.loads((where / "plan.json").read_text())
    chosen = {c["key"]: c["value"] for c in plan["choices"]}
    return {"sets": sets, "wall_s": round(wall, 1), "total_s": round(plan["actual"]["total"], 1),
            "plan": {k: chosen.get(k) for k in ("finetune.method", "finetune.r", "optim.lr", "train.seq_len",
                                                "train.micro_batch_size", "train.max_time")},
            "in_budget_exact_match": plan["final"].get("exact_match")}


def main() -> None:
    from lmforge.config.train import parse_duration
    from lmforge.data.instruct_tasks import split_disjoint, write_jsonl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="2m")
    ap.add_argument("--work", default=None, help="scratch dir (bench/sft_planner_rules.py's: its base)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="sft-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    base = work / "base"
    base_info = pretrain(base)
    split = split_disjoint(None, N_TRAIN, N_TEST, seed=SEED)
    data, test = work / f"train-{SEED}.jsonl", work / f"test-{SEED}.jsonl"
    write_jsonl(split.train, data, overwrite=True)
    write_jsonl(split.test, test, overwrite=True)
    rows = []
    runs = [("planned", [])] + [(f"lora-r{r}-lr{lr:g}", ["finetune.method=lora", f"finetune.r={r}",
                                                         f"finetune.alpha={2 * r}", f"optim.lr={lr}"])
                                for r, lr in GRID]
    for name, sets in runs:
        where = work / f"q-{args.budget}-{name}"
        done = where / "row.json"  # a run already made (the bench resumes)
        if done.exists():
            rows.append(json.loads(done.read_text()))
            continue
        row = {"name": name, **budget_run(base, data, test, where, args.budget, sets)}
        row.update(exact_match(where, test))
        done.write_text(json.dumps(row))
        print(f"{name}: exact match {row['exact_match']:.3f} ({row['total_s']}s of {args.budget})",
              flush=True)
        rows.append(row)
    planned, grid = rows[0], rows[1:]
    best = max(grid, key=lambda r: r["exact_match"])
    ratio = planned["exact_match"] / best["exact_match"] if best["exact_match"] else None
    out = {"budget": args.budget, "budget_s": parse_duration(args.budget), "base": base_info,
           "n_train": len(split.train), "n_test": len(split.test), "seed": SEED, "runs": rows,
           "best_grid": best["name"], "planned_exact_match": planned["exact_match"],
           "best_grid_exact_match": best["exact_match"], "ratio": ratio,
           "machine": machine_info(load_before=[round(x, 2) for x in load0],
                                   load_after=[round(x, 2) for x in os.getloadavg()])}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"planned {planned['exact_match']:.3f} vs best of the grid ({best['name']}) "
          f"{best['exact_match']:.3f}: ratio {ratio}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
