"""Which loss laws the python grid allows, and which shapes each would choose: the evidence for keeping or
replacing the budget planner's loss rule (src/lmforge/tools/planner.py LAW, fitted by
bench/planner_rules.py).

A fit's rms residual cannot decide between laws here: run-to-run noise is 1-3% of the loss and many laws fit
the python grid's rows within it. What the planner uses the law for is choosing a shape, so this scans the
law's family and asks each law what it would choose. For every E, alpha, beta on a grid and every repeat
half-life R* (bench/planner_rules.py's), A and B are the weighted least squares (relative residuals) over the
best row of each shape of bench/planner_quality.py's python grid at --budgets (with --near, only the shapes
within that fraction of each budget's best bpb: where the choice is made). Each law is then scored on every
planner_quality cell (kjv and prose held out): the shape it ranks first at the rows' own tokens, and the
regret, that shape's measured bpb over the cell's best. Written: the best law (rms log residual) of each
pattern of right and wrong firsts, the best that chooses right in all of python's cells, and the planner's
own law scored the same way.

    python bench/planner_law_scan.py                       # 2, 5 and 15 minutes, every shape
    python bench/planner_law_scan.py --near 0.1            # only shapes within 10% of each budget's best
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from planner_rules import HALF_LIVES, LR_CORPUS, QUALITY, REPO, cell_bests, grid_points, grid_sizes

sys.path.insert(0, str(REPO / "src"))
RESULTS = REPO / "bench" / "results" / "planner_law_scan.json"
GRID = dict(E=np.linspace(0.0, 3.0, 31), alpha=np.linspace(0.05, 1.6, 63), beta=np.linspace(0.05, 1.2, 47))
KEEP = 12  # patterns written, the best first


def scan(points: list[dict], cells: list[dict], grid: dict = GRID, half_lives: tuple[float, ...] = HALF_LIVES
         ) -> list[dict]:
    """Every law of the grid with A, B > 0: its constants, rms log residual over `points` and, per cell of
    `cells` (corpus, budget_s, shapes: [(n, tokens, distinct tokens, bpb)] best first), whether its first
    is the measured first and its regret."""
    from lmforge.tools.planner import effective_tokens

    n = np.array([p["n"] for p in points], float)
    loss = np.array([p["loss"] for p in points], float)
    e, alpha, beta = (a.ravel() for a in np.meshgrid(grid["E"], grid["alpha"], grid["beta"], indexing="ij"))
    out = []
    for h in half_lives:
        d = np.array([effective_tokens(p["tokens"], p["train_tokens"], h) for p in points], float)
        x, y = n[None] ** -alpha[:, None], d[None] ** -beta[:, None]
        t, w = loss[None] - e[:, None], 1.0 / loss[None] ** 2  # relative residuals ~ log residuals
        sxx, sxy, syy = (w * x * x).sum(1), (w * x * y).sum(1), (w * y * y).sum(1)
        sxt, syt = (w * x * t).sum(1), (w * y * t).sum(1)
        det = sxx * syy - sxy**2
        with np.errstate(divide="ignore", invalid="ignore"):
            a, b = (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det
            pred = e[:, None] + a[:, None] * x + b[:, None] * y
            rms = np.sqrt(np.mean(np.log(pred / loss[None]) ** 2, axis=1))
        keep = np.isfinite(rms) & (a > 0) & (b > 0)
        firsts = []
        for cell in cells:
            cn = np.array([s[0] for s in cell["shapes"]], float)
            cd = np.array([effective_tokens(s[1], s[2], h) for s in cell["shapes"]], float)
            firsts.append((a[:, None] * cn[None] ** -alpha[:, None] + b[:, None] * cd[None] ** -beta[:, None]
                           ).argmin(1))
        for i in np.flatnonzero(keep):
            out.append({"E": float(e[i]), "A": float(a[i]), "B": float(b[i]), "alpha": float(alpha[i]),
                        "beta": float(beta[i]), "repeat_half_life": h, "rms": float(rms[i]),
                        "first": [int(f[i]) for f in firsts]})
    out.sort(key=lambda r: r["rms"])
    return out


def judged(law: dict, cells: list[dict]) -> dict:
    """A law's choices over the cells: right/wrong first and regret (percent) per cell."""
    keys = [f"{c['corpus']} {c['budget_s']:g}s" for c in cells]
    regret = {k: round(100 * (c["shapes"][f][3] / c["shapes"][0][3] - 1), 2)
              for k, c, f in zip(keys, cells, law["first"], strict=True)}
    return {"law": {k: (round(v, 4) if k != "A" and k != "B" else float(f"{v:.5g}"))
                    for k, v in law.items() if k not in ("first",)},
            "pattern": "".join("Y" if f == 0 else "n" for f in law["first"]), "regret_pct": regret}


def planner_law(points: list[dict], cells: list[dict]) -> dict:
    """The planner's LAW and REPEAT_HALF_LIFE scored as the scanned laws are."""
    from lmforge.tools.planner import LAW, REPEAT_HALF_LIFE
    from lmforge.tools.planner import law_loss as loss

    rms = math.sqrt(sum(math.log(loss(p["n"], p["tokens"], p["train_tokens"]) / p["loss"]) ** 2
                        for p in points) / len(points))
    first = [min(range(len(c["shapes"])), key=lambda i: loss(*c["shapes"][i][:3])) for c in cells]
    return {**LAW, "repeat_half_life": REPEAT_HALF_LIFE, "rms": rms, "first": first}


def quality_cells() -> list[dict]:
    """planner_quality's cells as the scan takes them: each shape's best row (n, tokens, distinct, bpb)."""
    sizes = grid_sizes()
    return [{"corpus": corpus, "budget_s": budget,
             "shapes": [(sizes[s], r["tokens"], r["train_tokens"], r["bpb"]) for s, r in best]}
            for corpus, budget, best in cell_bests()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="120,300,900", help="the python grid's budgets fitted (seconds)")
    ap.add_argument("--near", type=float, default=None, help="fit only the shapes within this fraction of "
                    "each budget's best bpb (default: every shape)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    points = grid_points(tuple(float(b) for b in args.budgets.split(",")))
    if args.near is not None:
        budgets = {p["budget_s"] for p in points}
        best = {b: min(p["bpb"] for p in points if p["budget_s"] == b) for b in budgets}
        points = [p for p in points if p["bpb"] <= (1 + args.near) * best[p["budget_s"]]]
    cells = quality_cells()
    laws = scan(points, cells)
    python = [i for i, c in enumerate(cells) if c["corpus"] == LR_CORPUS]
    patterns: dict[str, dict] = {}
    for law in laws:  # rms order: the first law of each pattern is its best
        patterns.setdefault(judged(law, cells)["pattern"], law)
    right = next((law for law in laws if all(law["first"][i] == 0 for i in python)), None)
    out = {"source": str(QUALITY.relative_to(REPO)), "budgets_s": args.budgets, "near": args.near,
           "points": [p["name"] + f" at {p['budget_s']:g}s" for p in points],
           "cells": [f"{c['corpus']} {c['budget_s']:g}s" for c in cells],
           "grid": {k: [float(v[0]), float(v[-1]), len(v)] for k, v in GRID.items()},
           "half_lives": list(HALF_LIVES), "laws_scanned": len(laws),
           "planner": judged(planner_law(points, cells), cells),
           "best_python_right": judged(right, cells) if right else None,
           "best_per_pattern": [judged(law, cells) for law in list(patterns.values())[:KEEP]]}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{len(points)} fit points, {len(laws):,} laws; cells: {', '.join(out['cells'])} (Y: first right)")
    rows = [("planner's law", out["planner"]), ("best, python right", out["best_python_right"]),
            *(("best of pattern", j) for j in out["best_per_pattern"])]
    for label, j in rows:
        if j is None:
            print(f"{label}: none")
            continue
        law = j["law"]
        print(f"{label:18s} {j['pattern']} rms {law['rms']:.4f}  L = {law['E']:.2f} + {law['A']:.4g}/N^"
              f"{law['alpha']:.3f} + {law['B']:.4g}/D^{law['beta']:.3f}, R* {law['repeat_half_life']:g}; "
              "regret % "
              + " ".join(f"{v:g}" for v in j["regret_pct"].values()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
