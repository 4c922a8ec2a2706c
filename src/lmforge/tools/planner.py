"""The budget planner's choice: `plan(budget_s, throughput, corpus, user) -> Plan`, a pure function of the
machine's measured throughput (tools/planner_probe.py measures it), the corpus and the keys the user set.

What it chooses, and from what (every constant below cites bench/results/planner_rules.json, written by
bench/planner_rules.py from the measured runs of bench/results/planner_quality.json's python grid and
bench/results/speedrun_search.json):

- the phases of the whole process inside the budget: what was already spent (start-up and the probe),
  preparing the corpus and tokenizer (data.max_chars and the tokenizer's sample bounded by a share of the
  budget at the measured prepare rate), training (what is left), the final evaluation (its batches sized
  to a few % of the budget, the time kept for it what they take at the probe's measured forward speed) and
  a small exit margin;
- the model shape: every candidate of a ladder of shapes sees the tokens its measured (or interpolated)
  speed gives in the training time; the one a loss rule L(N, D) fitted to small-budget runs on a 2-core
  CPU predicts lowest wins (there, smaller models that see more tokens won);
- vocabulary, context, micro-batch and accumulation, lr (a width rule), a WSD schedule over time with a
  cooldown over the end, precision (measured by the probe) and the evaluation's batches.

Any key the user set is kept and the rest is planned around it; the plan says for each choice why."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from lmforge.errors import ConfigError

# -- rules, with the measurements that chose them (bench/results/planner_rules.json) -------------------
# L(N, D) in nats/token at vocabulary 4096, N the non-embedding parameters (so the ranking of shapes does
# not move with the vocabulary), D the effective tokens (below), fitted to the best row of each shape of
# bench/planner_quality.py's python grid at 2 and 5 minutes (12 runs: N 0.1M-4.4M, D 0.3M-7.5M tokens, rms
# log residual 0.014): it ranks both budgets' shapes as measured (d64-L2 first at 2 minutes,
# d96-L3 at 5), and on the held-out kjv grids too. Fitted to the speedrun's 13 runs (d128-L4 and up) before,
# it put d64-L2 first at 5 minutes, where d96-L3 was 3.5% better. Larger N and D are extrapolations.
# Published laws (Hoffmann, Epoch) predict 10-25 nats for such runs.
LAW = dict(E=2.11689, A=460.228, B=453.464, alpha=0.584195, beta=0.380996)
# half the smallest N measured on builtin:python (planner_quality's python grid at 2 min: d64-L2 won, bpb
# growing with N as the law ranks them): below it the rule is an extrapolation
LAW_MIN_PARAMS = 0.5 * 98_624
# repeated data: epochs beyond the first are worth less (Muennighoff et al. 2023, "Scaling Data-Constrained
# Language Models", eq. 5: D' = U + U R* (1 - exp(-R / R*)), R the repeats, their fitted R*_D = 15.4)
REPEAT_HALF_LIFE = 15.4
# ... and past a point they do harm: a model that sees a small corpus too often memorizes it (training loss
# to ~0, held-out loss rising past a uniform guess's). Muennighoff et al.'s law never rises, so the planner
# bounds the epochs a run trains: at most EPOCH_CAP, and at most DATA_BOUND / (N / U) (N non-embedding
# parameters, U unique tokens: the more parameters per unique token, the sooner a model memorizes). A run
# the bound stops short ends before its budget. Measured (docs/stages/planning.md): on python's text cut to
# 97k unique tokens, d64-L2 and d96-L3 at 31 and 17.5 epochs reached 4.2 and 3.6 bpb where runs of 7-11.5
# epochs reached 3.18-3.26 (N/U x epochs up to 120); at 36k unique tokens every run of 13-94 epochs was past
# a uniform guess; on one H200, d640-L10 (N/U 24) memorized 1.9M tokens: training loss under the held-out
# level from ~4.5 epochs (N/U x epochs ~108), held-out 2.66 bpb after 58. In the python and kjv grids
# (1-2.5M unique tokens) only kjv's d64-L2 and d96-L3 at 15 minutes pass 10 epochs (22 and 12.5, fine).
EPOCH_CAP, DATA_BOUND = 10.0, 100.0
# lr = LR_AT_128 * 128 / d_model within LR_RANGE: LR_AT_128 the geometric mean of the better lr at d128 in
# the python grid at 2 and 5 min (2e-3 by 12%, 4e-3 by 1.5%); the top of the range the largest lr that won at
# any width (4e-3, at d64 and d96 at both budgets; no larger one was measured)
LR_AT_128 = 0.00282843
LR_RANGE = (3e-4, 4e-3)
BATCH_RULE = (0.1968, 0.3271)  # tokens/step = k C^e: DeepSeek's exponent, k from the winner's 4096 tokens
PREPARE_CHARS_PER_S = 1_207_555.0  # a whole `lmforge prepare` of builtin:python (low quartile of 6 runs)
CHARS_PER_TOKEN = {1024: 2.839, 2048: 3.423, 4096: 3.916}  # builtin:python, per BPE vocabulary
# Schedule: the speedrun's WSD (warm-up over 5% of training, cooldown over the last 30%), the warm-up at least
# WARMUP_STEPS updates (nanoGPT's CPU recipe warms up over 100): at 2 minutes d64-L2 trains ~700 steps, and
# on builtin:python's held-out text 5% (33-40 steps) left it at 1.91-1.98 bpb in 6 runs of one prepared
# corpus where 100 steps reached 1.683 (docs/stages/planning.md); at most WARMUP_MAX_SHARE of training.
WARMUP_SHARE, WARMUP_STEPS, WARMUP_MAX_SHARE, COOLDOWN_FRACTION = 0.05, 100, 0.25, 0.3

# -- the shares of the budget (decisions; docs/planning.md says why) -----------------------------------
PREPARE_SHARE = 0.12  # the most of the budget preparing the corpus and tokenizer may take
# the final evaluation: the batches EVAL_SHARE of the budget evaluates at the forward speed the probe
# measured, at most the windows of data.val_sources; the time kept for them x EVAL_SAFETY (+ EVAL_FIXED_S, the
# final checkpoint). Kept as 3% of the budget whatever the held-out text's size, it ended the 2- and
# 5-minute runs of bench/planner_quality.py 6-16 s before their budget (python's held-out text is 28 batches)
EVAL_SHARE = 0.03
EVAL_SPEEDUP = 2.0  # where no forward was timed: 2 AVX2 cores measured 2.0-2.8x a step's speed (d64-d128)
EVAL_SAFETY, EVAL_FIXED_S = 1.25, 0.5
# exit: the report, curves.png, the interpreter's exit (~1-2 s on a busy 2-core machine); the whole process
# may end up to 5% past its budget, so the margin need not hold all of it
MARGIN_SHARE, MARGIN_S = 0.01, 2.0
PLOT_MIN_BUDGET_S = 120.0  # drawing curves.png imports matplotlib: 1-5 s, too much of a shorter budget
SETUP_S = 1.0  # assembling the run: model, optimizer, loaders (measured 0.12-0.45 s at 2 and 5 minutes)
PREPARE_FIXED_S = 0.5
MIN_TRAIN_S = 5.0  # below this a run is mostly its first, slow steps
MIN_STEPS = 20  # ... and fewer steps than this train nothing
MAX_BUDGET_S = 24 * 3600.0  # longer runs need checkpoints and resumes: -c with train.max_time
VAL_FRACTION_RANGE = (0.02, 0.2)
HELD_SHARE = 0.1  # of the characters read, about this much is held out for validation (not trained on)


@dataclass(frozen=True)
class Shape:
    """One candidate model shape."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int

    @property
    def name(self) -> str:
        return f"d{self.d_model}-L{self.n_layers}"


def _ladder_shape(d: int, layers: int) -> Shape:
    heads = d // 32 if d <= 256 else d // 64  # head_dim 32 at small widths (the speedrun's), 64 above
    return Shape(d, layers, heads, heads // 2 if heads % 2 == 0 else heads)


# widths and depths at aspect ratios 32-85 (the speedrun's winner d128-L4; choose_shape's 64 above 1B)
LADDER = tuple(_ladder_shape(d, n) for d, n in (
    (64, 2), (96, 3), (128, 4), (192, 4), (256, 4), (256, 6), (320, 5), (384, 6), (512, 8), (640, 10),
    (768, 12), (1024, 16), (1280, 20), (1536, 24), (2048, 24)))


@dataclass(frozen=True)
class Measured:
    """One probe measurement: a shape trained at (micro, seq, vocab) ran at tokens_per_s."""

    shape: Shape
    micro: int
    seq_len: int
    vocab: int
    flops_per_token: float
    tokens_per_s: float
    eval_batch_s: float | None = None  # seconds of one evaluation forward of a (micro, seq) batch


@dataclass(frozen=True)
class Throughput:
    """The machine as the probe measured it: tokens/s of a few shapes (interpolated in between), the
    precision it resolved, and the seconds spent before planning (start-up and the probe)."""

    device: str  # "cpu" or "cuda"
    points: tuple[Measured, ...]
    precision: str = "fp32"
    precision_why: str = "fp32 (not measured)"
    spent_s: float = 0.0

    def tokens_per_s(self, flops_per_token: float) -> float | None:
        """Interpolated tokens/s at `flops_per_token` (log-log, between measured shapes); the smallest
        shape's speed below it (a smaller model is never slower); None above the largest measured."""
        pts = sorted((p.flops_per_token, p.tokens_per_s) for p in self.points)
        if not pts or flops_per_token > pts[-1][0] * 1.0001:
            return None
        # never faster for more FLOPs per token: a noisy table must not reward a bigger model
        mono, low = [], math.inf
        for f, t in pts:
            low = min(low, t)
            mono.append((f, low))
        if flops_per_token <= mono[0][0]:
            return mono[0][1]
        for (f0, t0), (f1, t1) in zip(mono, mono[1:]):
            if flops_per_token >= f1:
                if flops_per_token == f1:
                    return t1  # a measured shape: its own speed
                continue
            w = math.log(flops_per_token / f0) / math.log(f1 / f0)
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
        return mono[-1][1]

    def eval_ratio(self, flops_per_token: float) -> float:
        """An evaluation batch's seconds over a training step's at the measured shape nearest in FLOPs per
        token (1 / EVAL_SPEEDUP where the probe timed no forward)."""
        timed = [p for p in self.points if p.eval_batch_s]
        if not timed:
            return 1 / EVAL_SPEEDUP
        p = min(timed, key=lambda p: abs(math.log(p.flops_per_token / flops_per_token)))
        return p.eval_batch_s * p.tokens_per_s / (p.micro * p.seq_len)


@dataclass(frozen=True)
class Corpus:
    """What the planner knows of the corpus: its characters (None: not counted; read up to what the budget
    needs), the characters of data.val_sources (read whole: they take preparing time) and characters per
    token at each vocabulary (the measured rule unless known)."""

    chars: int | None = None
    val_chars: int = 0
    chars_per_token: dict[int, float] = field(default_factory=lambda: dict(CHARS_PER_TOKEN))

    def per_token(self, vocab: int) -> float:
        known = sorted(self.chars_per_token)
        near = min(known, key=lambda v: abs(math.log(v / vocab)))
        return self.chars_per_token[near]


@dataclass
class Choice:
    key: str
    value: Any
    why: str


@dataclass
class Plan:
    budget_s: float
    phases: dict[str, float]
    choices: list[Choice]
    candidates: list[dict[str, Any]]
    predicted: dict[str, float]

    @property
    def settings(self) -> dict[str, Any]:
        """dotted config key -> value (what `--set` would say)."""
        return {c.key: c.value for c in self.choices if "." in c.key}

    def to_json(self) -> dict[str, Any]:
        return {"budget_s": self.budget_s, "phases": self.phases,
                "choices": [asdict(c) for c in self.choices], "candidates": self.candidates,
                "predicted": self.predicted}

    def table(self) -> str:
        """One line per choice: key, value, why (what the CLI prints before training)."""
        rows = [(c.key, _show(c.value), c.why) for c in self.choices]
        w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in self.phases.items())
        lines = [f"plan for a budget of {self.budget_s:g}s: {phases}",
                 f"{'choice':<{w0}}  {'value':<{w1}}  why"]
        lines += [f"{k:<{w0}}  {v:<{w1}}  {why}" for k, v, why in rows]
        return "\n".join(lines)

    def markdown(self) -> str:
        out = [f"# Plan for a budget of {self.budget_s:g} s", "", "| phase | seconds |", "|---|---|"]
        out += [f"| {k} | {v:.1f} |" for k, v in self.phases.items()]
        out += ["", "| choice | value | why |", "|---|---|---|"]
        out += [f"| {c.key} | {_show(c.value)} | {c.why} |" for c in self.choices]
        out += ["", "| shape | parameters | tokens/s | tokens | epochs | seconds | predicted loss |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {c['shape']} | {c['params']:,} | {c['tokens_per_s'] or '-'} | {c['tokens'] or '-'} | "
                f"{c.get('epochs') or '-'} | {c.get('train_s') or '-'} | "
                f"{c['loss'] if c['loss'] is not None else c['why']} |" for c in self.candidates]
        return "\n".join(out) + "\n"


def _show(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


# -- what the probe and the plan agree on -----------------------------------------------------------------
def batch_shape(device: str, user: dict[str, Any]) -> tuple[int, int]:
    """(micro-batch, context) a candidate trains at: the user's, else 16 x 256 on a CPU (the speedrun's
    winner; 8 x 256 and 32 x 128 lost) and 16 x 1024 on a GPU (fills its matmuls)."""
    seq = user.get("model.max_seq_len") or (256 if device == "cpu" else 1024)
    return user.get("train.micro_batch_size") or 16, seq


def vocab_for(budget_s: float, user: dict[str, Any], corpus_chars: int | None = None) -> tuple[int, str]:
    """The tokenizer's vocabulary: the user's, else 4096 (the speedrun's; 2048-8192 came within 0.05 bpb of
    each other at 60 s), halved where the tokenizer's sample (what the budget reads, at most the corpus's
    `corpus_chars`) is too small to fill it."""
    if "data.tokenizer.vocab_size" in user:
        return int(user["data.tokenizer.vocab_size"]), "user"
    sample = PREPARE_SHARE * budget_s * PREPARE_CHARS_PER_S  # the BPE trains on all the text read
    sample = min(sample, corpus_chars or sample)
    vocab = 4096
    while vocab > 1024 and sample / vocab < 250:  # a merge needs material: >= 250 chars per entry
        vocab //= 2
    why = "rule: 4096 (speedrun: 2048-8192 within 0.05 bpb)"
    return vocab, why if vocab == 4096 else f"rule: >= 250 sample chars per entry ({sample:,.0f} chars)"


def candidate_shapes(user: dict[str, Any]) -> list[Shape]:
    """The ladder with the user's shape keys put in (the rest of each shape kept where it stays valid)."""
    out: list[Shape] = []
    for s in LADDER:
        d = user.get("model.d_model", s.d_model)
        heads = user.get("model.n_heads") or max(1, d // (s.d_model // s.n_heads))  # the ladder's head_dim
        kv = user.get("model.n_kv_heads") or (heads // 2 if heads % 2 == 0 else heads)
        shape = Shape(d, user.get("model.n_layers", s.n_layers), heads, kv)
        if d % heads == 0 and heads % kv == 0 and shape not in out:
            out.append(shape)
    return out


def model_config(shape: Shape, vocab: int, seq: int):
    from lmforge.config.schema import ModelConfig

    return ModelConfig(d_model=shape.d_model, n_layers=shape.n_layers, n_heads=shape.n_heads,
                       n_kv_heads=shape.n_kv_heads, vocab_size=-(-vocab // 64) * 64, max_seq_len=seq)


def effective_tokens(d: float, unique: float | None, half_life: float = REPEAT_HALF_LIFE) -> float:
    """Tokens worth of `d` tokens trained on `unique` distinct ones (the corpus read, repeated in epochs):
    `d` itself for one epoch or less, then Muennighoff et al.'s decaying value of each repeat."""
    if not unique or d <= unique:
        return d
    repeats = d / unique - 1
    return unique * (1 + half_life * (1 - math.exp(-repeats / half_life)))


def bounded_tokens(n: float, d: float, unique: float | None) -> float:
    """The tokens a run of `n` non-embedding parameters trains on when it could see `d` of `unique` distinct
    ones: `d`, at most EPOCH_CAP and DATA_BOUND x unique / n epochs (more would memorize the corpus)."""
    return d if not unique else min(d, unique * min(EPOCH_CAP, DATA_BOUND * unique / n))


def law_loss(n: float, d: float, unique: float | None = None) -> float:
    return LAW["E"] + LAW["A"] / n ** LAW["alpha"] + LAW["B"] / effective_tokens(d, unique) ** LAW["beta"]


# -- the plan ---------------------------------------------------------------------------------------------
def _rank(throughput: Throughput, user: dict[str, Any], vocab: int, micro: int, seq: int, train_s: float,
          unique: float) -> tuple[list[dict[str, Any]], tuple | None]:
    """Every candidate shape with its speed, tokens, epochs over the `unique` tokens that can be read (the
    corpus, within preparing's share of the budget, or the user's data.max_chars: a shape that trains on
    more repeats them, each epoch worth less) and predicted loss; the best (lowest loss, the first of the
    ladder on a tie) as (shape, row, N, tokens/s, tokens)."""
    from lmforge.models.flops import flops_per_token
    from lmforge.tools.scaling_inputs import param_count

    rows, best, fallback = [], None, None
    for shape in candidate_shapes(user):
        mc = model_config(shape, vocab, seq)
        n, fpt = param_count(mc, "non-embedding"), flops_per_token(mc, seq)
        tps = throughput.tokens_per_s(fpt)
        row = {"shape": shape.name, "params": n, "tokens_per_s": None, "tokens": None, "loss": None,
               "why": ""}
        rows.append(row)
        if tps is None:
            row["why"] = "larger than the largest shape measured"
            continue
        d = bounded_tokens(n, tps * train_s, unique)
        row.update(tokens_per_s=round(tps), tokens=int(d), epochs=round(d / unique, 2),
                   train_s=round(d / tps, 1))
        if d / (micro * seq) < MIN_STEPS:
            row["why"] = f"fewer than {MIN_STEPS} steps"
            continue
        row["loss"] = round(law_loss(n, d, unique), 4)
        if n < LAW_MIN_PARAMS and not any(k.startswith("model.") for k in user):
            # below the range the rule was fitted on: only when no shape in it gets its steps
            row["why"] = "below the rule's measured range"
            if fallback is None or row["loss"] < fallback[1]["loss"]:
                fallback = (shape, row, n, tps, d)
            continue
        if best is None or row["loss"] < best[1]["loss"]:
            best = (shape, row, n, tps, d)
    return rows, best or fallback


def check_budget(budget_s: float, user: dict[str, Any]) -> None:
    """ConfigError for a budget out of range or a key --budget cannot keep (before anything is measured)."""
    if "train.max_time" in user:
        raise ConfigError("--budget plans train.max_time from what is left after preparing and before the "
                          "final evaluation; remove train.max_time from the config (or drop --budget)")
    if not (math.isfinite(budget_s) and 0 < budget_s <= MAX_BUDGET_S):
        raise ConfigError(f"--budget {budget_s:g}s: give a budget above 0 and at most "
                          f"{MAX_BUDGET_S / 3600:g}h "
                          "(longer runs need checkpoints and resumes: plan a shorter budget and train it on "
                          "with -c and train.max_time)")


def plan(budget_s: float, throughput: Throughput, corpus: Corpus, user: dict[str, Any]) -> Plan:
    """The run to train in `budget_s` seconds of wall time on the machine `throughput` measured, on
    `corpus`; `user` (dotted key -> value) holds the keys the user set, which are kept. Pure: the same
    inputs give the same plan. ConfigError for a budget outside what can work, naming what would."""
    try:
        return _plan(budget_s, throughput, corpus, user)
    except _TooSmall as e:
        # more budget only adds training time, so the budgets that work are an interval: bisect for its start
        lo, hi = max(1, math.floor(budget_s)), math.ceil(MAX_BUDGET_S)
        if _works(hi, throughput, corpus, user) is None:
            raise ConfigError(f"no budget up to {MAX_BUDGET_S / 3600:g}h trains a model with the keys you "
                              f"set on this machine ({e.args[0]})") from None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _works(mid, throughput, corpus, user) else (mid, hi)
        raise ConfigError(f"--budget {budget_s:g}s is too small for any model on this machine: {e.args[0]}; "
                          f"the smallest budget that would work is {hi}s") from None


class _TooSmall(Exception):
    pass


# the probe stops before shapes that cannot win: on a CPU a larger shape runs at most PROBE_FLOPS_SLACK x the
# FLOP/s of the best shape measured (on 2 AVX2 cores d64-L2 to d256-L4 ran at 70-105 GFLOP/s, rising with the
# shape by at most 1.13x a step); a GPU's FLOP/s grows many-fold with the shape, so it measures on
PROBE_FLOPS_SLACK = 1.5


def could_win(budget_s: float, throughput: Throughput, corpus: Corpus, user: dict[str, Any],
              shapes: list[Shape]) -> bool:
    """Whether any of `shapes` (not measured yet) might beat the plan of the shapes `throughput` has: the
    loss rule's prediction for each at PROBE_FLOPS_SLACK x the best FLOP/s measured, trained for the plan's
    training and preparing time together, on the whole corpus, must beat the plan's. True on a GPU, and
    where there is no plan yet or its shape is below the rule's range."""
    from lmforge.models.flops import flops_per_token
    from lmforge.tools.scaling_inputs import param_count

    if throughput.device != "cpu" or not shapes:
        return bool(shapes)
    try:
        p = _plan(budget_s, throughput, corpus, user)
    except (_TooSmall, ConfigError):
        return True
    if p.predicted["params"] < LAW_MIN_PARAMS:
        return True
    vocab, seq = p.settings["data.tokenizer.vocab_size"], p.settings["model.max_seq_len"]
    flops_s = PROBE_FLOPS_SLACK * max(q.flops_per_token * q.tokens_per_s for q in throughput.points)
    train_s = p.phases["train"] + p.phases.get("not needed", 0.0) + p.phases["prepare"]
    unique = corpus.chars * (1 - HELD_SHARE) / corpus.per_token(vocab) if corpus.chars else None
    for shape in shapes:
        mc = model_config(shape, vocab, seq)
        n = param_count(mc, "non-embedding")
        d = bounded_tokens(n, flops_s / flops_per_token(mc, seq) * train_s, unique)
        if law_loss(n, d, unique) < p.predicted["loss"]:
            return True
    return False


def contenders(budget_s: float, throughput: Throughput, corpus: Corpus, user: dict[str, Any],
               near: float) -> list[str]:
    """The measured shapes whose predicted loss is within `near` (a fraction) of the plan's best: those a
    probe that read one of them slow could have ranked wrongly. Empty where no plan can be made yet."""
    try:
        p = _plan(budget_s, throughput, corpus, user)
    except (_TooSmall, ConfigError):
        return []
    measured = {q.shape.name for q in throughput.points}
    return [c["shape"] for c in p.candidates if c["shape"] in measured and c["loss"] is not None
            and c["loss"] <= p.predicted["loss"] * (1 + near)]


def _eval_batches(budget_s: float, batch_s: float, micro: int, seq: int, corpus: Corpus, cpt: float) -> int:
    """The final evaluation's batches: what EVAL_SHARE of the budget evaluates at `batch_s` seconds a batch,
    at most the windows of data.val_sources (evaluated whole; +25% for a text that tokenizes finer)."""
    n = max(1, int(EVAL_SHARE * budget_s / batch_s))
    if corpus.val_chars:
        n = min(n, max(1, math.ceil(1.25 * corpus.val_chars / cpt / seq / micro)))
    return n


def _works(budget_s: float, throughput: Throughput, corpus: Corpus, user: dict[str, Any]) -> Plan | None:
    try:
        return _plan(budget_s, throughput, corpus, user)
    except _TooSmall:
        return None


def _schedule(choose: Callable[[str, Any, str], None], user: dict[str, Any], update_s: float,
              train_s: float) -> None:
    """The schedule's choices: WSD over wall time, its warm-up WARMUP_STEPS updates of `update_s` seconds
    or WARMUP_SHARE of `train_s`, the longer (at most WARMUP_MAX_SHARE)."""
    choose("schedule.name", "wsd", "rule: warm-up, flat, cooldown over the end (speedrun)")
    choose("schedule.unit", "time", "the budget is wall time")
    if user.get("schedule.name", "wsd") == "wsd":
        warmup = min(max(WARMUP_STEPS * update_s, WARMUP_SHARE * train_s), WARMUP_MAX_SHARE * train_s)
        choose("schedule.warmup_seconds", round(warmup, 2), f"rule: {WARMUP_STEPS} steps ({update_s:.3g}s "
               f"each) or {WARMUP_SHARE:.0%} of training, the longer, at most {WARMUP_MAX_SHARE:.0%}")
        choose("schedule.cooldown_fraction", COOLDOWN_FRACTION, "rule: the last 30% (speedrun)")
        choose("schedule.min_lr_ratio", 0.0, "rule: decay to 0 (speedrun)")


def _evaluation_choices(choose: Callable[[str, Any, str], None], throughput: Throughput, corpus: Corpus,
                        user: dict[str, Any], eval_batches: int, tokens_read: float, budget_s: float) -> None:
    """The final evaluation's choices (one, at the end, of `eval_batches`; held-out text for it where the
    user gave no data.val_sources), the one checkpoint, and no curves.png for short budgets."""
    micro, seq = batch_shape(throughput.device, user)
    choose("train.eval_every", 0, "one evaluation, at the end")
    speed = "the measured forward" if any(q.eval_batch_s for q in throughput.points) else \
        f"{EVAL_SPEEDUP:g}x the training"
    choose("train.eval_batches", eval_batches, f"rule: {EVAL_SHARE:.0%} of the budget at {speed} speed" +
           (", at most the held-out text's windows" if corpus.val_chars else ""))
    if "data.val_sources" not in user:
        val_tokens = 1.5 * eval_batches * micro * (seq + 1)
        frac = min(max(val_tokens / max(1.0, tokens_read), VAL_FRACTION_RANGE[0]), VAL_FRACTION_RANGE[1])
        choose("data.val_fraction", round(frac, 4), "rule: enough held-out text for the evaluation")
    choose("checkpoint.every", 0, "one checkpoint, at the end")
    if budget_s < PLOT_MIN_BUDGET_S:
        choose("logging.plot", False, f"rule: curves.png costs 1-5 s; drawn from {PLOT_MIN_BUDGET_S:g}s "
               "budgets")


def _max_time_why(phases: dict[str, float], epochs: float, unique: float) -> str:
    if "not needed" in phases:  # the epoch bound ends training before the budget does
        return (f"rule: {epochs:.1f} epochs of {unique:,.0f} unique tokens, at most {EPOCH_CAP:g} and "
                f"{DATA_BOUND:g} / (N/U): more would memorize them")
    return "what is left of the budget (re-set after preparing)"


def _plan(budget_s: float, throughput: Throughput, corpus: Corpus, user: dict[str, Any]) -> Plan:
    from lmforge.models.flops import flops_per_token

    check_budget(budget_s, user)
    if not throughput.points:
        raise ConfigError("the throughput probe measured no shape (not even the smallest) in its time")
    micro, seq = batch_shape(throughput.device, user)
    vocab, vocab_why = vocab_for(budget_s, user, corpus.chars)
    cpt = corpus.per_token(vocab)
    fastest = max(p.tokens_per_s for p in throughput.points)
    step_s = micro * seq / fastest

    def evaluation(shape: Shape) -> tuple[int, float]:
        """The final evaluation of `shape`: its batches and the seconds kept for them."""
        fpt = flops_per_token(model_config(shape, vocab, seq), seq)
        batch_s = micro * seq / (throughput.tokens_per_s(fpt) or fastest) * throughput.eval_ratio(fpt)
        n = user.get("train.eval_batches") or _eval_batches(budget_s, batch_s, micro, seq, corpus, cpt)
        return n, n * batch_s * EVAL_SAFETY + EVAL_FIXED_S

    eval_s = evaluation(min(throughput.points, key=lambda p: p.flops_per_token).shape)[1]
    margin_s = MARGIN_SHARE * budget_s + MARGIN_S
    cap = min(PREPARE_SHARE * budget_s * PREPARE_CHARS_PER_S, corpus.chars or math.inf)

    def chars_for(tokens_per_s: float, seconds: float) -> int:
        """Characters to read: what `tokens_per_s` trains on in `seconds` (+10%, + held-out text), within
        the share of the budget preparing may take (and the corpus); the user's data.max_chars if set."""
        if "data.max_chars" in user:
            return int(user["data.max_chars"])
        return int(min(1.1 * tokens_per_s * seconds * cpt / (1 - HELD_SHARE), cap))

    def read(chars: int) -> int:
        """Characters preparing reads: data.max_chars of the train text (at least the held-out text's
        size, so that data.val_sources is read whole: each gets data.max_chars) and the held-out text."""
        return max(chars, corpus.val_chars) + corpus.val_chars

    def train_time(chars: int) -> float:
        prepare = PREPARE_FIXED_S + read(chars) / PREPARE_CHARS_PER_S
        return budget_s - throughput.spent_s - prepare - SETUP_S - eval_s - margin_s

    # first as if the fastest shape trained the whole budget, then for the speed of the shape chosen
    chars = chars_for(fastest, budget_s)
    train_s = train_time(chars)
    least_train = max(MIN_TRAIN_S, MIN_STEPS * step_s)
    if train_s < least_train:
        raise _TooSmall(f"start-up and the probe took {throughput.spent_s:.1f}s and a run needs at least "
                        f"{least_train:.1f}s of training ({MIN_STEPS} steps of the fastest shape)")
    unique = (user["data.max_chars"] if "data.max_chars" in user else cap) * (1 - HELD_SHARE) / cpt
    rows, best = _rank(throughput, user, vocab, micro, seq, train_s, unique)
    for _ in range(2):  # read only what the chosen shape trains on (the time saved goes to training) and
        if best is None:  # keep its evaluation's time; once more where that changed the choice
            break
        chars = min(chars, chars_for(best[3], train_s))
        eval_s = evaluation(best[0])[1]
        train_s = train_time(chars)
        rows, best = _rank(throughput, user, vocab, micro, seq, train_s, unique)
    if best is None:
        keys = ", ".join(sorted(k for k in user if k.startswith("model."))) or "none"
        raise _TooSmall(f"no candidate shape (with the model keys you set: {keys}) gets {MIN_STEPS} steps "
                        f"in {train_s:.1f}s of training at the measured speed")
    shape, row, n, tps, d = best
    prepare_s = PREPARE_FIXED_S + read(chars) / PREPARE_CHARS_PER_S
    time_s, train_s = train_s, min(train_s, d / tps)  # the data bound may end training early
    phases = {"start-up and probe": throughput.spent_s, "prepare": prepare_s,
              "setup": SETUP_S, "train": train_s, "evaluate": eval_s, "margin": margin_s}
    if train_s < time_s - 0.5:
        phases["not needed"] = time_s - train_s
    measured = f"measured: {tps:,.0f} tok/s"
    choices = [Choice("budget", f"{budget_s:g}s", "--budget")]

    def choose(key: str, value: Any, why: str) -> None:
        choices.append(Choice(key, user[key], "user") if key in user else Choice(key, value, why))

    choose("data.tokenizer.vocab_size", vocab, vocab_why)
    choose("data.max_chars", max(chars, corpus.val_chars), f"rule: what {tps:,.0f} tok/s trains on, <= "
           f"{PREPARE_SHARE:.0%} of the budget at {PREPARE_CHARS_PER_S:,.0f} chars/s")
    choose("data.max_chars_from", "spread", "rule: documents from the whole corpus, not its start")
    choose("data.tokenizer.train_chars", max(1000, max(chars, corpus.val_chars)),
           "rule: all the text read (python's held-out text: 0.7% fewer tokens than from half of it)")
    rule = f"rule: lowest L(N,D) at {measured}, {d / n:.1f} tokens/non-embedding param"
    for k in ("d_model", "n_layers", "n_heads", "n_kv_heads"):
        choose(f"model.{k}", getattr(shape, k), rule if k == "d_model" else f"with d_model ({shape.name})")
    choose("model.max_seq_len", seq, "rule: 256 on a CPU (speedrun), 1024 on a GPU")
    choose("train.micro_batch_size", micro, "rule: 16 sequences (speedrun: 8 and 32x128 lost)")
    batch = BATCH_RULE[0] * (6 * n * d) ** BATCH_RULE[1]
    accum = max(1, min(64, round(batch / (micro * seq))))
    while accum > 1 and d / (accum * micro * seq) < 100:  # at least 100 updates
        accum //= 2
    choose("train.grad_accum_steps", accum, f"rule: {BATCH_RULE[0]:g} C^{BATCH_RULE[1]:g} = {batch:,.0f} "
           "tokens/step")
    d_model = user.get("model.d_model", shape.d_model)
    lr = min(max(LR_AT_128 * 128 / d_model, LR_RANGE[0]), LR_RANGE[1])
    choose("optim.lr", lr, f"rule: {LR_AT_128:.3g} x 128 / d_model, at most {LR_RANGE[1]:g} (python grid, "
           "2 and 5 min)")
    _schedule(choose, user, user.get("train.grad_accum_steps", accum) * micro * seq / tps, train_s)
    choose("train.precision", throughput.precision, throughput.precision_why)
    choose("train.max_time", round(train_s, 2), _max_time_why(phases, d / unique, unique))
    choose("train.max_steps", 1_000_000_000, "the clock ends the run")
    _evaluation_choices(choose, throughput, corpus, user, evaluation(shape)[0], chars / cpt, budget_s)
    predicted = {"params": n, "tokens": int(d), "tokens_per_s": tps, "loss": row["loss"]}
    return Plan(budget_s, {k: round(v, 2) for k, v in phases.items()}, choices, rows, predicted)
