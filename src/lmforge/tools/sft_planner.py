"""`lmforge sft --budget`'s choice: `plan_sft(budget_s, throughput, model, data, user) -> Plan`, a pure
function of the machine's measured step speed (tools/sft_planner_run.py measures it), the base model, the
prepared data and the keys the user set; the same shape as the pretraining planner (tools/planner.py).

What it chooses, and from what (the measured rules cite bench/results/sft_planner_rules.json, written by
bench/sft_planner_rules.py: a grid of LoRA rank x lr and full fine-tuning at one training time, scored by
exact match on held-out shipped tasks):

- the phases of the whole process: start-up, reading the base and the data's facts and the probe (spent
  before planning), preparing the data at the planned context, assembling the run, training, the final
  evaluation (validation loss, and exact match where the held-out data are shipped tasks), an exit margin;
- the method: full fine-tuning where its weights, gradients and AdamW state fit the memory and it gets
  its steps at its measured speed, and the bench found full ahead of LoRA; LoRA otherwise;
- LoRA rank, alpha and targets; the context from the data's length distribution; micro-batch and
  accumulation; lr by method and model width; a warm-up/stable/cooldown schedule over time.

Any key the user set is kept and the rest is planned around it; the plan says for each choice why."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmforge.errors import ConfigError
from lmforge.tools.planner import MAX_BUDGET_S, Choice, Plan, _show

# -- rules, with the measurements that chose them (bench/results/sft_planner_rules.json) ----------------
RULES_WIDTH = 128  # the bench's base model (d128-L4, pretrained by the bench)
# 150 steps of 8 x 64 tokens each, exact match on 158 held-out prompts (then held-out loss):
LORA_R = 4  # the best rank of 4 / 16 / 64 at lr 4e-3 (8 / 4 / 3 correct; losses 3.57 / 3.48 / 3.63)
LORA_LR = 4e-3  # the better LoRA lr of 1e-3 / 4e-3 at ranks 4 and 16, at any width (adapters start at zero)
FULL_LR = 1e-3  # full fine-tuning's lr at RULES_WIDTH (the one measured); scaled as RULES_WIDTH / d_model
FULL_BEATS_LORA = True  # full: 13 correct, held-out loss 2.17, against the best LoRA's 8 and 3.48
LR_RANGE = (1e-5, 1e-2)
# targets: every linear layer (QLoRA, Dettmers et al. 2023 sec. 4: adapters on all linear layers are what
# match full fine-tuning; attention-only adapters fell short)
TARGETS = ["all-linear"]
# keys that only adapters read: set by the user, they choose LoRA (full fine-tuning would ignore them)
ADAPTER_KEYS = ("finetune.r", "finetune.alpha", "finetune.targets", "finetune.dropout", "finetune.rslora")
# tokens per micro-batch: 8 x 64 = 512 on a CPU (the bench's: many small steps in a budget of seconds; at
# 16 x 128 a 40 s run made 12 steps there), 16,384 on a GPU (fills its matmuls; not measured here)
MICRO_TOKENS = {"cpu": 512, "cuda": 16384}
SEQ_QUANTILE = 0.99  # the context holds 99% of the conversations whole; packing fills the rest
MIN_SEQ = 32
# Full fine-tuning's memory: fp32 weights + gradients + AdamW's two moments = 16 bytes a parameter, in at
# most this share of the memory free before the run (the rest: activations, the data, the OS)
FULL_BYTES_PER_PARAM, FULL_MEMORY_SHARE = 16, 0.5

# -- the schedule (pretraining planner's, measured by the speedrun: tools/planner.py) ---------------------
WARMUP_SECONDS, WARMUP_SHARE, COOLDOWN_FRACTION = 15.0, 0.05, 0.3

# -- the shares of the budget (decisions; docs/stages/planning.md says why) ------------------------------
EVAL_SHARE = 0.03  # validation loss
EXACT_SHARE = 0.05  # exact match on held-out task records, when there are some
EVAL_SPEEDUP = 3.0  # a forward alone is about a third of a training step
MARGIN_SHARE, MARGIN_S = 0.02, 2.0
SETUP_S = 2.0  # loading the base, applying adapters, the optimizer (~1 s at the demo's size)
MIN_TRAIN_S = 5.0
MIN_STEPS = 20
EXACT_RECORDS = 256  # at most this many held-out records are scored (the tasks' families x 32)


@dataclass(frozen=True)
class ModelFacts:
    """The base model: its parameters (all of them), width, depth and context."""

    params: int
    d_model: int
    n_layers: int
    max_seq_len: int


@dataclass(frozen=True)
class DataFacts:
    """The training conversations as the base's tokenizer and template render them: how many, their tokens
    (all, whole) and the length the context must hold for SEQ_QUANTILE of them; whether held-out task
    records (exact match) are there, and how long preparing took."""

    examples: int
    tokens: int
    length_q: int  # tokens of the SEQ_QUANTILE conversation
    max_length: int
    prepare_s: float = 0.0
    exact_records: int = 0


@dataclass(frozen=True)
class SftThroughput:
    """The machine as the probe measured it: tokens/s of one training step per method ("full", "lora")
    at (micro, seq), the memory free, and the seconds spent before planning."""

    device: str
    tokens_per_s: dict[str, float]
    micro: int
    seq: int
    memory_bytes: int
    precision: str = "fp32"
    precision_why: str = "fp32 (not measured)"
    spent_s: float = 0.0


def seq_for(model: ModelFacts, data: DataFacts, user: dict[str, Any]) -> tuple[int, str]:
    """The context: the user's train.seq_len, else the length that holds SEQ_QUANTILE of the conversations
    whole, rounded up to 16, within [MIN_SEQ, the base's context]."""
    if user.get("train.seq_len"):
        return int(user["train.seq_len"]), "user"
    seq = min(model.max_seq_len, max(MIN_SEQ, -(-data.length_q // 16) * 16))
    why = f"rule: holds {SEQ_QUANTILE:.0%} of the conversations whole ({data.length_q} tokens)"
    return seq, why + (f", the base's context {model.max_seq_len}" if seq == model.max_seq_len else "")


def micro_for(device: str, seq: int, user: dict[str, Any]) -> int:
    if user.get("train.micro_batch_size"):
        return int(user["train.micro_batch_size"])
    return max(1, min(256, MICRO_TOKENS.get(device, MICRO_TOKENS["cpu"]) // seq))


def full_fits(model: ModelFacts, memory_bytes: int) -> bool:
    return model.params * FULL_BYTES_PER_PARAM <= FULL_MEMORY_SHARE * memory_bytes


def check_budget(budget_s: float, user: dict[str, Any]) -> None:
    if "train.max_time" in user:
        raise ConfigError("--budget plans train.max_time from what is left of the budget; remove "
                          "train.max_time from the config (or drop --budget)")
    if not (math.isfinite(budget_s) and 0 < budget_s <= MAX_BUDGET_S):
        raise ConfigError(f"--budget {budget_s:g}s: give a budget above 0 and at most "
                          f"{MAX_BUDGET_S / 3600:g}h")


class _TooSmall(Exception):
    pass


def plan_sft(budget_s: float, throughput: SftThroughput, model: ModelFacts, data: DataFacts,
             user: dict[str, Any]) -> Plan:
    """The fine-tuning run to do in `budget_s` seconds of wall time. Pure: the same inputs give the same
    plan. ConfigError for a budget too small, naming the smallest that would work."""
    try:
        return _plan(budget_s, throughput, model, data, user)
    except _TooSmall as e:
        lo, hi = max(1, math.floor(budget_s)), math.ceil(MAX_BUDGET_S)
        if not _works(hi, throughput, model, data, user):
            raise ConfigError(f"no budget up to {MAX_BUDGET_S / 3600:g}h fine-tunes this model with the keys "
                              f"you set on this machine ({e.args[0]})") from None
        while hi - lo > 1:  # more budget only adds training time: the budgets that work are an interval
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _works(mid, throughput, model, data, user) else (mid, hi)
        raise ConfigError(f"--budget {budget_s:g}s is too small to fine-tune this model on this machine: "
                          f"{e.args[0]}; the smallest budget that would work is {hi}s") from None


def _works(budget_s, throughput, model, data, user) -> bool:
    try:
        _plan(budget_s, throughput, model, data, user)
        return True
    except _TooSmall:
        return False


def phases_for(budget_s: float, throughput: SftThroughput, data: DataFacts) -> dict[str, float]:
    """Seconds of each phase; training gets what the others leave."""
    eval_s = EVAL_SHARE * budget_s
    exact_s = EXACT_SHARE * budget_s if data.exact_records else 0.0
    margin_s = MARGIN_SHARE * budget_s + MARGIN_S
    prepare_s = data.prepare_s
    train_s = budget_s - throughput.spent_s - prepare_s - SETUP_S - eval_s - exact_s - margin_s
    return {"start-up, facts and probe": throughput.spent_s, "prepare": prepare_s, "setup": SETUP_S,
            "train": train_s, "evaluate": eval_s, "exact match": exact_s, "margin": margin_s}


def _method(throughput: SftThroughput, model: ModelFacts, user: dict[str, Any], step_tokens: int,
            train_s: float) -> tuple[str, str, list[dict[str, Any]]]:
    """(method, why, candidate rows): full where it fits, gets its steps and the bench found it ahead."""
    rows = []
    for name in ("full", "lora"):
        tps = throughput.tokens_per_s.get(name)
        steps = int(tps * train_s / step_tokens) if tps else 0
        why = ""
        if tps is None:
            why = "not measured in the probe's time"
        elif name == "full" and not full_fits(model, throughput.memory_bytes):
            why = (f"does not fit: {model.params * FULL_BYTES_PER_PARAM / 2**30:.2f} GiB of weights, "
                   f"gradients and AdamW state > {FULL_MEMORY_SHARE:.0%} of "
                   f"{throughput.memory_bytes / 2**30:.1f} GiB")
        elif steps < MIN_STEPS:
            why = f"fewer than {MIN_STEPS} steps"
        rows.append({"method": name, "tokens_per_s": round(tps) if tps else None, "steps": steps, "why": why})
    if "finetune.method" in user:
        return user["finetune.method"], "user", rows
    ok = {r["method"] for r in rows if not r["why"]}
    adapter_keys = sorted(k for k in ADAPTER_KEYS if k in user)
    if adapter_keys and "lora" in ok:  # an adapter setting of the user's is kept: it means adapters
        return "lora", f"you set {', '.join(adapter_keys)}", rows
    if "full" in ok and (FULL_BEATS_LORA or "lora" not in ok):
        return "full", "rule: fits and gets its steps; full beat LoRA at the bench's budget", rows
    if "lora" in ok:
        full = rows[0]["why"] or "LoRA beat full at the bench's budget"
        return "lora", f"rule: full {full}", rows
    whys = ", ".join(f"{r['method']}: {r['why']}" for r in rows)
    raise _TooSmall(f"no method gets {MIN_STEPS} steps in {train_s:.1f}s of training at the measured speed "
                    f"({whys})")


def _plan(budget_s: float, throughput: SftThroughput, model: ModelFacts, data: DataFacts,
          user: dict[str, Any]) -> Plan:
    check_budget(budget_s, user)
    if not throughput.tokens_per_s:
        raise ConfigError("the throughput probe measured no training step in its time")
    seq, seq_why = seq_for(model, data, user)
    micro = micro_for(throughput.device, seq, user)
    phases = phases_for(budget_s, throughput, data)
    train_s = phases["train"]
    accum = int(user.get("train.grad_accum_steps", 1))
    step_tokens = micro * seq * accum
    if train_s < MIN_TRAIN_S:
        raise _TooSmall(f"start-up, the data's facts and the probe took {throughput.spent_s:.1f}s and "
                        f"preparing takes {data.prepare_s:.1f}s, leaving {train_s:.1f}s of training (at "
                        f"least {MIN_TRAIN_S:g}s)")
    method, method_why, rows = _method(throughput, model, user, step_tokens, train_s)
    tps = throughput.tokens_per_s.get("full" if method == "full" else "lora")
    if tps is None:
        raise ConfigError(f"finetune.method={method}: the probe did not measure it")
    steps = int(tps * train_s / step_tokens)
    if steps < MIN_STEPS:
        raise _TooSmall(f"finetune.method={method} gets {steps} steps in {train_s:.1f}s of training "
                        f"(at least {MIN_STEPS})")
    choices = [Choice("budget", f"{budget_s:g}s", "--budget")]

    def choose(key: str, value: Any, why: str) -> None:
        choices.append(Choice(key, user[key], "user") if key in user else Choice(key, value, why))

    choose("finetune.method", method, method_why)
    lora = method in ("lora", "dora", "qlora")
    if lora:
        r = int(user.get("finetune.r", LORA_R))
        choose("finetune.r", LORA_R, f"rule: the bench's best of ranks 4/16/64 ({RULES_WIDTH}-wide base)")
        choose("finetune.alpha", float(2 * r), "rule: 2 x rank (the bench's ratio)")
        choose("finetune.targets", list(TARGETS), "rule: every linear layer (QLoRA sec. 4)")
        lr, lr_why = LORA_LR, "rule: the bench's best LoRA lr (1e-3/4e-3)"
    else:
        lr = FULL_LR * RULES_WIDTH / model.d_model
        lr_why = f"rule: {FULL_LR:g} x {RULES_WIDTH} / d_model (the bench's full lr)"
    choose("optim.lr", min(max(lr, LR_RANGE[0]), LR_RANGE[1]), lr_why)
    choose("optim.weight_decay", 0.0, "rule: none on a short fine-tune (configs/sft)")
    choose("train.seq_len", seq, seq_why)
    choose("sft.packing", True, "rule: pack short conversations into the context (bench/sft_packing.py: "
           "2.17x)")
    choose("train.micro_batch_size", micro, f"rule: {MICRO_TOKENS.get(throughput.device, 512):,} tokens per "
           f"micro-batch on {throughput.device}")
    choose("train.grad_accum_steps", 1, "rule: one micro-batch per update (the bench's runs)")
    epochs = steps * step_tokens / max(1, data.tokens)
    choose("train.max_steps", 1_000_000_000, f"the clock ends the run: ~{steps:,} steps, ~{epochs:.2g} "
           f"epochs at {tps:,.0f} tok/s")
    choose("train.max_time", round(train_s, 2), "what is left of the budget (re-set after preparing)")
    choose("schedule.name", "wsd", "rule: warm-up, flat, cooldown over the end (the pretraining planner's)")
    choose("schedule.unit", "time", "the budget is wall time")
    if user.get("schedule.name", "wsd") == "wsd":
        choose("schedule.warmup_seconds", round(min(WARMUP_SECONDS, WARMUP_SHARE * train_s), 2),
               f"rule: min({WARMUP_SECONDS:g}s, {WARMUP_SHARE:.0%} of training)")
        choose("schedule.cooldown_fraction", COOLDOWN_FRACTION, "rule: the last 30%")
        choose("schedule.min_lr_ratio", 0.0, "rule: decay to 0")
    choose("train.precision", throughput.precision, throughput.precision_why)
    choose("train.eval_every", 0, "one evaluation, at the end")
    eval_batches = max(1, int(phases["evaluate"] * EVAL_SPEEDUP * tps / (micro * seq)))
    choose("train.eval_batches", eval_batches, f"rule: {EVAL_SHARE:.0%} of the budget at {EVAL_SPEEDUP:g}x "
           "the training speed")
    choose("checkpoint.every", 0, "one checkpoint, at the end")
    choose("logging.plot", False, "rule: curves.png costs 1-5 s of the budget")
    predicted = {"steps": steps, "epochs": round(epochs, 3), "tokens_per_s": tps}
    return SftPlan(budget_s, {k: round(v, 2) for k, v in phases.items()}, choices, rows, predicted)


class SftPlan(Plan):
    """The pretraining planner's Plan, its candidate table listing methods instead of shapes."""

    def markdown(self) -> str:
        out = [f"# Fine-tuning plan for a budget of {self.budget_s:g} s", "", "| phase | seconds |",
               "|---|---|"]
        out += [f"| {k} | {v:.1f} |" for k, v in self.phases.items()]
        out += ["", "| choice | value | why |", "|---|---|---|"]
        out += [f"| {c.key} | {_show(c.value)} | {c.why} |" for c in self.choices]
        out += ["", "| method | tokens/s | steps | why not |", "|---|---|---|---|"]
        out += [f"| {c['method']} | {c['tokens_per_s'] or '-'} | {c['steps']} | {c['why'] or '-'} |"
                for c in self.candidates]
        return "\n".join(out) + "\n"
