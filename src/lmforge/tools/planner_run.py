"""`lmforge train --budget 5m`: probe the machine, plan the run (tools/planner.py), then prepare, train and
evaluate it, the whole process inside the budget; `--plan-only` writes the planned config instead.

The clock is the process's (planner_probe.Deadline): start-up, the probe, preparing the corpus and
tokenizer, assembling the run, training and the final evaluation all count. The plan predicts how long
preparing takes; train.max_time is set again once preparing is done, from what is really left, so a slow
disk or a busy machine takes its time from training, not from the budget."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError, LmforgeError
from lmforge.tools.planner import (
    MIN_TRAIN_S,
    SETUP_S,
    Corpus,
    Plan,
    check_budget,
    plan,
)
from lmforge.tools.planner_probe import Deadline, probe
from lmforge.train.callbacks import Callback

SHAPE_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads")


def user_keys(cfg) -> dict[str, Any]:
    """dotted key -> value of every key the config file or --set gave (pydantic's fields_set, walked
    section by section); a model preset counts as setting the shape it names."""
    from pydantic import BaseModel

    out: dict[str, Any] = {}

    def walk(node: BaseModel, prefix: str) -> None:
        for name in sorted(node.model_fields_set):
            value = getattr(node, name)
            if isinstance(value, BaseModel):
                walk(value, f"{prefix}{name}.")
            else:
                out[f"{prefix}{name}"] = value

    walk(cfg, "")
    if out.get("model.preset") is not None:
        out.update({f"model.{k}": getattr(cfg.model, k) for k in SHAPE_KEYS})
    return out


def planned_config(config: str | None, sets: Sequence[str], p: Plan):
    """The user's config with the plan's choices put in as --set overrides after theirs (keys they set are
    not among the plan's settings to change: the plan kept them)."""
    from lmforge.config.load import load_config

    extra = [f"{k}={json.dumps(v)}" for k, v in p.settings.items()]
    return load_config(config, [*sets, *extra])


class DeadlineStop(Callback):
    """Ends training when what is left of the whole process's budget is only the final evaluation and the
    exit: train.max_time counts training steps only, and on a busy machine the rest (logging, the loader)
    takes longer than planned."""

    def __init__(self, deadline: Deadline, reserve_s: float) -> None:
        self.deadline, self.reserve_s = deadline, reserve_s

    def on_step_end(self, trainer, step: int, result) -> None:
        if self.deadline.left - trainer.clock.last < self.reserve_s:
            trainer.request_stop("budget_deadline", left_s=round(self.deadline.left, 2))


class _EvalUntil:
    """The run's validation loader, its final evaluation cut short where the whole process's deadline (less
    the exit margin) comes first: its batches were sized from the probe's speed, and a machine that got
    busier since must not overrun the budget (the loss and bpb are then over fewer, but whole, batches)."""

    def __init__(self, loader, deadline: Deadline, margin_s: float) -> None:
        self.loader, self.deadline, self.margin_s = loader, deadline, margin_s

    def iter_eval_batches(self, max_batches: int | None = None):
        for i, batch in enumerate(self.loader.iter_eval_batches(max_batches)):
            if i and self.deadline.left < self.margin_s:
                return
            yield batch

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


class PlanFiles(Callback):
    """plan.json and plan.md in the run dir, once it exists (before the first step)."""

    def __init__(self, p: Plan, extra: dict[str, Any]) -> None:
        self.plan, self.extra = p, extra

    def on_train_start(self, trainer) -> None:
        write_plan(self.plan, Path(trainer.run_dir), self.extra)


def write_plan(p: Plan, where: Path, extra: dict[str, Any] | None = None) -> list[Path]:
    from lmforge.utils.io import atomic_write_json, atomic_write_text

    where.mkdir(parents=True, exist_ok=True)
    atomic_write_json(where / "plan.json", {**p.to_json(), **(extra or {})})
    atomic_write_text(where / "plan.md", p.markdown())
    return [where / "plan.json", where / "plan.md"]


def run_budget(budget_s: float, config: str | None, sets: Sequence[str], *, plan_only: bool = False,
               out: str | None = None, overwrite: bool = False, deadline: Deadline | None = None,
               say: Callable[[str], object] = print) -> dict[str, Any]:
    """Plan for `budget_s` seconds and train (returns the final metrics), or with `plan_only` write the
    planned config.yaml, plan.json and plan.md into `out` (default: <run.dir>-plan) and return the plan."""
    import yaml

    from lmforge.checkpoint.run_dir import holds_run
    from lmforge.config.load import config_to_dict, load_config
    from lmforge.config.methods import DEFAULT_METHOD
    from lmforge.parallel.world import World
    from lmforge.utils.io import atomic_write_text, check_new_file

    deadline = deadline or Deadline.from_process(budget_s)
    if World.from_env().world_size > 1:
        raise ConfigError("--budget plans a single-process run (one GPU or the CPU); run it without torchrun")
    base = load_config(config, list(sets))
    user = user_keys(base)
    check_budget(budget_s, user)
    if base.objective.name != DEFAULT_METHOD or base.finetune.method != "full" or base.model.init_from:
        raise ConfigError(f"--budget plans pretraining from scratch (objective {DEFAULT_METHOD}, "
                          "finetune.method full, no model.init_from); drop --budget to train this config as "
                          "it is")
    run_dir = Path(base.run.dir)
    files = []
    if plan_only:
        where = Path(out) if out else run_dir.with_name(run_dir.name + "-plan")
        files = [check_new_file(where / n, overwrite) for n in ("config.yaml", "plan.json", "plan.md")]
    elif holds_run(run_dir) and not base.run.overwrite:
        raise LmforgeError(f"run.dir {run_dir} already holds a run; --set run.overwrite=true to replace it, "
                           "or choose another run.dir")
    from lmforge.data.sources import source_size

    corpus = Corpus(chars=sum(source_size(s) for s in base.data.source_paths) or None,
                    val_chars=sum(source_size(s) for s in base.data.val_sources))
    throughput = probe(budget_s, user, deadline, base.train.device, say, corpus)
    p = plan(budget_s, throughput, corpus, user)
    say(p.table())
    cfg = planned_config(config, sets, p)
    if plan_only:
        atomic_write_text(files[0], yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        write_plan(p, files[0].parent)
        say(f"wrote {files[0]}, plan.json and plan.md; train it with: lmforge train -c {files[0]}")
        return p.to_json()
    if base.run.overwrite and "data.dir" not in user:
        replace_stale_data(cfg, say)
    return _train(p, cfg, config, sets, deadline, say)


def replace_stale_data(cfg, say: Callable[[str], object]) -> None:
    """With run.overwrite and no data.dir of the user's, the prepared data in <run.dir>/data is the old
    run's: a plan's data settings follow the measured speed and change from one `--budget` to the next, so
    data prepared for another plan goes with the run it belonged to (under the run dir's lock, so never
    while a run trains there). A dir that is not prepared data (no meta.json) is refused by preparing as
    before, and nothing outside the run dir is touched."""
    import shutil

    from lmforge.checkpoint.run_dir import RunLock
    from lmforge.data.prepare import check_reusable, data_dir
    from lmforge.data.shards import read_meta
    from lmforge.errors import DataError

    out = data_dir(cfg)
    try:
        check_reusable(cfg)
        return
    except DataError:
        if read_meta(out) is None or out.is_symlink() or out.parent != Path(cfg.run.dir):
            raise
    lock = RunLock.acquire(Path(cfg.run.dir))
    try:
        say(f"run.overwrite: replacing {out}, prepared for another plan")
        shutil.rmtree(out)
    finally:
        lock.release()


def _train(p: Plan, cfg, config: str | None, sets: Sequence[str], deadline: Deadline,
           say: Callable[[str], object]) -> dict[str, Any]:
    from lmforge.config.load import load_config
    from lmforge.data.prepare import prepare
    from lmforge.parallel.process_group import abandon, shutdown
    from lmforge.train.trainer import Trainer

    t_prepare = deadline.elapsed
    prepare(cfg, console=say)
    actual = {"start-up and probe": p.phases["start-up and probe"], "prepare": deadline.elapsed - t_prepare}
    budget = p.budget_s
    eval_s, margin_s = p.phases["evaluate"], p.phases["margin"]  # the plan's, for the shape it chose
    train_s = round(deadline.left - SETUP_S - eval_s - margin_s, 2)
    if train_s < MIN_TRAIN_S:
        raise LmforgeError(f"preparing the data took {actual['prepare']:.1f}s (planned "
                           f"{p.phases['prepare']:.1f}s), which leaves {train_s:.1f}s of training in the "
                           f"--budget {budget:g}s; give a larger budget (the data is prepared now and is "
                           "reused)")
    if "not needed" in p.phases:  # the epoch bound ends training early: time saved in preparing is not used
        train_s = min(train_s, p.settings["train.max_time"])
    if abs(train_s - p.settings["train.max_time"]) > 0.5:
        say(f"train.max_time {train_s:g}s (planned {p.settings['train.max_time']:g}s): preparing took "
            f"{actual['prepare']:.1f}s")
    extra = [f"{k}={json.dumps(v)}" for k, v in p.settings.items() if k != "train.max_time"]
    cfg = load_config(config, [*sets, *extra, f"train.max_time={train_s}"])
    info: dict[str, Any] = {"train.max_time": train_s, "actual": actual}
    try:
        trainer = Trainer(cfg, callbacks=[PlanFiles(p, info), DeadlineStop(deadline, eval_s + margin_s)])
        if trainer.run.val_loader is not None:
            trainer.run.val_loader = _EvalUntil(trainer.run.val_loader, deadline, margin_s)
        t_train = deadline.elapsed
        actual["setup"] = t_train - t_prepare - actual["prepare"]
        metrics = trainer.fit()
    except BaseException:
        abandon()
        raise
    actual["train and evaluate"] = deadline.elapsed - t_train
    actual["total"] = deadline.elapsed
    info["final"] = metrics
    from lmforge.utils.io import atomic_write_json

    atomic_write_json(Path(trainer.run_dir) / "plan.json", {**p.to_json(), **info})
    bpb = metrics.get("bpb") if metrics else None
    say(f"budget {budget:g}s: {actual['total']:.1f}s so far (prepare {actual['prepare']:.1f}s, train and "
        f"evaluate {actual['train and evaluate']:.1f}s)" + (f"; val bpb {bpb:.4f}" if bpb else "") +
        f"; run dir {trainer.run_dir}")
    shutdown()
    return metrics
