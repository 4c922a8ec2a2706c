"""Quality per minute: `lmforge train --budget B` against (a) the best of a grid of 12 hand configurations at
the same budget and (b) nanoGPT's documented CPU recipe for the same wall time, on corpora the planner was
not tuned on (bench/corpora.py: builtin:python, on which its rules were measured; a generated prose
corpus and the King James Bible, which it never saw), each scored the same way: bits per byte over the
whole held-out text.

- planner: `lmforge train --budget B --set data.sources=[TRAIN] --set data.val_sources=[HELDOUT]`, the whole
  process timed (it prepares its own data inside the budget).
- grid: 6 shapes x 2 lrs (HAND_GRID), WSD over time, vocabulary 4096, each with its data prepared before
  its clock starts and 90% of the budget as pure training time (more than the planner's own run gets:
  an upper bound on what a hand-tuned run of that budget reaches); the best of the 12 is the reference.
- nanoGPT (`--nanogpt PATH`, a checkout of https://github.com/karpathy/nanoGPT; skipped without one): the
  README's CPU recipe (train_shakespeare_char with --device=cpu --compile=False --block_size=64
  --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000
  --dropout=0.0, its config's lr 1e-3, min_lr 1e-4, warm-up 100, beta2 0.99): characters as tokens, the
  same training text, its own model and optimizer (bench/nanogpt_ref.py), for the budget's wall time:
  where more than its 2000 iterations fit, max_iters and lr_decay_iters are raised to what fits at the
  speed of its warm-up's iterations 10-100 (`schedule_iters`: what a nanoGPT user sets for a longer
  run, so its cosine still ends at the budget); start-up and data encoding are not counted against it.
- scoring: lmforge runs with `lmforge eval loss RUN --set eval.max_batches=null` over data.val_sources (the
  held-out file, every window); nanoGPT's model over every window of the held-out text, summed
  nats / ln 2 / UTF-8 bytes.

Targets (issue 36): planner within 3% of the grid's best bpb; planner <= 0.75x nanoGPT's bpb. Hours of
exclusive CPU at the full set (3 corpora x 2/5/15 min x 14 runs): run it alone.

    python bench/planner_quality.py --nanogpt ~/nanoGPT                 # 2, 5, 15 minutes, every corpus
    python bench/planner_quality.py --budgets 5m --corpora prose
    python bench/planner_quality.py --tiny --out /tmp/pq                # a 20 s smoke run of every part
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

from corpora import CORPORA, cut_train, materialize  # bench/ (on sys.path)
from machine import machine_info, print_markdown_table

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "planner_quality.json"
SHAPES = {"d64-L2": (64, 2, 2), "d96-L3": (96, 3, 3), "d128-L4": (128, 4, 4), "d192-L4": (192, 4, 6),
          "d256-L4": (256, 4, 8), "d256-L6": (256, 6, 8)}
HAND_GRID = {f"{name}-lr{lr:g}": (d, n, h, lr) for name, (d, n, h) in SHAPES.items() for lr in (2e-3, 4e-3)}
TINY_GRID = ("d64-L2-lr0.004", "d96-L3-lr0.002")
TINY_SETS = ["model.max_seq_len=64", "train.micro_batch_size=4"]  # --tiny: steps of ms, kept by the planner
SEED = 1337  # run.seed's default: every row's; the k-th repeat of a row in a cell runs at SEED + k
NANOGPT_RECIPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, max_iters=2000,
                      lr=1e-3, min_lr=1e-4, warmup_iters=100, beta2=0.99, weight_decay=0.1, grad_clip=1.0)


def duration(text: str) -> float:
    sys.path.insert(0, str(REPO / "src"))
    from lmforge.config.train import parse_duration

    return parse_duration(text)


def lmforge(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def sets(*items: str) -> list[str]:
    return sum((["--set", s] for s in items), [])


def score(run_dir: Path) -> dict:
    """bpb and loss (nats/token, what bench/planner_rules.py fits its law to) of a run over every window of
    its data.val_sources."""
    proc = lmforge("eval", "loss", str(run_dir), *sets("eval.max_batches=null"))
    if proc.returncode != 0:
        raise RuntimeError(f"eval loss {run_dir}: {proc.stderr.strip()[-500:]}")
    found = sorted(run_dir.glob("eval_val_*.json"), key=lambda p: p.stat().st_mtime)
    out = json.loads(found[-1].read_text())
    return {"bpb": float(out["bpb"]), "loss": float(out["loss"])}


def progress(run_dir: Path) -> dict:
    """Steps and tokens a run trained in its time (metrics.jsonl's last training row): the same config on
    a slower machine does fewer, which is how rows of one cell measured on different machines show."""
    last: dict = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        row = json.loads(line)
        if "tokens_seen" in row:
            last = row
    return {"steps": last["step"], "tokens": last["tokens_seen"]} if last else {}


def run_planner(budget: float, train: Path, held: Path, out: Path, extra: list[str],
                seed: int = SEED) -> dict:
    run = out / "planner"
    shutil.rmtree(run, ignore_errors=True)  # the bench's own dir: a rerun plans (and prepares) afresh
    t0 = time.perf_counter()
    proc = lmforge("train", "--budget", f"{budget:g}s", *sets(
        f"data.sources=[{json.dumps(str(train))}]", f"data.val_sources=[{json.dumps(str(held))}]",
        f"run.dir={run}", "run.overwrite=true", f"run.seed={seed}", "logging.progress=none", *extra))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"name": "planner", "error": proc.stderr.strip()[-500:], "wall_s": round(wall, 1)}
    plan = json.loads((run / "plan.json").read_text())
    chosen = {c["key"]: c["value"] for c in plan["choices"]}
    return {"name": "planner", "seed": seed, **score(run), "wall_s": round(wall, 1), **progress(run),
            "shape": f"d{chosen['model.d_model']}-L{chosen['model.n_layers']}", "lr": chosen["optim.lr"],
            "vocab": chosen["data.tokenizer.vocab_size"]}


def run_hand(name: str, budget: float, train: Path, held: Path, out: Path, extra: list[str],
             seed: int = SEED) -> dict:
    d, n, h, lr = HAND_GRID[name]
    run = out / name
    data = out / ("data-v4096" if seed == SEED else f"data-v4096-s{seed}")  # the seed splits the documents
    common = [f"data.sources=[{json.dumps(str(train))}]", f"data.val_sources=[{json.dumps(str(held))}]",
              "data.tokenizer.vocab_size=4096", f"data.dir={data}", f"run.seed={seed}"]
    prep = lmforge("prepare", *sets(*common))  # before the clock: cached for every grid point
    if prep.returncode != 0:
        return {"name": name, "error": prep.stderr.strip()[-500:]}
    t0 = time.perf_counter()
    proc = lmforge("train", *sets(
        *common, f"run.dir={run}", "run.overwrite=true", f"model.d_model={d}", f"model.n_layers={n}",
        f"model.n_heads={h}",
        f"model.n_kv_heads={h // 2 if h % 2 == 0 else h}", "model.max_seq_len=256",
        "train.micro_batch_size=16", f"optim.lr={lr}", "schedule.name=wsd", "schedule.unit=time",
        f"schedule.warmup_seconds={min(15, 0.05 * budget):g}",
        "schedule.cooldown_fraction=0.3", "schedule.min_lr_ratio=0.0", f"train.max_time={0.9 * budget:g}",
        "train.max_steps=1000000000", "train.eval_every=0", "train.eval_batches=1", "checkpoint.every=0",
        "logging.progress=none", "logging.plot=false", *extra))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"name": name, "error": proc.stderr.strip()[-500:], "wall_s": round(wall, 1)}
    return {"name": name, "seed": seed, **score(run), "wall_s": round(wall, 1), **progress(run),
            "train_tokens": train_tokens(data)}


def train_tokens(data_dir: Path) -> int:
    """The distinct training tokens of a prepared corpus (what a grid row repeats in epochs)."""
    return int(json.loads((data_dir / "meta.json").read_text())["splits"]["train"]["tokens"])


def run_nanogpt(root: str, budget: float, train: Path, held: Path) -> dict:
    """nanoGPT's CPU recipe on characters for `budget` seconds of training; bpb over all of `held`."""
    import torch

    sys.path.insert(0, str(REPO / "src"))
    from nanogpt_ref import find_nanogpt, load_nanogpt

    checkout, why = find_nanogpt(root)
    if checkout is None:
        return {"name": "nanogpt", "error": why}
    module = load_nanogpt(checkout)
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(train.glob("*.txt")))
    held_text = held.read_text(encoding="utf-8")
    chars = sorted(set(text) | set(held_text))  # nanoGPT's prepare.py: the vocabulary of the whole text
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    r = NANOGPT_RECIPE
    torch.manual_seed(1337)
    cfg = module.GPTConfig(block_size=r["block_size"], vocab_size=len(chars), n_layer=r["n_layer"],
                           n_head=r["n_head"], n_embd=r["n_embd"], dropout=0.0, bias=False)
    model = module.GPT(cfg)
    opt = model.configure_optimizers(r["weight_decay"], r["lr"], (0.9, r["beta2"]), "cpu")

    max_iters = r["max_iters"]  # lr_decay_iters too, as in the recipe

    def lr_at(it: int) -> float:  # train.py's get_lr
        if it < r["warmup_iters"]:
            return r["lr"] * (it + 1) / (r["warmup_iters"] + 1)
        ratio = (it - r["warmup_iters"]) / (max_iters - r["warmup_iters"])
        return r["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (r["lr"] - r["min_lr"])

    t0, it, t10 = time.perf_counter(), 0, None
    while it < max_iters and time.perf_counter() - t0 < budget:
        if it == 10:
            t10 = time.perf_counter()
        elif it == r["warmup_iters"]:  # the cosine's length, from the warm-up's speed
            now = time.perf_counter()
            max_iters = schedule_iters(budget - (now - t0), (now - t10) / (it - 10), it, r["max_iters"])
        ix = torch.randint(len(data) - r["block_size"], (r["batch_size"],))
        x = torch.stack([data[i:i + r["block_size"]] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + r["block_size"]] for i in ix])
        for group in opt.param_groups:
            group["lr"] = lr_at(it)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1
    seconds = time.perf_counter() - t0
    model.eval()
    ids = torch.tensor([index[c] for c in held_text], dtype=torch.long)
    nats, t = 0.0, r["block_size"]
    with torch.no_grad():  # every window of the held-out text, each target scored once
        for start in range(0, len(ids) - 1, t):
            x, y = ids[start:start + t][None], ids[start + 1:start + 1 + t][None]
            x = x[:, :y.shape[1]]
            logits, _ = model(x, y)
            nats += float(torch.nn.functional.cross_entropy(logits[0], y[0], reduction="sum"))
    scored = held_text[1:len(ids)]
    return {"name": "nanogpt", "bpb": nats / math.log(2) / len(scored.encode("utf-8")), "iters": it,
            "max_iters": max_iters, "train_s": round(seconds, 1)}


def schedule_iters(left_s: float, s_per_iter: float, done: int, recipe_iters: int) -> int:
    """nanoGPT's max_iters (= lr_decay_iters) for a budget: the recipe's, or, where more fit in the
    `left_s` seconds left at `s_per_iter`, those (2% short, so the cosine ends before the clock does)."""
    return max(recipe_iters, done + int(0.98 * left_s / s_per_iter))


def compare(rows: list[dict], repeats: list[dict] = ()) -> dict:
    """The planner's first run against the grid's best and nanoGPT; with repeats of the planner, also the
    mean of all its runs (one run of a few minutes moves by 5-25% from run to run: the mean is the fairer
    number, while the grid's best of 12 single runs is biased low by the choice of the luckiest)."""
    ok = {r["name"]: r["bpb"] for r in rows if "bpb" in r}
    grid = {k: v for k, v in ok.items() if k in HAND_GRID}
    runs = [r["bpb"] for r in [*rows, *repeats] if r["name"] == "planner" and "bpb" in r]
    out: dict = {}
    if len(runs) > 1:
        out["planner_mean_bpb"] = sum(runs) / len(runs)
    if grid:
        best = min(grid, key=grid.get)
        out.update(grid_best=best, grid_best_bpb=grid[best])
        if "planner" in ok:
            out["planner_vs_grid"] = ok["planner"] / grid[best]
        if len(runs) > 1:
            out["planner_mean_vs_grid"] = out["planner_mean_bpb"] / grid[best]
    if "planner" in ok and "nanogpt" in ok:
        out["planner_vs_nanogpt"] = ok["planner"] / ok["nanogpt"]
        if len(runs) > 1:
            out["planner_mean_vs_nanogpt"] = out["planner_mean_bpb"] / ok["nanogpt"]
    return out


def table_row(c: dict) -> list[str]:
    planner = next((r for r in c["rows"] if r["name"] == "planner"), {})
    def ratio(key: str) -> str:
        mean_key = key.replace("planner_", "planner_mean_")
        mean = f" ({c[mean_key]:.3f})" if mean_key in c else ""
        return f"{c[key]:.3f}{mean}" if key in c else "-"

    bpb = f"{planner['bpb']:.4f}" if "bpb" in planner else "-"
    if "planner_mean_bpb" in c:
        bpb += f" ({c['planner_mean_bpb']:.4f})"
    return [c["corpus"], f"{c['budget_s']:g}s", bpb,
            f"{c['grid_best_bpb']:.4f} ({c['grid_best']})" if "grid_best" in c else "-",
            ratio("planner_vs_grid"), ratio("planner_vs_nanogpt")]


def save(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)


def resumable(old: dict, fresh: dict) -> dict:
    """The earlier results when they were measured like this run would measure (same CPU, core count,
    grid and recipe); else the fresh, empty results (the old rows are not comparable)."""
    same = all(old.get(k) == fresh[k] for k in ("tiny", "grid", "nanogpt_recipe")) and all(
        old.get("machine", {}).get(k) == fresh["machine"].get(k) for k in ("cpu_model", "cpu_count", "torch"))
    return old if same else fresh


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="2m,5m,15m")
    ap.add_argument("--corpora", default=",".join(CORPORA))
    ap.add_argument("--chars", type=int, default=20_000_000, help="characters of each corpus")
    ap.add_argument("--train-chars", type=int, default=None, help="train on only the first documents of "
                    "each corpus's training text, up to this many characters (bench/corpora.py cut_train; "
                    "the held-out text unchanged): cells named CORPUS-<N/1000>k, the small-corpus regime "
                    "where the planner bounds epochs")
    ap.add_argument("--nanogpt", default=None, help="a nanoGPT checkout (else $LMFORGE_NANOGPT, else none)")
    ap.add_argument("--out", default=str(REPO / "runs" / "planner-quality"))
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--resume", action="store_true", help="keep the rows --results already holds (same "
                    "machine and grid) and run only the missing ones")
    ap.add_argument("--repeat", default="", help="rows (grid names or planner) to run once more after each "
                    "cell's missing rows, kept under the cell's 'repeats': the spread of one configuration "
                    "from run to run on the same machine; the k-th repeat of a row in a cell runs at "
                    "run.seed 1337 + k (another initialisation, document split and order), so the spread "
                    "is the seed's as well as the machine's timing")
    ap.add_argument("--redo", default="", help="rows (grid names, planner or nanogpt) of the chosen cells "
                    "to measure again with --resume: their kept rows and repeats are dropped first (the "
                    "bench's way to re-measure a row whose method changed)")
    ap.add_argument("--rows", default="", help="rows (grid names, planner or nanogpt) to run, in this order, "
                    "instead of every row (with --resume: those of them still missing): the rows a fit needs "
                    "first when a sitting cannot hold the whole cell")
    ap.add_argument("--tiny", action="store_true", help="a smoke run: 20 s, the prose corpus at 300k "
                    "chars, 2 grid points, 4 x 64 tokens a micro-batch")
    args = ap.parse_args(argv)
    budgets = [duration(b) for b in args.budgets.split(",")]
    for flag, names, extra_ok in (("--repeat", args.repeat, ("planner",)),
                                  ("--redo", args.redo, ("planner", "nanogpt")),
                                  ("--rows", args.rows, ("planner", "nanogpt"))):
        unknown = [n for n in names.split(",") if n and n not in extra_ok and n not in HAND_GRID]
        if unknown:
            ap.error(f"{flag} {','.join(unknown)}: not a grid row (one of {', '.join(HAND_GRID)}) or "
                     f"{' or '.join(extra_ok)}")
    corpora, grid, chars, extra = args.corpora.split(","), list(HAND_GRID), args.chars, []
    if args.tiny:
        budgets, corpora, grid, chars, extra = [20.0], ["prose"], list(TINY_GRID), 300_000, TINY_SETS
    # --resume: rows already measured (in --results, same machine and grid) are kept and only the missing
    # ones run, each saved as soon as it is done: the full set takes longer than one sitting.
    results = {"machine": machine_info(), "tiny": args.tiny, "grid": grid, "nanogpt_recipe": NANOGPT_RECIPE,
               "cells": []}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.resume and Path(args.results).is_file():
        results = resumable(json.loads(Path(args.results).read_text()), results)
        stamp = results.setdefault("stamp", stamp)
    results["stamp"] = stamp
    out = Path(args.out) / stamp
    for corpus in corpora:
        train, held = materialize(corpus, Path(args.out) / "corpora", chars)
        if args.train_chars:
            corpus = f"{corpus}-{args.train_chars // 1000}k"
            train = cut_train(train, Path(args.out) / "corpora" / corpus / "train", args.train_chars)
        for budget in budgets:
            cell_dir = out / corpus / f"{budget:g}s"
            key = (corpus, budget)
            cell = next((c for c in results["cells"] if (c["corpus"], c["budget_s"]) == key), None)
            if cell is None:
                cell = {"corpus": corpus, "budget_s": budget, "rows": []}
                results["cells"].append(cell)
            redo = set(args.redo.split(",")) - {""}
            cell["rows"] = [r for r in cell["rows"] if r["name"] not in redo]
            if "repeats" in cell:  # a redone row's repeats measured the old method too
                cell["repeats"] = [r for r in cell["repeats"] if r["name"] not in redo]
            wanted = ["planner", *grid] + (["nanogpt"] if args.nanogpt or not args.tiny else [])
            if args.rows:
                wanted = [n for n in args.rows.split(",") if n]
            for name in wanted:
                if any(r["name"] == name and "bpb" in r for r in cell["rows"]):
                    continue
                if name == "planner":
                    row = run_planner(budget, train, held, cell_dir, extra)
                elif name == "nanogpt":
                    row = run_nanogpt(args.nanogpt, budget, train, held)
                else:
                    row = run_hand(name, budget, train, held, cell_dir, extra)
                cell["rows"] = [r for r in cell["rows"] if r["name"] != name] + [row]
                cell.update(compare(cell["rows"], cell.get("repeats", [])))
                save(results, Path(args.results))
            for name in args.repeat.split(",") if args.repeat else []:  # run-to-run spread of a row
                seed = SEED + 1 + sum(r["name"] == name for r in cell.get("repeats", []))
                row = (run_planner(budget, train, held, cell_dir / "repeat", extra, seed) if name == "planner"
                       else run_hand(name, budget, train, held, cell_dir / "repeat", extra, seed))
                cell.setdefault("repeats", []).append({**row, "name": name})
                cell.update(compare(cell["rows"], cell["repeats"]))
                save(results, Path(args.results))
            print(json.dumps(cell), flush=True)
    head = ["corpus", "budget", "planner bpb (mean)", "grid best", "planner / grid", "planner / nanoGPT"]
    print_markdown_table(head, [table_row(c) for c in results["cells"]])
    save(results, Path(args.results))
    print(f"wrote {args.results}")
    return results


if __name__ == "__main__":
    main()
