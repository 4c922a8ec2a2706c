"""`lmforge sft --budget 2m`: read the base model's and the data's facts, probe the machine's fine-tuning
step, plan the run (tools/sft_planner.py), then prepare, fine-tune and evaluate it, the whole process
inside the budget (the clock is the process's: tools/planner_probe.Deadline).

The data's facts come from preparing it once at the base's full context in a scratch dir (the lengths the
context is chosen from, and how long preparing takes); the run prepares it again at the planned context.
The final evaluation is the validation loss and, where sft.val_data holds shipped task records
(`lmforge tasks --test-out`), the exact match of greedy replies to them, both cut short at the deadline."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import ConfigError, DataError, LmforgeError
from lmforge.tools.planner_probe import Deadline, probe_optimizer, timed_steps
from lmforge.tools.planner_run import DeadlineStop, PlanFiles, _EvalUntil, user_keys
from lmforge.tools.sft_planner import (
    EXACT_RECORDS,
    LORA_R,
    MARGIN_S,
    MARGIN_SHARE,
    MIN_TRAIN_S,
    SEQ_QUANTILE,
    SETUP_S,
    DataFacts,
    ModelFacts,
    SftThroughput,
    check_budget,
    full_fits,
    micro_for,
    plan_sft,
    seq_for,
)

PROBE_SHARE, PROBE_MIN_S, PROBE_MAX_S = 0.05, 1.0, 30.0


def model_facts(cfg) -> ModelFacts:
    from lmforge.tools.scaling_inputs import param_count

    m = cfg.model
    return ModelFacts(param_count(m, "total"), m.d_model, m.n_layers, m.max_seq_len)


def exact_records(cfg) -> list[dict]:
    """The held-out task records of sft.val_data (JSONL files of `lmforge tasks`), EXACT_RECORDS at most,
    the same share of each task; none where sft.val_data holds anything else."""
    from lmforge.eval.open_run import _task_records
    from lmforge.eval.tasks.runners import first_of_each

    files = [Path(p) for p in cfg.sft.val_data]
    if not files or any(not f.is_file() or f.suffix.lower() != ".jsonl" for f in files):
        return []
    try:
        records = [r for f in files for r in _task_records(f)]
    except DataError:
        return []
    per_task = max(1, EXACT_RECORDS // max(1, len({r["task"] for r in records})))
    return first_of_each(records, "task", per_task)[:EXACT_RECORDS]


def data_facts(cfg, n_exact: int, say: Callable[[str], object]) -> DataFacts:
    """The training conversations' lengths at the base's whole context, prepared once in a scratch dir
    (preparing's time measured: the run prepares again at the planned context)."""
    from lmforge.data.sft import prepare_sft

    with tempfile.TemporaryDirectory(prefix="lmforge-sft-facts-") as tmp:
        probe_cfg = cfg.model_copy(update={
            "data": cfg.data.model_copy(update={"dir": str(Path(tmp) / "data")}),
            "train": cfg.train.model_copy(update={"seq_len": cfg.model.max_seq_len})})
        t0 = time.perf_counter()
        data = prepare_sft(probe_cfg, console=lambda _: None)
        seconds = time.perf_counter() - t0
        lengths = data.split("train").lengths
    if len(lengths) == 0:
        raise DataError(f"sft.data {', '.join(cfg.sft.data)} holds no conversations to fine-tune on")
    facts = DataFacts(int(len(lengths)), int(lengths.sum()), int(np.quantile(lengths, SEQ_QUANTILE)),
                      int(lengths.max()), round(seconds, 2), n_exact)
    say(f"planning: {facts.examples:,} conversations, {facts.tokens:,} tokens, {SEQ_QUANTILE:.0%} within "
        f"{facts.length_q} tokens (prepared in {seconds:.1f}s)")
    return facts


def _step_seconds(cfg, method: str, r: int, micro: int, seq: int, device, precision: str, until: float
                  ) -> float:
    """The fastest of timed_steps' fine-tuning steps of the base's shape (random weights: the speed is the
    same) with `method`'s trainable parameters."""
    import torch

    from lmforge.config.train import FinetuneConfig
    from lmforge.engine.precision import Precision
    from lmforge.finetune.setup import apply_finetune
    from lmforge.models import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(cfg.model.model_copy(update={"init_from": None}), device=device)
        ft = cfg.finetune.model_copy(update={"method": method}) if method == "full" else \
            FinetuneConfig(method="lora" if method == "lora" else method, r=r, alpha=2.0 * r)
        apply_finetune(model, ft)
        opt = probe_optimizer([p for p in model.parameters() if p.requires_grad], device)
        prec = Precision(precision, device)
        return timed_steps(model, opt, prec, cfg.model.vocab_size, micro, seq, device, until,
                           cfg.train.keep_host_memory)


def _memory(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def probe(budget_s: float, cfg, model: ModelFacts, data: DataFacts, user: dict[str, Any], deadline: Deadline,
          say: Callable[[str], object] = print) -> SftThroughput:
    """Tokens/s of a fine-tuning step per method the plan may choose (full only where it fits), in at most
    PROBE_SHARE of the budget."""
    from lmforge.engine.precision import resolve_precision
    from lmforge.parallel.world import World, resolve_device

    device = resolve_device(cfg.train.device, World.from_env())
    seq = seq_for(model, data, user)[0]
    micro = micro_for(device.type, seq, user)
    asked = user.get("train.precision", "auto")
    precision = resolve_precision(asked, device)  # no model: fp32 on a CPU, bf16 on a GPU that has it
    memory = _memory(device)
    method = user.get("finetune.method")
    methods = [method] if method else ["lora", *(["full"] if full_fits(model, memory) else [])]
    allot = min(max(PROBE_MIN_S, PROBE_SHARE * budget_s), PROBE_MAX_S)
    until = time.perf_counter() + allot
    say(f"planning: measuring a fine-tuning step ({', '.join(methods)}; {micro} x {seq} tokens, {precision}) "
        f"for at most {allot:.1f}s")
    # one tiny step first: the process's first step pays one-time costs (thread pools, the allocator, lazy
    # imports) of a second or more that would otherwise be charged to the first method measured
    from lmforge.tools.planner_probe import Shape
    from lmforge.tools.planner_probe import _step_seconds as tiny_step

    tiny_step(Shape(32, 1, 1, 1), 64, 1, 16, device, precision, 0.0)
    speeds: dict[str, float] = {}
    for m in methods:
        if speeds and time.perf_counter() >= until:
            break
        seconds = _step_seconds(cfg, m, int(user.get("finetune.r", LORA_R)), micro, seq, device, precision,
                                until)
        speeds["full" if m == "full" else "lora"] = micro * seq / seconds
        say(f"  {m}: {micro * seq / seconds:,.0f} tok/s")
    why = f"{precision} (set)" if asked != "auto" else f"{precision} (auto on {device.type}, not measured)"
    return SftThroughput(device.type, speeds, micro, seq, memory, precision, why,
                         spent_s=round(deadline.elapsed, 2))


def run_sft_budget(budget_s: float, config: str | None, sets: Sequence[str], *,
                   deadline: Deadline | None = None, say: Callable[[str], object] = print) -> dict[str, Any]:
    """Plan a fine-tuning run for `budget_s` seconds and do it; returns the final metrics (and exact_match
    where there are held-out task records)."""
    from lmforge.checkpoint.run_dir import holds_run
    from lmforge.checkpoint.runs import resolve_init_from
    from lmforge.config.load import load_config
    from lmforge.parallel.world import World

    deadline = deadline or Deadline.from_process(budget_s)
    if World.from_env().world_size > 1:
        raise ConfigError("--budget plans a single-process run (one GPU or the CPU); run it without torchrun")
    sets = [*sets, "objective.name=sft"]
    base = load_config(config, sets)
    user = {k: v for k, v in user_keys(base).items() if k != "objective.name"}
    check_budget(budget_s, user)
    if not base.model.init_from:
        raise ConfigError("lmforge sft --budget fine-tunes a base model: set model.init_from to its run dir, "
                          "checkpoint or Hugging Face dir")
    run_dir = Path(base.run.dir)
    if holds_run(run_dir) and not base.run.overwrite:
        raise LmforgeError(f"run.dir {run_dir} already holds a run; --set run.overwrite=true to replace it, "
                           "or choose another run.dir")
    resolved = resolve_init_from(base, say=lambda _: None, derived=True)
    model = model_facts(resolved)
    exact = exact_records(base)
    data = data_facts(resolved, len(exact), say)
    throughput = probe(budget_s, resolved, model, data, user, deadline, say)
    p = plan_sft(budget_s, throughput, model, data, user)
    say(p.table())
    return _train(p, config, sets, exact, deadline, say)


def _train(p, config: str | None, sets: Sequence[str], exact: list[dict], deadline: Deadline,
           say: Callable[[str], object]) -> dict[str, Any]:
    from lmforge.checkpoint.runs import resolve_init_from
    from lmforge.config.load import load_config
    from lmforge.data.sft import prepare_sft
    from lmforge.parallel.process_group import abandon, shutdown
    from lmforge.train.trainer import Trainer
    from lmforge.utils.io import atomic_write_json

    extra = [f"{k}={json.dumps(v)}" for k, v in p.settings.items() if k != "train.max_time"]
    # the planned train.max_time to prepare with (schedule.unit time needs one); set again below from what
    # preparing left (it is no part of the prepared data's settings)
    cfg = load_config(config, [*sets, *extra, f"train.max_time={p.settings['train.max_time']}"])
    t_prepare = deadline.elapsed
    prepare_sft(resolve_init_from(cfg, say=lambda _: None, derived=True), console=say, replace=True)
    actual = {"start-up, facts and probe": p.phases["start-up, facts and probe"],
              "prepare": deadline.elapsed - t_prepare}
    phases = p.phases
    reserve = phases["evaluate"] + phases["exact match"] + phases["margin"]
    train_s = round(deadline.left - SETUP_S - reserve, 2)
    if train_s < MIN_TRAIN_S:
        raise LmforgeError(f"preparing the data took {actual['prepare']:.1f}s (planned "
                           f"{phases['prepare']:.1f}s), which leaves {train_s:.1f}s of training in the "
                           f"--budget {p.budget_s:g}s; give a larger budget")
    cfg = load_config(config, [*sets, *extra, f"train.max_time={train_s}"])
    info: dict[str, Any] = {"train.max_time": train_s, "actual": actual}
    margin = MARGIN_SHARE * p.budget_s + MARGIN_S
    try:
        trainer = Trainer(cfg, callbacks=[PlanFiles(p, info), DeadlineStop(deadline, reserve)])
        if trainer.run.val_loader is not None:
            held = margin + phases["exact match"]  # the validation loss leaves the exact match its time
            trainer.run.val_loader = _EvalUntil(trainer.run.val_loader, deadline, held)
        t_train = deadline.elapsed
        metrics = dict(trainer.fit() or {})
        actual["train and evaluate"] = deadline.elapsed - t_train
        if exact:
            t_exact = deadline.elapsed
            metrics.update(_exact_match(trainer, exact, deadline, margin))
            actual["exact match"] = deadline.elapsed - t_exact
    except BaseException:
        abandon()
        raise
    actual["total"] = deadline.elapsed
    info["final"] = metrics
    atomic_write_json(Path(trainer.run_dir) / "plan.json", {**p.to_json(), **info})
    em = (f"; exact match {metrics['exact_match']:.3f} on {metrics['exact_match_records']} held-out records"
          if "exact_match" in metrics else "")
    loss = f"; val loss {metrics['loss']:.4f}" if metrics.get("loss") is not None else ""
    say(f"budget {p.budget_s:g}s: {actual['total']:.1f}s so far (prepare {actual['prepare']:.1f}s, train and "
        f"evaluate {actual['train and evaluate']:.1f}s){loss}{em}; run dir {trainer.run_dir}")
    shutdown()
    return metrics


def _exact_match(trainer, records: list[dict], deadline: Deadline, margin: float) -> dict[str, Any]:
    """Exact match of the fine-tuned model's greedy replies to `records`, batch by batch until the deadline
    (less the exit margin): the records scored are counted."""
    import torch

    from lmforge.eval.chat import task_accuracy
    from lmforge.eval.open_run import chat_template_of

    run, model = trainer.run, trainer.run.model
    template = chat_template_of(run)
    model.eval()
    totals: dict[str, list[int]] = {}
    batch, t0, done = 32, time.perf_counter(), 0
    with torch.no_grad():
        for i in range(0, len(records), batch):
            per = (time.perf_counter() - t0) / max(1, i)  # seconds per record so far
            if i and deadline.left - per * batch < margin:
                break
            acc = task_accuracy(model, run.tokenizer, template, records[i:i + batch], device=run.device)
            for task, (c, n) in acc.items():
                totals.setdefault(task, [0, 0])
                totals[task][0] += c
                totals[task][1] += n
            done = i + len(records[i:i + batch])
    correct = sum(c for c, _ in totals.values())
    write = {"exact_match_by_task": {k: c / n for k, (c, n) in totals.items()}}
    return {"exact_match": correct / max(1, done), "exact_match_records": done, **write}

