"""The measurements behind the budget planner's rules (src/lmforge/tools/planner.py cites the numbers this
writes to bench/results/planner_rules.json; tests/unit/test_planner.py checks that the two agree).

- law: L(N, D) = E + A/N^alpha + B/D^beta fitted (Hoffmann et al. D.2, lmforge.tools.scaling.fit_law) to
  the best row of each shape (of its two lrs) of bench/planner_quality.py's python grid at 2 and 5 minutes
  (--budgets; d64-L2 to d256-L6, vocabulary 4096, scored over one held-out file;
  bench/results/planner_quality.json): N the non-embedding parameters (Kaplan's count, so that the
  ranking of shapes does not move with the vocabulary), D the effective tokens the planner counts
  (Muennighoff's, the grid repeating the corpus in epochs; their R* = 15.4, or with --free-half-life the
  R* that fits best), L the held-out loss. A refit's candidates go elsewhere (--out): the planner's
  constants are held to what this file holds. Published laws
  (Hoffmann, Epoch) are fitted at 1e7-1e10 parameters and over-predict these losses by 3-5x (printed
  below): the planner ranks shapes by this small-budget fit instead, which is what "smaller models that
  see more tokens won" looks like as a formula. (Until 2026-11-29 the law was fitted to the speedrun's
  13 runs below, d128-L4 and up on its own validation split: it put d64-L2 first at 5 minutes, where the
  grid measured d96-L3 3.5% better.)

From bench/results/speedrun_search.json (the measured search that chose configs/speedrun/cpu-5min.yaml:
12 candidates at 60 s of training and the best 3 at 300 s, builtin:python, 2 AMD EPYC cores):

- range: the law ranks shapes down to half the smallest N measured on builtin:python: the speedrun's
  runs (d128-L4 and up) and planner_quality's python grid at 2 minutes (d64-L2 to d256-L6 at two lrs each,
  where the smallest shape won and the bpb grew with N, the order the law gives them).
- lr: the width rule lr = min(cap, c * 128 / d_model), c the geometric mean of the better of 2e-3 and 4e-3
  at d128 in bench/planner_quality.py's python grid at 2 and 5 minutes (bench/results/planner_quality.json:
  2e-3 by 12% at 2 minutes, 4e-3 by 1.5% at 5: c = 2.83e-3), the cap the largest lr that won at any width
  (4e-3, at d64 and d96 at both budgets; no larger lr was measured). The speedrun's d256 sweep at 60 s,
  1e-3 to 4e-3, came out within noise.
- batch: DeepSeek LLM's B_opt = k C^0.3271 (tokens per step, C = 6ND), with k refitted so that the
  5-minute winner's compute gives its measured best batch (16 x 256 = 4096 tokens; 8 x 256 lost at both
  60 s and 300 s, 32 x 128 lost at 60 s).

Measured here, now (a few seconds): how fast `lmforge prepare` reads, trains a BPE on and encodes
builtin:python, and the characters per token at each vocabulary (to size data.max_chars and the
tokenizer's sample from the budget).

    python bench/planner_rules.py                  # writes bench/results/planner_rules.json
    python bench/planner_rules.py --keep-prepare   # the same, keeping the prepare rates it holds
    python bench/planner_rules.py --keep-prepare --budgets 120,300,900 --free-half-life --out /tmp/refit.json
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_info  # bench/machine.py (on sys.path)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
SEARCH = REPO / "bench" / "results" / "speedrun_search.json"
RESULTS = REPO / "bench" / "results" / "planner_rules.json"
QUALITY = REPO / "bench" / "results" / "planner_quality.json"  # bench/planner_quality.py's grids
LR_CORPUS, LR_BUDGET_S, LAW_BUDGETS_S = "python", 120.0, (120.0, 300.0)  # the grids the law and lr use
# repeat half-lives R* tried with --free-half-life (Muennighoff et al.'s fitted 15.4 first: it stays unless
# another fits the grid better, e.g. while no run repeats its corpus enough to tell them apart)
HALF_LIVES = (15.4, *(round(2 ** (k / 2), 3) for k in range(13)))
SEARCH_SHAPE = dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256, vocab_size=4096)
BATCH_EXPONENT = 0.3271  # DeepSeek LLM (Bi et al. 2024) eq. 1
PREPARE_CHARS = (500_000, 2_000_000)
VOCABS = (1024, 2048, 4096)


def search_points() -> list[dict]:
    """(name, budget, N, D, loss) of every speedrun run at vocabulary 4096."""
    from lmforge.config.schema import ModelConfig
    from lmforge.tools.scaling_inputs import param_count

    search = json.loads(SEARCH.read_text())
    out = []
    for r in search["screen"] + search["final"]:
        if "val_loss" not in r or any(o.startswith("data.tokenizer.vocab_size") for o in r["overrides"]):
            continue
        shape = dict(SEARCH_SHAPE)
        for o in r["overrides"]:
            key, value = o.split("=", 1)
            if key.startswith("model."):
                shape[key.removeprefix("model.")] = int(value)
        n = param_count(ModelConfig(**shape), "non-embedding")
        out.append({"name": r["name"], "budget_s": r["budget_s"], "n": n,
                    "d": r["tokens_seen"], "loss": r["val_loss"], "bpb": r["val_bpb"],
                    "d_model": shape["d_model"], "lr": _lr(r["overrides"])})
    return out


def _lr(overrides: list[str]) -> float:
    for o in overrides:
        if o.startswith("optim.lr="):
            return float(o.split("=", 1)[1])
    return 2e-3  # the search's starting point (SEARCH_BASE in bench/speedrun_search.py)


def grid_points(budgets: tuple[float, ...] = LAW_BUDGETS_S) -> list[dict]:
    """The better-lr row of each shape of planner_quality's python grid at `budgets`
    (bench/results/planner_quality.json): N its non-embedding parameters, D the effective tokens the
    planner counts (the grid reads the whole corpus and repeats it in epochs: Muennighoff's D' of the
    tokens trained over the corpus's distinct ones), L the held-out loss (nats/token, vocabulary 4096)."""
    from lmforge.tools.planner import effective_tokens

    cells = json.loads(QUALITY.read_text())["cells"] if QUALITY.is_file() else []
    sizes = grid_sizes()
    best: dict[tuple[str, float], dict] = {}
    for cell in (c for c in cells if c["corpus"] == LR_CORPUS and c["budget_s"] in budgets):
        for r in cell["rows"]:
            if not {"loss", "tokens", "train_tokens"} <= set(r) or "-lr" not in r["name"]:
                continue
            shape, lr = r["name"].split("-lr")
            key = (shape, cell["budget_s"])
            if key not in best or r["loss"] < best[key]["loss"]:
                best[key] = {"name": f"grid {r['name']}", "budget_s": cell["budget_s"], "n": sizes[shape],
                             "d": effective_tokens(r["tokens"], r["train_tokens"]), "tokens": r["tokens"],
                             "train_tokens": r["train_tokens"], "loss": r["loss"], "bpb": r["bpb"],
                             "lr": float(lr)}
    return sorted(best.values(), key=lambda p: (p["budget_s"], p["n"]))


def grid_sizes() -> dict[str, int]:
    """Non-embedding parameters of planner_quality's grid shapes."""
    from lmforge.config.schema import ModelConfig
    from lmforge.tools.scaling_inputs import param_count
    from planner_quality import SHAPES  # bench/ (on sys.path)

    return {name: param_count(ModelConfig(d_model=d, n_layers=n, n_heads=h,
                                          n_kv_heads=h // 2 if h % 2 == 0 else h, max_seq_len=256,
                                          vocab_size=4096), "non-embedding")
            for name, (d, n, h) in SHAPES.items()}


def fit(points: list[dict], half_lives: tuple[float, ...] | None = None) -> dict:
    """The law, and the repeat half-life R* of its effective tokens: the law fitted at each of `half_lives`
    (the planner's REPEAT_HALF_LIFE alone by default), the one with the smallest rms log residual kept (the
    points' D set to its effective tokens)."""
    from lmforge.tools.planner import REPEAT_HALF_LIFE, effective_tokens
    from lmforge.tools.scaling import LAWS, fit_law

    def at(half_life: float) -> tuple[float, object, list[float]]:
        d = [effective_tokens(p["tokens"], p["train_tokens"], half_life) for p in points]
        law = fit_law([p["n"] for p in points], d, [p["loss"] for p in points], count="non-embedding")
        rms = math.sqrt(sum((math.log(law.loss(p["n"], dp)) - math.log(p["loss"])) ** 2
                            for p, dp in zip(points, d, strict=True)) / len(points))
        return rms, law, d

    tried = {h: at(h) for h in half_lives or (REPEAT_HALF_LIFE,)}
    half_life = min(tried, key=lambda h: tried[h][0])  # the first of equals: Muennighoff's
    rms, law, d = tried[half_life]
    for p, dp in zip(points, d, strict=True):
        p["d"] = dp
    published = {name: [round(pub.loss(p["n"], p["d"]), 2) for p in points] for name, pub in LAWS.items()}
    return {"E": law.E, "A": law.A, "B": law.B, "alpha": law.alpha, "beta": law.beta,
            "repeat_half_life": half_life, "count": "non-embedding",
            "min_params": min(p["n"] for p in points), "rms_log_residual": rms,
            "rms_at_half_life": {f"{h:g}": round(t[0], 5) for h, t in tried.items()},
            "published_laws_predict": published}


def grid_lrs(budget_s: float = LR_BUDGET_S) -> dict[str, dict[str, float]]:
    """bpb of each width of planner_quality's python grid at `budget_s`, per lr: the runs where every
    width was trained at two lrs (python is the corpus the rules are measured on; prose is held out)."""
    cells = json.loads(QUALITY.read_text())["cells"] if QUALITY.is_file() else []
    cell = next((c for c in cells if c["corpus"] == LR_CORPUS and c["budget_s"] == budget_s), None)
    out: dict[str, dict[str, float]] = {}
    for r in (cell or {}).get("rows", []):
        if "bpb" in r and "-lr" in r["name"]:
            shape, lr = r["name"].split("-lr")
            out.setdefault(shape, {})[lr] = round(r["bpb"], 4)
    return out


def lr_rule(points: list[dict], budgets: tuple[float, ...] = LAW_BUDGETS_S) -> dict:
    """lr = min(cap, c x 128 / d_model): c the geometric mean, over the python grid's budgets, of the better
    lr at d128 (2e-3 at 2 minutes by 12%, 4e-3 at 5 by 1.5%), the cap the largest lr that won at any width
    (none above it was measured). Without the grid, the speedrun's winner (uncapped)."""
    grids = {b: grid_lrs(b) for b in budgets}
    sweep = {f"{p['lr']:g}": round(p["bpb"], 4) for p in points
             if p["budget_s"] == 60 and p["d_model"] == 256 and p["name"] in ("base", "lr4e-3", "lr1e-3")}
    better = {b: {shape: float(min(lrs, key=lrs.get)) for shape, lrs in g.items() if len(lrs) > 1}
              for b, g in grids.items() if g}  # a width measured at one lr so far has no better one
    at128 = [lrs["d128-L4"] for lrs in better.values() if "d128-L4" in lrs]
    if at128:
        c = math.exp(sum(math.log(lr) for lr in at128) / len(at128))
        return {"lr_at_128": c, "max_lr": max(lr for lrs in better.values() for lr in lrs.values()),
                "from": f"{LR_CORPUS} grid, the better lr of each width at "
                        + "; ".join(f"{b:g}s: {lrs}" for b, lrs in better.items()),
                "grid": {f"{b:g}": g for b, g in grids.items()}, "d256_sweep_60s": sweep}
    final = [p for p in points if p["budget_s"] == max(q["budget_s"] for q in points)]
    best = min(final, key=lambda p: p["loss"])
    return {"lr_at_128": best["lr"] * best["d_model"] / 128, "max_lr": None, "from": f"{best['name']} at "
            f"{best['budget_s']:g}s: lr {best['lr']:g} at d_model {best['d_model']}", "d256_sweep_60s": sweep}


def cell_bests() -> list[tuple[str, float, list[tuple[str, dict]]]]:
    """Each cell of planner_quality with two or more grid shapes: (corpus, budget_s, [(shape, its best
    row)] best bpb first)."""
    cells = json.loads(QUALITY.read_text())["cells"] if QUALITY.is_file() else []
    sizes, out = grid_sizes(), []
    for cell in cells:
        best: dict[str, dict] = {}
        for r in cell["rows"]:
            shape = r["name"].split("-lr")[0]
            if {"bpb", "tokens", "train_tokens"} <= set(r) and shape in sizes and (
                    shape not in best or r["bpb"] < best[shape]["bpb"]):
                best[shape] = r
        if len(best) >= 2:
            out.append((cell["corpus"], cell["budget_s"], sorted(best.items(), key=lambda kv: kv[1]["bpb"])))
    return out


def ranks(law: dict) -> list[dict]:
    """Each cell of planner_quality (every corpus and budget, kjv and prose held out from the fit): its shapes
    in the order of their best row's bpb and in the order of the law's loss at those rows' own tokens: what
    the planner uses the law for is choosing the first; its regret is the bpb of the law's first over the
    measured first's."""
    from lmforge.tools.planner import effective_tokens

    sizes, out = grid_sizes(), []
    for corpus, budget, best in cell_bests():
        loss = {s: law["E"] + law["A"] / sizes[s] ** law["alpha"] + law["B"] / effective_tokens(
            r["tokens"], r["train_tokens"], law["repeat_half_life"]) ** law["beta"] for s, r in best}
        rows = dict(best)
        measured, predicted = [s for s, _ in best], sorted(loss, key=loss.get)
        out.append({"corpus": corpus, "budget_s": budget, "measured": measured,
                    "predicted": predicted, "first_right": measured[0] == predicted[0],
                    "regret": round(rows[predicted[0]]["bpb"] / rows[measured[0]]["bpb"] - 1, 4),
                    "bpb": {s: round(rows[s]["bpb"], 4) for s in measured}})
    return out


def law_range(points: list[dict]) -> dict:
    """The smallest model the law may choose: half the smallest non-embedding N measured on the rules'
    corpus, in the speedrun's runs or planner_quality's python grid at 2 minutes (which trained d64-L2 to
    d256-L6 and found the smallest best, as the law ranks them: smaller models that see more tokens)."""
    grid = grid_lrs()
    sizes = {name: n for name, n in grid_sizes().items() if name in grid}
    smallest = min([p["n"] for p in points] + list(sizes.values()))
    best = {name: min(lrs.values()) for name, lrs in grid.items()}
    return {"min_params": smallest, "grid_params": sizes, "grid_best_bpb": best,
            "from": "the smallest N measured: speedrun runs and the python grid at "
                    f"{LR_BUDGET_S:g}s ({' < '.join(sorted(best, key=best.get))} by bpb)"}


def batch_rule(points: list[dict]) -> dict:
    final = [p for p in points if p["budget_s"] == max(q["budget_s"] for q in points)]
    best = min(final, key=lambda p: p["loss"])
    tokens = 16 * 256  # the winner's micro-batch x context, accumulation 1 (configs/speedrun/cpu-5min.yaml)
    compute = 6 * best["n"] * best["d"]
    return {"coefficient": tokens / compute**BATCH_EXPONENT, "exponent": BATCH_EXPONENT,
            "from": f"{best['name']}: {tokens} tokens/step at C = {compute:.3g}"}


def prepare_rates() -> dict:
    """Characters per second of a whole `prepare` (read + BPE training + encoding) and chars per token."""
    from lmforge.config.load import load_config
    from lmforge.data.prepare import prepare

    rates, cpt = [], {}
    for vocab in VOCABS:
        for chars in PREPARE_CHARS:
            with tempfile.TemporaryDirectory() as tmp:
                cfg = load_config(None, [f"data.max_chars={chars}", f"data.tokenizer.vocab_size={vocab}",
                                         f"data.dir={tmp}/data", f"run.dir={tmp}/run"])
                t0 = time.perf_counter()
                meta = prepare(cfg, console=lambda _: None).meta
                seconds = time.perf_counter() - t0
            tokens = sum(s["tokens"] for s in meta["splits"].values())
            rates.append(chars / seconds)
            cpt[vocab] = chars / tokens
            print(f"prepare {chars:,} chars at vocab {vocab}: {seconds:.2f}s, {chars / tokens:.2f} chars/tok")
    return {"chars_per_s": sorted(rates)[len(rates) // 4],  # a low quartile: a busy machine is slower
            "chars_per_token": {str(v): round(c, 3) for v, c in cpt.items()},
            "measured": [round(r) for r in rates]}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep-prepare", action="store_true", help="keep the prepare rates the results already "
                    "hold (measured on a busy machine: an idle one's faster rate lets a busy one overrun "
                    "preparing's share) and recompute the rest from the stored runs")
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in LAW_BUDGETS_S), help="the python grid's "
                    "budgets (seconds) the law and the lr rule are fitted to (a refit's candidates: more "
                    "budgets than the planner's rules use)")
    ap.add_argument("--free-half-life", action="store_true", help="fit the repeat half-life R* too (the "
                    f"one of {', '.join(f'{h:g}' for h in HALF_LIVES)} that fits best) instead of the "
                    "planner's REPEAT_HALF_LIFE")
    ap.add_argument("--out", default=str(RESULTS), help="where to write (a refit's candidates elsewhere: "
                    "the planner's constants are held equal to bench/results/planner_rules.json)")
    args = ap.parse_args()
    budgets = tuple(float(b) for b in args.budgets.split(","))
    points, grid = search_points(), grid_points(budgets)
    if len(grid) < 5:  # the law has five constants
        sys.exit(f"planner_rules: {len(grid)} python grid rows with a held-out loss in {QUALITY}; the law "
                 "needs the grid at 2 and 5 minutes: python bench/planner_quality.py --budgets 2m,5m "
                 "--corpora python")
    old = json.loads(RESULTS.read_text()) if args.keep_prepare else {}
    prepare = old["prepare"] if "prepare" in old else prepare_rates()
    out = {"machine": old.get("machine") or machine_info(), "source": str(SEARCH.relative_to(REPO)),
           "points": points, "grid_points": grid,
           "law": fit(grid, HALF_LIVES if args.free_half_life else None), "range": law_range(points),
           "lr": lr_rule(points, budgets), "batch": batch_rule(points), "prepare": prepare}
    out["ranks"] = ranks(out["law"])
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    law = out["law"]
    print(f"law: L = {law['E']:.4g} + {law['A']:.4g}/N^{law['alpha']:.4g} + {law['B']:.4g}/D^"
          f"{law['beta']:.4g}, R* {law['repeat_half_life']:g} "
          f"(rms log residual {law['rms_log_residual']:.4f}, "
          f"the best of each shape at each budget {args.budgets} s of the python grid: {len(grid)} runs)")
    for r in out["ranks"]:
        print(f"{r['corpus']} {r['budget_s']:g}s: measured {' < '.join(r['measured'])}; law "
              f"{' < '.join(r['predicted'])} (first {'right' if r['first_right'] else 'WRONG'}, "
              f"regret {100 * r['regret']:.1f}%)")
    print(f"law's range: N >= {out['range']['min_params'] / 2:,.0f} ({out['range']['from']})")
    print(f"lr at d_model 128: {out['lr']['lr_at_128']:g}; batch k {out['batch']['coefficient']:.4g}")
    prep = out["prepare"]
    print(f"prepare: {prep['chars_per_s']:,.0f} chars/s; chars/token {prep['chars_per_token']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
