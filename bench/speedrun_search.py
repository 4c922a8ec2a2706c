"""The search behind configs/speedrun/cpu-5min.yaml: the lowest validation bits per byte on builtin:python
that `lmforge train` reaches in a fixed wall-clock budget of training (train.max_time) on this machine.

Every candidate is the speedrun config at the search's starting point (SEARCH_BASE: the demo's d256
model and lr 2e-3) plus a few --set overrides (shape, vocabulary, batch, lr, schedule), trained by the
real CLI in its own process, one after another (never two at once: they would share the cores). Each is
scored by its final validation bpb over the same held-out documents (data.val_fraction splits documents
before tokenizing, so bpb compares across vocabularies) and the same number of validation tokens. Two
rounds: every candidate at a short screening budget, then the best few at the full budget (a short screen
favours small, fast models; the full round is what counts).

    python bench/speedrun_search.py                             # screen at 60 s, then the best 3 at 5 min
    python bench/speedrun_search.py --screen 60 --final 300 --top 2
    python bench/speedrun_search.py --only base,d192-L4 --screen 0   # finals only (keeps the last screen)

Preparing a vocabulary's corpus and tokenizer happens once per vocabulary (cached in data/cache/) and is
not timed: the budget counts training only, as train.max_time does. Writes
bench/results/speedrun_search.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "speedrun" / "cpu-5min.yaml"
RESULTS = REPO / "bench" / "results" / "speedrun_search.json"
EVAL_TOKENS = 131_072  # validation tokens per candidate, whatever its batch and context


def vocab(v: int) -> list[str]:
    return [f"data.tokenizer.vocab_size={v}", f"data.dir=data/cache/speedrun-v{v}"]


# Where the search started (the demo's model and lr), applied before every candidate's own overrides, so
# the search stays the same experiment now that configs/speedrun/cpu-5min.yaml holds its winner (d128-L4).
SEARCH_BASE = ["model.d_model=256", "model.n_heads=8", "model.n_kv_heads=4", "optim.lr=2e-3"]

# name -> overrides of SEARCH_BASE
CANDIDATES: dict[str, list[str]] = {
    "base": [],
    "lr4e-3": ["optim.lr=4e-3"],
    "lr1e-3": ["optim.lr=1e-3"],
    "d192-L4": ["model.d_model=192", "model.n_heads=6", "model.n_kv_heads=3", "optim.lr=3e-3"],
    "d128-L4": ["model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2", "optim.lr=4e-3"],
    "d320-L5": ["model.d_model=320", "model.n_layers=5", "model.n_heads=10", "model.n_kv_heads=5"],
    "d256-L6": ["model.n_layers=6"],
    "v2048": vocab(2048),
    "v8192": vocab(8192),
    "seq128-b32": ["model.max_seq_len=128", "train.micro_batch_size=32"],
    "b8": ["train.micro_batch_size=8", "optim.lr=1.4e-3"],
    "cosine": ["schedule.name=cosine", "schedule.cooldown_fraction=null", "schedule.min_lr_ratio=0.1"],
}


def overrides_for(name: str, extra: list[str], budget: float, run_dir: Path) -> list[str]:
    sets = [*SEARCH_BASE, *CANDIDATES[name], *extra, f"train.max_time={budget}", f"run.dir={run_dir}",
            "logging.progress=none"]
    return sets


def eval_batches(sets: list[str]) -> int:
    """Validation micro-batches that make EVAL_TOKENS tokens with this candidate's batch and context."""
    sys.path.insert(0, str(REPO / "src"))
    from lmforge.config import load_config

    cfg = load_config(CONFIG, sets)
    return max(1, EVAL_TOKENS // (cfg.train.micro_batch_size * cfg.seq_len))


def prepare(sets: list[str]) -> None:
    """The candidate's corpus and tokenizer, before the clock starts (cached per vocabulary)."""
    subprocess.run([sys.executable, "-m", "lmforge", "prepare", "-c", str(CONFIG),
                    *sum((["--set", s] for s in sets), [])], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)


def run_one(name: str, budget: float, out_dir: Path) -> dict:
    run_dir = out_dir / f"{name}-{int(budget)}s"
    sets = overrides_for(name, [], budget, run_dir)
    sets.append(f"train.eval_batches={eval_batches(sets)}")
    prepare(sets)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lmforge", "train", "-c", str(CONFIG),
                           *sum((["--set", s] for s in sets), [])], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"name": name, "budget_s": budget, "error": proc.stderr.strip().splitlines()[-1:]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_bpb" in r][-1]
    budget_event = next((r for r in records if r.get("event") == "time_budget"), {})
    steps = [r for r in records if "tokens_per_s" in r]
    return {
        "name": name, "budget_s": budget, "overrides": CANDIDATES[name], "val_bpb": val["val_bpb"],
        "val_loss": val["val_loss"], "steps": val["step"], "train_seconds": budget_event.get("train_seconds"),
        "tokens_seen": budget_event.get("tokens_seen", steps[-1]["tokens_seen"] if steps else None),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps) if steps else None,
        "wall_s": round(wall, 1),
    }


def table(rows: list[dict]) -> None:
    ok = sorted((r for r in rows if "val_bpb" in r), key=lambda r: r["val_bpb"])
    if not ok:
        print("(no candidate finished)")
    else:
        print_markdown_table(
            ["candidate", "budget s", "val bpb", "steps", "tokens", "tok/s", "overrides"],
            [[r["name"], f"{r['budget_s']:g}", f"{r['val_bpb']:.4f}", str(r["steps"]),
              f"{r['tokens_seen']:,}" if r["tokens_seen"] else "-",
              f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-",
              " ".join(r["overrides"]) or "(config)"] for r in ok])
    for r in rows:
        if "error" in r:
            print(f"{r['name']} at {r['budget_s']:g}s failed: {r['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--screen", type=float, default=60.0, help="screening budget in seconds (0: skip)")
    ap.add_argument("--final", type=float, default=300.0, help="full budget in seconds")
    ap.add_argument("--top", type=int, default=3, help="candidates that go on to the full budget")
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    ap.add_argument("--out", default=str(REPO / "runs" / "speedrun-search"),
                    help="where the runs go (a new dated subdirectory)")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        ap.error(f"unknown candidates {unknown}; known: {', '.join(CANDIDATES)}")
    # a fresh directory per search: never train into (or over) an earlier search's runs
    out_dir = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    results: dict = {"machine": machine_info(), "config": str(CONFIG.relative_to(REPO)), "screen": [],
                     "final": []}
    finalists = names
    if RESULTS.is_file() and (args.screen == 0 or args.only):
        # finals after a screening, or a screening of some candidates: keep the other candidates' results
        kept = json.loads(RESULTS.read_text()).get("screen", [])
        results["screen"] = [r for r in kept if args.screen == 0 or r["name"] not in names]
    if args.screen > 0:
        for name in names:
            results["screen"].append(run_one(name, args.screen, out_dir))
            print(json.dumps(results["screen"][-1]), flush=True)
        print(f"\n### screening, {args.screen:g} s of training each\n")
        table(results["screen"])
        ranked = sorted((r for r in results["screen"] if "val_bpb" in r), key=lambda r: r["val_bpb"])
        finalists = [r["name"] for r in ranked[: args.top]]
    for name in finalists:
        results["final"].append(run_one(name, args.final, out_dir))
        print(json.dumps(results["final"][-1]), flush=True)
    if results["final"]:
        print(f"\n### full budget, {args.final:g} s of training each\n")
        table(results["final"])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
