"""The measurements behind `lmforge sft --budget`'s rules (src/lmforge/tools/sft_planner.py cites the numbers
this writes to bench/results/sft_planner_rules.json; tests/unit/test_sft_planner.py checks the two agree).

One base model, pretrained here (BASE: d128-L4, a 1,024-token BPE, BASE_S seconds of builtin:python at the
speedrun's lr and schedule; the demo's d256 model takes ~3 s a step on this shared machine, too slow to
fine-tune meaningfully in a bench of minutes), fine-tuned on shipped instruction tasks (`lmforge tasks`,
every default family) for the same fixed training time per configuration, each scored by exact match of
its greedy replies on held-out prompts that training never saw (`lmforge eval exact`). The grid:

- LoRA on every linear layer at ranks 4, 16, 64 and lr 1e-3, 4e-3 (GRID; alpha = 2 r throughout, the
  ratio of configs/sft/lora.yaml and of PEFT's examples: the rank's own effect, not a change of scale);
- full fine-tuning (GRID).

Every run: micro-batch 8 x 64 tokens (the tasks' conversations are 20-60 tokens, packed; many small steps
in a budget of seconds: at 16 x 128 a 40 s run made 12 steps on this shared machine), STEPS steps of a
warm-up/stable/cooldown schedule (the budget planner's shape, counted in steps). The same number of steps
rather than the same seconds: on this machine, shared with other jobs, a fixed 40 s gave one configuration
285 steps and the next 8, so a time-bounded grid compared the load, not the configurations; the budget
planner turns seconds into steps at the speed its probe measures (full fine-tuning's slower steps count
there). The rules taken from it: the rank and lr of the best LoRA run, the lr of the best full run, and
whether full beat LoRA at the same steps at this model size (the method rule).

    python bench/sft_planner_rules.py [--steps 150] [--work DIR]   # ~12 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from machine import machine_info  # bench/machine.py (on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
RESULTS = REPO / "bench" / "results" / "sft_planner_rules.json"
# (method, rank, lr): LoRA ranks 4 / 16 / 64 x lr 1e-3 / 4e-3 but rank 64 at 1e-3, and full fine-tuning at
# 1e-3 (the grid was cut to what a machine shared with 8 other jobs ran in the session's time: steps ran
# at 120-700 tokens/s, so each configuration took 1-8 minutes)
GRID = [("lora", 4, 1e-3), ("lora", 4, 4e-3), ("lora", 16, 1e-3), ("lora", 16, 4e-3), ("lora", 64, 4e-3),
        ("full", None, 1e-3)]
N_TRAIN, N_TEST, SEED = 4000, 240, 1
BASE_S = 120.0
BASE = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
        "model.max_seq_len=128", "data.tokenizer.vocab_size=1024", 'data.sources=["builtin:python"]',
        "data.max_chars=4000000",
        "train.micro_batch_size=16", "optim.lr=4e-3", "schedule.name=wsd", "schedule.unit=time",
        "schedule.warmup_seconds=10", "schedule.cooldown_fraction=0.3", "schedule.min_lr_ratio=0.0",
        "train.max_steps=1000000000", f"train.max_time={BASE_S}", "train.eval_every=0",
        "train.eval_batches=8",
        "checkpoint.every=0", "logging.progress=none", "logging.plot=false", "train.precision=fp32"]


def pretrain(where: Path) -> dict:
    """The base model: BASE for BASE_S seconds (its final validation bpb in the results)."""
    if not (where / "config.yaml").exists():
        lmforge("train", *[a for s in [f"run.dir={where}", f"data.dir={where.parent / 'base-data'}", *BASE]
                           for a in ("--set", s)])
    records = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
    return {"sets": BASE, "steps": max(r.get("step", 0) for r in records),
            "val_bpb": [r["val_bpb"] for r in records if "val_bpb" in r][-1]}


def lmforge(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"lmforge {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def exact_match(run: Path, test: Path, again: bool = True) -> dict:
    """Overall and per-task exact match of `run` on `test` (lmforge eval exact; `again` False: the score
    already written)."""
    if again:
        lmforge("eval", "exact", str(run), "--tasks", str(test))
    out = json.loads(sorted(run.glob("eval_tasks_step_*.json"))[-1].read_text())
    acc = out["accuracy"]
    correct, total = sum(a["correct"] for a in acc.values()), sum(a["total"] for a in acc.values())
    return {"exact_match": correct / total, "correct": correct, "total": total,
            "by_task": {k: a["accuracy"] for k, a in acc.items()}}


def run_one(base: Path, data: Path, where: Path, steps: int, sets: list[str]) -> dict:
    common = [f"model.init_from={base}", f"sft.data=[{data}]", "sft.val_fraction=0.02",
              "sft.template=chatml", "sft.packing=true", f"run.dir={where}", "run.overwrite=true",
              f"train.max_steps={steps}",
              "train.micro_batch_size=8", "train.seq_len=64", "train.eval_every=0", "train.eval_batches=4",
              "train.log_every=20", "schedule.name=wsd",
              f"schedule.warmup_steps={max(1, steps // 20)}", "schedule.cooldown_fraction=0.3",
              "schedule.min_lr_ratio=0.0", "optim.weight_decay=0.0", "checkpoint.every=0",
              "checkpoint.keep_last=1", "logging.progress=none", "logging.plot=false", "train.precision=fp32",
              *sets]
    t0 = time.perf_counter()
    if not list(where.glob("eval_tasks_*.json")):
        lmforge("sft", *[a for s in common for a in ("--set", s)])
        wall = round(time.perf_counter() - t0, 1)
    else:  # run and scored by an earlier start of the bench (its wall time not kept)
        wall = None
    records = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
    steps = max((r.get("step", 0) for r in records), default=0)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"sets": sets, "wall_s": wall, "steps": steps, "val_loss": val[-1] if val else None}


def rank_key(row: dict) -> tuple[float, float]:
    """Better first: the higher exact match, then (where exact match ties, as at budgets too short for any
    configuration to answer exactly) the lower held-out loss."""
    return (row["exact_match"], -(row["val_loss"] if row["val_loss"] is not None else float("inf")))


def derive_rules(rows: list[dict]) -> dict:
    lora = max((r for r in rows if r["method"] == "lora"), key=rank_key)
    full = max((r for r in rows if r["method"] == "full"), key=rank_key)
    return {"lora_r": lora["r"], "lora_lr": lora["lr"], "full_lr": full["lr"],
            "full_beats_lora": rank_key(full) > rank_key(lora), "by": "exact match, then held-out loss",
            "lora_wall_s": lora["wall_s"], "full_wall_s": full["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150, help="fine-tuning steps per configuration")
    ap.add_argument("--work", default=None, help="scratch dir (default: a temporary one)")
    ap.add_argument("--rules-only", action="store_true", help="derive the rules again from the results file")
    args = ap.parse_args()
    if args.rules_only:
        out = json.loads(RESULTS.read_text())
        out["rules"] = derive_rules(out["grid"])
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out["rules"], indent=1))
        return
    import tempfile

    from lmforge.data.instruct_tasks import split_disjoint, write_jsonl

    work = Path(args.work or tempfile.mkdtemp(prefix="sft-rules-"))
    work.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    base = work / "base"
    base_info = pretrain(base)
    print(f"base: {base_info}", flush=True)
    split = split_disjoint(None, N_TRAIN, N_TEST, seed=SEED)
    data, test = work / "train.jsonl", work / "test.jsonl"
    write_jsonl(split.train, data, overwrite=True)
    write_jsonl(split.test, test, overwrite=True)
    rows = []
    for method, r, lr in GRID:
        sets = [f"finetune.method={method}", f"optim.lr={lr}"]
        if r is not None:
            sets += [f"finetune.r={r}", f"finetune.alpha={2 * r}", "finetune.targets=[all-linear]"]
        name = f"{method}-r{r}-lr{lr:g}" if r else f"{method}-lr{lr:g}"
        done = work / name / "row.json"  # a configuration already run (the bench resumes)
        if done.exists():
            rows.append(json.loads(done.read_text()))
            continue
        row = {"name": name, "method": method, "r": r, "lr": lr,
               **run_one(base, data, work / name, args.steps, sets)}
        row.update(exact_match(work / name, test, again=row["wall_s"] is not None))
        done.write_text(json.dumps(row))
        print(f"{name}: {row['steps']} steps, exact match {row['exact_match']:.3f}, val loss "
              f"{row['val_loss']}", flush=True)
        rows.append(row)
    rules = derive_rules(rows)
    out = {"base": base_info, "steps": args.steps, "n_train": len(split.train), "n_test": len(split.test),
           "seed": SEED, "grid": rows, "rules": rules,
           "machine": machine_info(load_before=[round(x, 2) for x in load0],
                                   load_after=[round(x, 2) for x in os.getloadavg()])}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(rules, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
