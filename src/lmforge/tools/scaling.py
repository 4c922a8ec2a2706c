"""Scaling laws: the Chinchilla parametric loss L(N, D) = E + A/N^alpha + B/D^beta, fitted to runs, and the
compute-optimal plan (model size, tokens, a config that realises them) it implies.

- Published laws: Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", approach 3) and
  Epoch AI's replication (Besiroglu et al. 2024, arXiv 2404.10102). Both count N as *all* parameters,
  embeddings included (Chinchilla's convention; Kaplan et al. 2020 left embeddings out, which is most of
  why the two disagree: Pearce & Song 2024). A law fitted here records which count it used.
- Hoffmann's body text rounds the fit to alpha 0.34, beta 0.28, E 1.69; its tables were computed from the
  unrounded values of the paper's TeX source (E 1.6934, alpha 0.3392, beta 0.2849), which are used here:
  only they reproduce the published approach-3 numbers (e.g. 40B parameters at Gopher's 5.76e23 FLOPs;
  the rounded ones give 32B). Besiroglu et al. section 4 traces this bias.
- The fit follows Hoffmann et al. appendix D.2: Huber loss (delta 1e-3) on log L against the log-sum-exp
  form log L = LSE(a - alpha log N, b - beta log D, e) with A = e^a, B = e^b, E = e^e, L-BFGS started from
  a grid of initialisations, best kept. L-BFGS is torch's (float64, strong-Wolfe line search): torch is
  already a dependency and scipy is not, and the problem has five parameters. All 4,500 grid points are
  scored at once; L-BFGS runs from the best 8 (the rest only find the same basins again, slower).
- A run gives one point by default: N from its resolved config, D = tokens_seen at its last step, L its
  final validation loss. `all_evals` adds every earlier evaluation, which sits above what a run of that
  length would reach (its lr had not decayed), so it is opt-in.
- The plan: N and D from the closed form, a shape from `choose_shape` (d_model a multiple of 64/128, head
  dim 64/128, aspect ratio d_model/n_layers 64 below 1B parameters and 128 above), batch and peak lr from
  DeepSeek LLM's fitted rules clamped to sane ranges, steps = D / tokens per step.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import LmforgeError
from lmforge.tools.scaling_inputs import Point, fit_points, param_count, run_points
from lmforge.utils.bounds import real, whole

POSITIVE = real(0.0, None, lo_open=True)  # --compute / --params / --tokens: finite and above 0
MAX_BOOTSTRAP = whole(0, 1000)  # each refit is a few L-BFGS runs; a thousand is already a long wait
PLOTS = ("scaling_isoloss.png", "scaling_isoflop.png")  # what `scaling fit --plot DIR` writes there

HUBER_DELTA = 1e-3  # Hoffmann et al. D.2 (and Besiroglu et al.)
COUNTS = ("total", "non-embedding")


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta, N counted as `count` says, D in tokens, L in nats/token."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    name: str = "fit"
    count: str = "total"  # "total": embeddings included (Chinchilla); "non-embedding" (Kaplan)

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    @property
    def a(self) -> float:
        """N_opt grows as C^a along the compute-optimal frontier (Hoffmann et al. eq. 4)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    def optimum(self, compute: float) -> tuple[float, float]:
        """Compute-optimal (N, D) for `compute` FLOPs with C = 6ND: N = G (C/6)^a, D = (C/6) / N."""
        n = self.G * (compute / 6.0) ** self.a
        return n, compute / 6.0 / n

    def compute_for_params(self, n: float) -> float:
        """The budget for which `n` parameters are compute-optimal (the inverse of `optimum`)."""
        return 6.0 * (n / self.G) ** (1.0 / self.a)

    def compute_for_tokens(self, d: float) -> float:
        """The budget for which `d` tokens are compute-optimal: D = (C/6)^(1-a) / G."""
        return 6.0 * (d * self.G) ** (1.0 / (1.0 - self.a))


LAWS: dict[str, Law] = {
    # Hoffmann et al. 2022, eq. 10 / appendix D.2, at the TeX source's precision (see the module doc).
    "hoffmann": Law(E=1.6934, A=406.4, B=410.7, alpha=0.3392, beta=0.2849, name="hoffmann"),
    # Besiroglu et al. 2024 (Epoch AI), table 1: refit on data reconstructed from Hoffmann's figure 4.
    "epoch": Law(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658, name="epoch"),
}


def load_law(spec: str) -> Law:
    """A published law by name (hoffmann, epoch) or one that `scaling fit --out` wrote (a JSON file)."""
    if spec in LAWS:
        return LAWS[spec]
    path = Path(spec)
    if not path.is_file():
        raise LmforgeError(f"--law {spec!r}: not a known law ({', '.join(LAWS)}) nor a fit file written by "
                           "`lmforge scaling fit --out FILE`")
    from lmforge.utils.io import read_json_object

    raw = read_json_object(path, "scaling fit file").get("law")
    if not isinstance(raw, dict):
        raise LmforgeError(f"{path}: no 'law' object; give a file written by `lmforge scaling fit --out`")
    values = {}
    for k in ("E", "A", "B", "alpha", "beta"):
        v = raw.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise LmforgeError(f"{path}: law.{k} must be a positive number, got {v!r}")
        values[k] = float(v)
    count = raw.get("count", "total")
    if count not in COUNTS:
        raise LmforgeError(f"{path}: law.count must be one of {', '.join(COUNTS)}, got {count!r}")
    return Law(**values, name=str(path), count=count)


# -- fitting ------------------------------------------------------------------------------------------
# Hoffmann et al. D.2's grid of initialisations: alpha, beta in {0, .5, .., 2}, e in {-1, -.5, .., 1},
# a, b in {0, 5, .., 25}. Every grid point's objective is evaluated at once (a few thousand x points,
# cheap); L-BFGS then runs from the `starts` best of them: the far corners of the grid only rediscover
# the same few basins at many times the cost.
GRID = dict(a=[0.0, 5.0, 10.0, 15.0, 20.0, 25.0], b=[0.0, 5.0, 10.0, 15.0, 20.0, 25.0],
            e=[-1.0, -0.5, 0.0, 0.5, 1.0], alpha=[0.0, 0.5, 1.0, 1.5, 2.0], beta=[0.0, 0.5, 1.0, 1.5, 2.0])


def _objective(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor, log_l: torch.Tensor,
               delta: float) -> torch.Tensor:
    """Huber loss of log L residuals, summed over points, for every row of theta (K, 5) -> (K,).

    Divided by delta: the same minimiser, but values and gradients of order one, so that L-BFGS's
    tolerances do not stop it early (Besiroglu et al. found Hoffmann's fit stopped before converging)."""
    a, b, e, alpha, beta = theta.unbind(-1)  # each (K,)
    terms = torch.stack([a[:, None] - alpha[:, None] * log_n, b[:, None] - beta[:, None] * log_d,
                         e[:, None].expand(-1, log_n.numel())], dim=-1)  # (K, P, 3)
    r = torch.logsumexp(terms, dim=-1) - log_l  # (K, P)
    huber = torch.nn.functional.huber_loss(r, torch.zeros_like(r), reduction="none", delta=delta)
    return huber.sum(-1) / delta


def _lbfgs(theta0: torch.Tensor, data: tuple[torch.Tensor, ...], delta: float) -> tuple[torch.Tensor, float]:
    theta = theta0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = _objective(theta[None], *data, delta)[0]
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        value = float(_objective(theta[None], *data, delta)[0])
    return theta.detach(), value


def fit_law(n: Sequence[float], d: Sequence[float], loss: Sequence[float], *, delta: float = HUBER_DELTA,
            starts: int = 8, count: str = "total", init: Law | None = None) -> Law:
    """Fit E, A, B, alpha, beta to observed (N, D, L) as Hoffmann et al. D.2 (see the module doc): L-BFGS
    from the `starts` best points of the grid (and from `init`, a law to start from, when given)."""
    if not (len(n) == len(d) == len(loss)):
        raise ValueError("n, d and loss must have the same length")
    if len(n) < 5:
        raise LmforgeError(f"a scaling-law fit has 5 parameters and needs at least 5 (N, D, loss) points; "
                           f"got {len(n)}: train more runs (e.g. lmforge sweep) or add --all-evals")
    data = tuple(torch.tensor(x, dtype=torch.float64).log() for x in (n, d, loss))
    grid = torch.tensor(list(itertools.product(*(GRID[k] for k in ("a", "b", "e", "alpha", "beta")))),
                        dtype=torch.float64)  # (K, 5)
    with torch.no_grad():
        values = _objective(grid, *data, delta)
    inits = [grid[i] for i in values.argsort()[:starts].tolist()]
    if init is not None:
        # E may have underflowed to 0 (the fit drove e to -inf: no floor in the data); start it at 1e-3
        start = [math.log(init.A), math.log(init.B), math.log(max(init.E, 1e-3)), init.alpha, init.beta]
        inits.append(torch.tensor(start, dtype=torch.float64))
    best_law, best = None, math.inf
    for theta0 in inits:
        theta, value = _lbfgs(theta0, data, delta)
        a, b, e, alpha, beta = theta.tolist()
        if not (math.isfinite(value) and value < best and max(a, b, e) < 700):  # exp(>709) overflows
            continue
        best_law, best = Law(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta,
                             count=count), value
    if best_law is None:
        raise LmforgeError(f"no fit of L = E + A/N^alpha + B/D^beta to these {len(n)} points stayed finite: "
                           "the losses do not follow that form (check that they fall as N and D grow)")
    return best_law


def bootstrap(law: Law, n: Sequence[float], d: Sequence[float], loss: Sequence[float], samples: int,
              seed: int = 0) -> dict[str, tuple[float, float]]:
    """95% percentile intervals of each parameter over `samples` refits on points drawn with replacement;
    each refit starts from `law` (the fit on all points) and the best grid point."""
    gen = torch.Generator().manual_seed(seed)
    fits: list[Law] = []
    for _ in range(samples):
        idx = torch.randint(len(n), (len(n),), generator=gen).tolist()
        if len(set(idx)) < 5:
            continue
        try:
            fits.append(fit_law([n[i] for i in idx], [d[i] for i in idx], [loss[i] for i in idx], starts=1,
                                count=law.count, init=law))
        except LmforgeError:
            continue  # a degenerate resample (e.g. one N only) has no finite fit: it gives no interval
    out = {}
    for k in ("E", "A", "B", "alpha", "beta"):
        vals = torch.tensor([getattr(f, k) for f in fits], dtype=torch.float64)
        ok = len(fits) > 1
        out[k] = (float(vals.quantile(0.025)), float(vals.quantile(0.975))) if ok else (math.nan, math.nan)
    return out


def config_point(cfg, count: str = "total") -> tuple[int, int]:
    """(N, D) a config will train: its parameter count and train.max_steps' tokens (batch ramp included)."""
    from lmforge.optim.batch_ramp import BatchRamp

    if cfg.model.vocab_size is None:
        raise LmforgeError("the config has no model.vocab_size; set it (the tokenizer's vocabulary, rounded "
                           "up to a multiple of 64) to count its parameters")
    n = param_count(cfg.model, count)
    return n, int(BatchRamp(cfg, 1).total_tokens(cfg.train.max_steps))


def parse_predict(spec: str) -> tuple[float, float]:
    """'N=1.2e6,D=3e8' -> (1.2e6, 3e8)."""
    vals: dict[str, float] = {}
    for item in spec.split(","):
        key, _, raw = item.partition("=")
        try:
            vals[key.strip().upper()] = float(raw)
        except ValueError:
            raise LmforgeError(f"--predict {spec!r}: {item!r} is not KEY=NUMBER") from None
    if set(vals) != {"N", "D"} or min(vals.values()) <= 0:
        raise LmforgeError(f"--predict {spec!r}: give positive N and D, e.g. --predict N=1.2e6,D=3e8")
    return vals["N"], vals["D"]


def fit_record(law: Law, points: list[Point], ci: dict | None, delta: float = HUBER_DELTA) -> dict[str, Any]:
    """What `scaling fit --out` writes (and `scaling plan --law FILE` reads back)."""
    residuals = [math.log(law.loss(p.n, p.d)) - math.log(p.loss) for p in points]
    return {"law": {k: getattr(law, k) for k in ("E", "A", "B", "alpha", "beta", "count")},
            "ci95": {k: list(v) for k, v in (ci or {}).items()},
            "method": f"Huber(delta={delta}) on log-loss residuals, L-BFGS from the best grid starts "
                      "(Hoffmann et al. 2022, D.2)",
            "rms_log_residual": math.sqrt(sum(r * r for r in residuals) / len(residuals)),
            "points": [asdict(p) for p in points]}


# -- plots --------------------------------------------------------------------------------------------
def plot_fit(law: Law, points: list[Point], out_dir: str | os.PathLike) -> list[Path]:
    """scaling_isoloss.png: contours of L over (D, N) with iso-FLOP lines and the compute-optimal frontier;
    scaling_isoflop.png: L against N along iso-FLOP lines spanning the runs' budgets, runs marked."""
    import numpy as np

    from lmforge.metrics.curves import pyplot, save_figure

    plt = pyplot()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LmforgeError(f"--plot {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    ns, ds = np.array([p.n for p in points], float), np.array([p.d for p in points], float)
    cs = 6 * ns * ds
    n_grid = np.logspace(np.log10(ns.min()) - 0.7, np.log10(ns.max()) + 0.7, 200)
    d_grid = np.logspace(np.log10(ds.min()) - 0.7, np.log10(ds.max()) + 0.7, 200)
    dd, nn = np.meshgrid(d_grid, n_grid)
    ll = law.E + law.A / nn**law.alpha + law.B / dd**law.beta
    fig, ax = plt.subplots(figsize=(8, 6))
    cont = ax.contour(dd, nn, ll, levels=12, cmap="viridis")
    ax.clabel(cont, fontsize=7, fmt="%.2f")
    budgets = np.logspace(np.log10(cs.min()), np.log10(cs.max()), 4)
    for c in budgets:
        ax.plot(d_grid, c / (6 * d_grid), ls=":", color="grey", lw=0.8)
    falls = law.alpha > 0 and law.beta > 0  # else there is no optimum to draw
    if falls:
        c_line = np.logspace(np.log10(6 * n_grid[0] * d_grid[0]), np.log10(6 * n_grid[-1] * d_grid[-1]), 100)
        opt = np.array([law.optimum(c) for c in c_line])
        ax.plot(opt[:, 1], opt[:, 0], color="tab:red", lw=1.5, label="compute-optimal frontier")
        ax.legend(loc="lower right")
    sc = ax.scatter(ds, ns, c=[p.loss for p in points], cmap="viridis", edgecolors="k", zorder=3)
    fig.colorbar(sc, ax=ax, label="validation loss")
    ax.set(xscale="log", yscale="log", xlim=(d_grid[0], d_grid[-1]), ylim=(n_grid[0], n_grid[-1]),
           xlabel="tokens D", ylabel=f"parameters N ({law.count})",
           title=f"iso-loss contours, E={law.E:.3f} alpha={law.alpha:.3f} beta={law.beta:.3f}")
    paths = [save_figure(fig, out / PLOTS[0])]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("plasma")(np.linspace(0, 0.85, len(budgets)))
    for c, color in zip(budgets, colors):
        ax.plot(n_grid, law.E + law.A / n_grid**law.alpha + law.B / (c / (6 * n_grid))**law.beta, color=color,
                label=f"C = {c:.2e}")
        if falls:
            n_opt, _ = law.optimum(c)
            ax.plot([n_opt], [law.loss(n_opt, c / 6 / n_opt)], "*", color=color, ms=10)
    ax.scatter(ns, [p.loss for p in points], c="k", s=12, zorder=3, label="runs")
    ax.set(xscale="log", xlabel=f"parameters N ({law.count})", ylabel="loss",
           title="iso-FLOP curves (star: optimum)", ylim=(law.E, max(p.loss for p in points) * 1.15))
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out / PLOTS[1]))
    return paths


# -- planning -----------------------------------------------------------------------------------------
# DeepSeek LLM (Bi et al. 2024, arXiv 2401.02954, eq. 1): batch size (tokens) and peak lr fitted against
# compute: B_opt = 0.2920 C^0.3271, eta_opt = 0.3118 C^-0.1250. Their C counts non-embedding FLOPs per
# token (6 N_matmul + attention) times D; 6ND is used here, close enough for an exponent of 0.3.
BATCH_RULE, LR_RULE = (0.2920, 0.3271), (0.3118, -0.1250)
LR_RANGE = (1e-5, 3e-3)  # above ~3e-3 AdamW runs of this block (no QK-norm, no z-loss) tend to diverge
MAX_BATCH_TOKENS = 8 * 2**20
SIZE_TOLERANCE = 0.03  # the shape chooser keeps shapes within 3% of the target N, then picks by aspect ratio


@dataclass
class Plan:
    law: Law
    compute: float
    n_target: float
    d_target: float
    loss: float
    model: dict[str, Any] = field(default_factory=dict)  # the chosen model section
    n_actual: int = 0
    batch_tokens: int = 0
    micro: int = 0  # train.micro_batch_size
    accum: int = 0  # train.grad_accum_steps
    lr: float = 0.0
    steps: int = 0
    tokens: int = 0  # steps * tokens per step


def aspect_target(n: float) -> float:
    """d_model / n_layers to aim for. Kaplan et al. 2020 (fig. 5) found loss within ~1% over aspect ratios
    of ~20-200; published families sit at 64 (GPT-3 small/medium, the demo model) to 128 (Llama 2 7B/13B,
    GPT-3 175B): 64 below 1B parameters, 128 from there."""
    return 64.0 if n < 1e9 else 128.0


def choose_shape(n_target: float, base, count: str = "total") -> tuple[dict[str, Any], int]:
    """A model section near `n_target` parameters built on `base` (a ModelConfig: vocabulary, MLP, GQA
    ratio, context kept): d_model a multiple of 64 (128 from 1024), head_dim 64 (128 above d_model 2048),
    n_layers chosen per width to hit N; among the shapes within SIZE_TOLERANCE of N the one nearest the
    aspect-ratio target wins, a head count that keeps the base's grouped-query ratio counting as a factor
    of 2 nearer (the nearest N when none is that close). Returns (section, its N)."""

    group = base.n_heads // (base.n_kv_heads or base.n_heads)
    keep = {k: v for k, v in base.model_dump().items() if k not in ("preset", "d_ff", "head_dim")}

    def section(d_model: int, layers: int) -> dict[str, Any]:
        head_dim = 128 if d_model > 2048 else 64
        heads = max(1, d_model // head_dim)
        kv = heads // group if heads % group == 0 and heads >= group else heads
        return {**keep, "d_model": d_model, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv}

    def params(sec: dict[str, Any]) -> int:
        return param_count(type(base).model_validate(sec), count)

    widths = [*range(64, 1024, 64), *range(1024, 32769, 128)]
    candidates = []
    for w in widths:
        one, two = params(section(w, 1)), params(section(w, 2))
        per_layer, fixed = two - one, 2 * one - two
        ideal = (n_target - fixed) / per_layer
        for layers in {max(1, math.floor(ideal)), max(1, math.ceil(ideal))}:
            n = fixed + per_layer * layers
            # keeping the base's GQA ratio is worth a factor of 2 in aspect ratio
            keeps_gqa = section(w, layers)["n_kv_heads"] * group == section(w, layers)["n_heads"]
            aspect_cost = abs(math.log(w / layers / aspect_target(n_target)))
            shape_cost = aspect_cost + (0.0 if keeps_gqa else math.log(2))
            candidates.append((abs(n / n_target - 1), shape_cost, w, layers, n))
        if fixed > 2 * n_target:
            break  # wider only grows the embeddings further past the target
    close = [c for c in candidates if c[0] <= SIZE_TOLERANCE]
    _, _, w, layers, n = min(close, key=lambda c: c[1]) if close else min(candidates)
    sec = section(w, layers)
    assert params(sec) == n
    return sec, n


def make_plan(law: Law, *, compute: float | None = None, params: float | None = None,
              tokens: float | None = None, base=None) -> Plan:
    """The compute-optimal N and D for one of compute / params / tokens, a model shape realising N on top
    of `base` (a Config), and batch, lr and steps for D."""
    from lmforge.config.schema import Config

    given = {k: x for k, x in (("compute", compute), ("params", params), ("tokens", tokens)) if x is not None}
    if len(given) != 1:
        raise LmforgeError("give exactly one positive --compute FLOPS, --params N or --tokens D")
    (key, value), = given.items()
    POSITIVE.check(value, f"--{key}")
    n = d = math.nan
    try:
        if compute is None:
            compute = math.inf  # what an overflow on the next line leaves
            compute = law.compute_for_params(params) if params is not None else law.compute_for_tokens(tokens)
        n, d = law.optimum(compute)
    except (OverflowError, ZeroDivisionError):
        pass
    # a finite --params / --tokens can still leave float range (or reach 0) through a law's exponents
    if not all(math.isfinite(x) and x > 0 for x in (compute, n, d)):
        raise LmforgeError(f"--{key} {value:g} gives no finite plan under law {law.name} (compute "
                           f"{compute:.3g} FLOPs, N {n:.3g}, D {d:.3g}); give a --{key} nearer its range")
    plan = Plan(law, compute, n, d, law.loss(n, d))
    cfg = base if base is not None else Config()
    model = cfg.model
    if model.vocab_size is None:  # the tokenizer's vocabulary, rounded up to 64 as the model does
        model = model.model_copy(update={"vocab_size": -(-cfg.data.tokenizer.vocab_size // 64) * 64})
    plan.model, plan.n_actual = choose_shape(n, model, law.count)
    seq = cfg.seq_len
    batch = min(max(BATCH_RULE[0] * compute ** BATCH_RULE[1], seq), MAX_BATCH_TOKENS)
    seqs = max(1, round(batch / seq))
    # the base's micro batch (or fewer), and the step's sequences rounded to a multiple of it
    plan.micro = min(cfg.train.micro_batch_size, seqs)
    plan.accum = max(1, round(seqs / plan.micro))
    plan.batch_tokens = plan.micro * plan.accum * seq
    plan.lr = min(max(LR_RULE[0] * compute ** LR_RULE[1], LR_RANGE[0]), LR_RANGE[1])
    plan.steps = max(1, math.ceil(d / plan.batch_tokens))
    plan.tokens = plan.steps * plan.batch_tokens
    return plan


def plan_config(plan: Plan, base_data: dict[str, Any]) -> dict[str, Any]:
    """A config mapping (the base's, resolved) with the plan's model, batch, lr and steps put in;
    validated."""
    from lmforge.config.load import validate_config
    from lmforge.config.schema import ModelConfig

    data = json.loads(json.dumps(base_data))  # a deep copy of plain data
    defaults = ModelConfig().model_dump()
    shape = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len")
    data["model"] = {k: v for k, v in plan.model.items() if k in shape or v != defaults.get(k)}
    data.setdefault("train", {}).update(max_steps=plan.steps, micro_batch_size=plan.micro,
                                        grad_accum_steps=plan.accum)
    data.setdefault("optim", {})["lr"] = plan.lr
    # a run dir of its own: training the plan must not land in (and be refused by) the base's run
    run = data.setdefault("run", {})
    run["name"] = f"{run.get('name', 'run')}-plan"
    run["dir"] = f"{str(run.get('dir', 'runs/run')).rstrip('/')}-plan"
    sched = data.get("schedule") or {}
    if isinstance(sched.get("warmup_steps"), int) and sched["warmup_steps"] > plan.steps // 5:
        sched["warmup_steps"] = max(1, plan.steps // 5)  # no warm-up longer than a fifth of the run
    validate_config(data, source="the planned config")
    return data


# -- the verbs ------------------------------------------------------------------------------------------
def run_plan(law_spec: str, *, compute: float | None = None, params: float | None = None,
             tokens: float | None = None, config: str | None = None, overrides: Sequence[str] = (),
             out: str | None = None, overwrite: bool = False, say=print) -> Plan:
    """`lmforge scaling plan`: print N, D, the predicted loss and the config; write it with `out` (an
    existing file only with `overwrite`)."""
    import yaml

    from lmforge.config.load import config_to_dict, load_config
    from lmforge.utils.io import atomic_write_text, check_new_file

    if out:
        check_new_file(out, overwrite)
    law = load_law(law_spec)
    base = load_config(config, list(overrides))
    plan = make_plan(law, compute=compute, params=params, tokens=tokens, base=base)
    data = plan_config(plan, config_to_dict(base))  # the resolved base, as a run dir's config.yaml
    m = plan.model
    what = "parameters with embeddings" if law.count == "total" else "non-embedding parameters"
    say(f"law {law.name}: L = {law.E:.4g} + {law.A:.4g}/N^{law.alpha:.4g} + {law.B:.4g}/D^{law.beta:.4g} "
        f"(N: {what})")
    say(f"compute      {plan.compute:.3e} FLOPs (C = 6ND)")
    ratio = plan.d_target / plan.n_target
    say(f"optimal N    {plan.n_target:.4g}   D {plan.d_target:.4g} tokens ({ratio:.1f} tokens per parameter)")
    say(f"predicted    loss {plan.loss:.4f} nats/token")
    off = plan.n_actual / plan.n_target - 1
    say(f"shape        d_model {m['d_model']}, n_layers {m['n_layers']}, n_heads {m['n_heads']} (kv "
        f"{m['n_kv_heads']}), vocab {m['vocab_size']}: N = {plan.n_actual:,} ({off:+.1%})")
    if abs(off) > SIZE_TOLERANCE:
        say(f"warning: no shape within {SIZE_TOLERANCE:.0%} of N; with this vocabulary the embeddings alone "
            "set a floor (or the widths searched a ceiling)")
    train = data["train"]
    say(f"batch        {plan.batch_tokens:,} tokens/step ({train['micro_batch_size']} x "
        f"{train['grad_accum_steps']} sequences), lr {plan.lr:.3g}, {plan.steps:,} steps = "
        f"{plan.tokens:,} tokens")
    if out:
        atomic_write_text(out, yaml.safe_dump(data, sort_keys=False))
        say(f"wrote {out}")
    return plan


def run_fit(runs: Sequence[str], *, out: str | None = None, plot: str | None = None,
            predict: Sequence[str] = (), predict_config: Sequence[str] = (), check: Sequence[str] = (),
            all_evals: bool = False, count: str = "total", samples: int = 0, seed: int = 0,
            overwrite: bool = False, say=print) -> dict[str, Any]:
    """`lmforge scaling fit`: fit the law to the runs' (N, D, loss) and report, predict and check. An
    existing `out` file or plot in `plot` is replaced only with `overwrite`."""
    from lmforge.config.load import load_config
    from lmforge.utils.io import atomic_write_json, check_new_file

    if count not in COUNTS:
        raise LmforgeError(f"--count {count!r}: valid counts: {', '.join(COUNTS)}")
    MAX_BOOTSTRAP.check(samples, "--bootstrap")
    if out:
        check_new_file(out, overwrite)
    if plot:
        for name in PLOTS:
            check_new_file(Path(plot) / name, overwrite)
    wanted = [parse_predict(s) for s in predict]  # bad input fails before the fit
    points, used, inputs = fit_points(runs, count, all_evals)
    for line in inputs.skip_lines():
        say(line)
    ns, ds, ls = [p.n for p in points], [p.d for p in points], [p.loss for p in points]
    law = fit_law(ns, ds, ls, count=count)
    ci = bootstrap(law, ns, ds, ls, samples, seed) if samples else None
    record = fit_record(law, points, ci)
    record["skipped"] = [{"path": path, "why": why} for path, why in inputs.skipped]
    say(f"{len(points)} points from {used} runs (N: {count} parameters; "
        f"{'every evaluation' if all_evals else 'final evaluations'})")
    for k in ("E", "A", "B", "alpha", "beta"):
        interval = f"   95% CI [{ci[k][0]:.4g}, {ci[k][1]:.4g}] ({samples} bootstraps)" if ci else ""
        say(f"  {k:5s} = {getattr(law, k):.4g}{interval}")
    say(f"  rms log-loss residual {record['rms_log_residual']:.4f}; N_opt ~ C^{law.a:.3f}")
    if law.alpha <= 0 or law.beta <= 0:
        say("warning: an exponent is not positive: these losses do not fall as N (or D) grows, so the law "
            "has no compute-optimal frontier and predictions beyond the points mean little")
    record["predictions"] = []
    for n, d in wanted:
        record["predictions"].append({"N": n, "D": d, "loss": law.loss(n, d)})
        say(f"predict N={n:.4g} D={d:.4g}: loss {law.loss(n, d):.4f}")
    for path in predict_config:
        n, d = config_point(load_config(path), count)
        record["predictions"].append({"config": path, "N": n, "D": d, "loss": law.loss(n, d)})
        say(f"predict {path} (N={n:,} D={d:,}): loss {law.loss(n, d):.4f}")
    record["checks"] = []
    for path in check:
        p = run_points(path, count)[-1]
        pred = law.loss(p.n, p.d)
        err = pred / p.loss - 1
        record["checks"].append({"run": path, "N": p.n, "D": p.d, "loss": p.loss, "predicted": pred,
                                 "relative_error": err})
        say(f"check {path} (N={p.n:,} D={p.d:,}): predicted {pred:.4f}, measured {p.loss:.4f} "
            f"({err:+.2%})")
    if out:
        atomic_write_json(out, record)
        say(f"wrote {out}")
    if plot:
        for png in plot_fit(law, points, plot):
            say(f"wrote {png}")
    return record
