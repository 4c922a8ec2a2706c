"""The results of a rating study: win rates with 95% confidence intervals, inter-rater agreement, and the
exports (a JSON / markdown summary; preference pairs that `lmforge dpo` reads).

Decisions, stated once:
- **Ties count half**: X's win rate is (wins + ties / 2) / ratings, so a study of all ties reads 50%
  (the two are judged equal) rather than having no value; the win / tie / loss counts are given too.
- **Wilson score interval** at 95% (z = 1.959964) on that rate with n = the number of ratings (a tie is
  half a success). Wilson keeps inside [0, 1] and behaves at 0% / 100% and small n, where the normal
  interval does not; a bootstrap would need a seed and gives a different answer per seed.
- **Pooled** counts every (rater, item) rating as one trial. Ratings of one item by several raters are
  not independent, so the pooled interval is narrower than it should be when raters agree; the per-rater
  rows and the agreement statistic are there to read it with.
- **Agreement** on the three categories x / y / tie (the run favoured, not the display position):
  Cohen's kappa for two raters over the items both rated; Fleiss' kappa for three or more over the items
  every rater rated. None (with the reason) when there are no such items or chance agreement is total.
- **Position**: how many choices went to the answer shown as A and as B, whichever run it was: a large
  gap means raters favour a position, which the per-item random order keeps out of the win rate.
- **Preference pairs**: one per item, chosen by the majority of its non-tie ratings; an item whose
  ratings split evenly (or are all ties) gives no pair, nor does one whose two answers are equal.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

from lmforge.jobserver.rating import choice_of, x_is_a

Z95 = 1.959963984540054
CATEGORIES = ("x", "y", "tie")


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion `successes / n` (None when n is 0)."""
    if n <= 0:
        return None
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def cohen_kappa(a: list[str], b: list[str]) -> float | None:
    """Cohen's kappa of two raters' labels on the same items (None: no items, or chance agreement is 1)."""
    n = len(a)
    if n == 0 or n != len(b):
        return None
    po = sum(x == y for x, y in zip(a, b)) / n
    ca, cb = Counter(a), Counter(b)
    pe = sum(ca[k] * cb[k] for k in set(ca) | set(cb)) / (n * n)
    return None if pe >= 1 else (po - pe) / (1 - pe)


def fleiss_kappa(counts: list[list[int]]) -> float | None:
    """Fleiss' kappa of a subjects x categories table of counts, the same number of raters per subject
    (None: no subjects, fewer than two raters, or chance agreement is 1)."""
    if not counts:
        return None
    m = sum(counts[0])
    if m < 2 or any(sum(row) != m for row in counts):
        return None
    n = len(counts)
    p_j = [sum(row[j] for row in counts) / (n * m) for j in range(len(counts[0]))]
    p_bar = sum((sum(c * c for c in row) - m) / (m * (m - 1)) for row in counts) / n
    pe = sum(p * p for p in p_j)
    return None if pe >= 1 else (p_bar - pe) / (1 - pe)


def _win_rate(winners: list[str]) -> dict[str, Any]:
    c = Counter(winners)
    n = len(winners)
    score = c["x"] + c["tie"] / 2
    ci = wilson(score, n)
    return {"ratings": n, "x_wins": c["x"], "y_wins": c["y"], "ties": c["tie"],
            "win_rate_x": score / n if n else None, "ci95": list(ci) if ci else None}


def agreement(by_rater: dict[str, dict[int, str]]) -> dict[str, Any]:
    """Cohen's kappa (two raters) or Fleiss' kappa (three or more) over the items they all rated."""
    raters = sorted(by_rater)
    if len(raters) < 2:
        return {"statistic": None, "kappa": None, "items": 0, "note": "agreement needs two or more raters"}
    common = sorted(set.intersection(*(set(by_rater[r]) for r in raters)))
    name = "cohen" if len(raters) == 2 else "fleiss"
    if len(raters) == 2:
        a, b = by_rater[raters[0]], by_rater[raters[1]]
        kappa = cohen_kappa([a[i] for i in common], [b[i] for i in common])
    else:
        table = [[sum(by_rater[r][i] == k for r in raters) for k in CATEGORIES] for i in common]
        kappa = fleiss_kappa(table)
    out: dict[str, Any] = {"statistic": name, "kappa": kappa, "items": len(common), "raters": len(raters)}
    if kappa is None:
        out["note"] = ("no item was rated by every rater" if not common
                       else "undefined: every rating fell in one category (chance agreement is 1)")
    return out


def results(study, ratings: list[Any]) -> dict[str, Any]:
    """The summary of `study` (a rating.Study) from its rating rows (rater, idx, winner)."""
    by_rater: dict[str, dict[int, str]] = {}
    for r in ratings:
        by_rater.setdefault(r["rater"], {})[r["idx"]] = r["winner"]
    per_rater = {name: _win_rate(list(v.values())) for name, v in sorted(by_rater.items())}
    pooled = _win_rate([w for v in by_rater.values() for w in v.values()])
    # Position bias: how often the answer shown first won, whichever run wrote it.
    shown = Counter(choice_of(r["winner"], x_is_a(study.secret, r["rater"], r["idx"])) for r in ratings)
    return {"object": "lmforge.study.results", "id": study.id, "name": study.name,
            "x": study.labels["x"], "y": study.labels["y"], "items": study.n_items,
            "raters": study.raters, "ties": "counted as half a win for each side",
            "interval": "Wilson score, 95%", "pooled": pooled, "per_rater": per_rater,
            "agreement": agreement(by_rater), "position": {k: shown[k] for k in ("A", "B", "tie")}}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _row(who: str, r: dict[str, Any]) -> str:
    ci = r["ci95"]
    span = f"{_pct(ci[0])} - {_pct(ci[1])}" if ci else "-"
    counts = f"{r['ratings']} | {r['x_wins']} | {r['ties']} | {r['y_wins']}"
    return f"| {who} | {counts} | {_pct(r['win_rate_x'])} | {span} |"


def _md(text: str) -> str:
    """Text for a markdown table cell: no pipes or newlines to break the table, no raw HTML."""
    return (text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
            .replace("\n", " "))


def markdown(res: dict[str, Any]) -> str:
    """The summary as a markdown report."""
    x, y = _md(res["x"]), _md(res["y"])
    lines = [f"# Rating study {_md(res['name'])} ({res['id']})", "",
             f"X = {x}, Y = {y}; {res['items']} items; ties count half; 95% Wilson intervals.", "",
             "| rater | ratings | X wins | ties | Y wins | X win rate | 95% CI |",
             "|---|---|---|---|---|---|---|", _row("pooled", res["pooled"])]
    lines += [_row(_md(name), r) for name, r in res["per_rater"].items()]
    a = res["agreement"]
    kappa = "-" if a["kappa"] is None else f"{a['kappa']:.3f}"
    what = {"cohen": "Cohen's kappa", "fleiss": "Fleiss' kappa", None: "kappa"}[a["statistic"]]
    lines += ["", f"Agreement: {what} = {kappa} over {a['items']} items" + (f" ({a['note']})" if a.get("note")
                                                                             else "") + "."]
    p = res["position"]
    lines += [f"Position: the answer shown as A won {p['A']} times, B {p['B']}, ties {p['tie']}."]
    return "\n".join(lines) + "\n"


def preference_pairs(items: list[Any], ratings: list[Any]) -> list[dict[str, str]]:
    """{"prompt", "chosen", "rejected"} per item with a majority among its non-tie ratings."""
    votes: dict[int, Counter] = {}
    for r in ratings:
        votes.setdefault(r["idx"], Counter())[r["winner"]] += 1
    pairs = []
    for it in items:
        v = votes.get(it["idx"], Counter())
        if v["x"] == v["y"] or it["answer_x"] is None or it["answer_x"] == it["answer_y"]:
            continue
        win, lose = ("answer_x", "answer_y") if v["x"] > v["y"] else ("answer_y", "answer_x")
        pairs.append({"prompt": it["prompt"], "chosen": it[win], "rejected": it[lose]})
    return pairs


def pairs_jsonl(pairs: list[dict[str, str]]) -> str:
    return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)
