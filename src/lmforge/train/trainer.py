"""`lmforge train` and `lmforge.Trainer`: the training loop over the parts `build_run` assembles.

The loop (`Trainer.fit`) reads top to bottom: budget -> schedule -> step -> account -> callbacks ->
validate -> checkpoint. Everything with state is a Stateful part in `Trainer.states` (progress and lr
scale: train/state.py; the training clock, which owns train.max_time: train/clock.py; data loader, RNG,
precision scaler, stability guards, weight averages, stateful callbacks, the batches an objective trains
on again); the checkpoint manager saves and restores that dict without knowing its members, so a run
killed at any point resumes onto the exact same loss curve.

    trainer = lmforge.Trainer("configs/demo.yaml")                     # what `lmforge train` runs
    trainer = lmforge.Trainer(model=my_module, train_data=texts, eval_data=held_out,
                              tokenizer="tokenizer.json", config={"train": {"max_steps": 100}},
                              callbacks=[MyCallback()])
    final = trainer.fit()
    for epoch in trainer.train_epochs(): ...   # fit, one pass over the data at a time (train/epochs.py)

`optimizer=` takes a torch optimizer built over `model`'s parameters, or a factory lmforge calls with its
param groups; `param_groups=` takes the user's groups for the configured optimizer (optim/builder.py).
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.assembly import build_run
from lmforge.assembly.build import Documents
from lmforge.checkpoint.manager import CheckpointManager, list_checkpoints
from lmforge.config.load import as_config, save_config
from lmforge.config.schema import Config
from lmforge.data.length import pass_ended
from lmforge.engine.evaluate import evaluate_loss
from lmforge.engine.objectives import Objective
from lmforge.engine.step import StepResult, Verdict
from lmforge.errors import CheckpointError, CheckpointMismatchError, ConfigError, LmforgeError
from lmforge.metrics.console import Console
from lmforge.metrics.peak import PeakFlops
from lmforge.metrics.trackers import check_trackers
from lmforge.models.flops import adapter_flops_per_token, flops_per_token
from lmforge.optim.builder import GroupLayout, OptimizerFactory
from lmforge.parallel.coord import any_rank, max_over_ranks, on_rank0
from lmforge.parallel.process_group import abandon, shutdown
from lmforge.parallel.world import World
from lmforge.train.averaging import build_averages
from lmforge.train.callbacks import Callback, EarlyStopping, MetricsLogging, state_key
from lmforge.train.clock import Clock
from lmforge.train.epochs import train_epochs
from lmforge.train.monitor import Monitor
from lmforge.train.recovery import Recovery
from lmforge.train.sanity import check_sanity_supported, sanity_check
from lmforge.train.signals import (  # noqa: F401 (TrainingDiverged: re-exported where users import it)
    TrainingDiverged,
    TrainingInterrupted,
    install_handlers,
    restore_handlers,
)
from lmforge.train.stability import NonFiniteGuard, SpikeDetector
from lmforge.train.state import Control, Progress
from lmforge.utils.host_memory import keep_freed_memory
from lmforge.utils.rng import RNGState

# What a loss-spike rollback restores from the checkpoint; the data position, RNG, stability state and
# lr scale stay, so the data since the checkpoint is skipped and the recovery count survives. An
# objective's replay goes back too: the batches it keeps belong with the weights that sampled them.
_ROLLBACK_PARTS = ("progress", "precision", "averages", "replay")


class Trainer(Recovery):
    """Owns the parts of one training run and runs its loop; see the module docstring."""

    defer_steps: bool | None = None  # steps without host synchronisation (see _defer); None: not on a CPU

    def __init__(
        self,
        config: Config | str | Path | dict | None = None,
        *,
        model: nn.Module | None = None,
        train_data: Documents | None = None,
        eval_data: Documents | None = None,
        tokenizer: Any = None,
        objective: Objective | None = None,
        callbacks: Sequence[Callback] = (),
        resume: bool = False,
        console: Console | None = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        param_groups: list[dict] | None = None,
    ) -> None:
        cfg = as_config(config)
        self.console = console or Console(cfg.logging.progress, enabled=World.from_env().is_main)
        check_trackers(cfg)  # a missing tracker package is refused before the run dir is touched
        self._eval_tasks: list = []
        if cfg.train.eval_tasks:  # read and checked before the run dir is touched
            from lmforge.eval.harness import load_task_set
            from lmforge.eval.tasks import require_code_sandbox

            self._eval_tasks = load_task_set(cfg.train.eval_tasks)
            require_code_sandbox(self._eval_tasks, "os", "Training runs such code only in the sandbox: "
                                 "take these tasks out of train.eval_tasks and, if you trust the code, run "
                                 "`lmforge eval tasks RUN --tasks ... --unsafe-code-exec` on the trained run")
        self.run = build_run(cfg, "train", model=model, train_data=train_data, eval_data=eval_data,
                             tokenizer=tokenizer, objective=objective, resume=resume, say=self.console,
                             optimizer=optimizer, param_groups=param_groups)
        try:
            self._setup(callbacks)
        except BaseException:
            self.run.release(refused=True)  # a refused run leaves the run dir as it found it
            raise

    def _setup(self, callbacks: Sequence[Callback]) -> None:
        run = self.run
        self.cfg, self.world, self.device, self.dims = run.cfg, run.world, run.device, run.dims
        self.model, self.parallel = run.model, run.parallel
        self.optimizer, self.precision = run.optimizer, run.precision
        self.progress, self.control = Progress(), Control()
        budget = self.cfg.train.max_time  # the one read of train.max_time: the clock owns the budget
        # time is looked up here at each reading (not bound once), so a test can stand in a clock for it
        self.clock = Clock(budget, now=lambda: time.perf_counter(),
                           agree=max_over_ranks if budget is not None and self.world.world_size > 1 else None)
        sc = self.cfg.stability
        self.guard = NonFiniteGuard(sc.max_nonfinite)
        self.spikes = SpikeDetector(sc) if sc.spike_detection else None
        self.averages = build_averages(self.model, self.cfg.averaging)
        self.early = EarlyStopping(sc.early_stopping_patience, sc.early_stopping_min_delta,
                                   self.cfg.checkpoint.keep_best)
        if self._eval_tasks and (self.dims is not None and self.dims.pp > 1 or run.tokenizer is None):
            raise ConfigError("train.eval_tasks needs the run's tokenizer and a model whose forward gives "
                              "logits on every rank (not pipeline parallelism): unset train.eval_tasks and "
                              "run lmforge eval tasks --tasks on the checkpoints")
        check_sanity_supported(self.cfg)
        self.callbacks: list[Callback] = [MetricsLogging(), self.early, *callbacks]
        self.states: dict[str, Any] = {
            "progress": self.progress,
            "clock": self.clock,
            "control": self.control,
            "loader": run.train_loader,
            "rng": RNGState(),
            "precision": self.precision,
            "guard": self.guard,
            "averages": self.averages,
            "param_groups": GroupLayout(self.optimizer),
        }
        if self.spikes is not None:
            self.states["spikes"] = self.spikes
        self.replay = run.objective.replay  # batches the objective trains on again (rl.iterations)
        if self.replay is not None:
            self.states["replay"] = self.replay
        for cb in self.callbacks:
            if (key := state_key(cb)) is not None:
                self.states[key] = cb
        self.ckpt = CheckpointManager(run.run_dir, self.cfg.checkpoint.keep_last, self.world.rank,
                                      self.world.world_size)
        self.lr = 0.0
        self._last_result: StepResult | None = None
        self._unsettled: list[tuple[int, StepResult]] = []  # steps whose loss is still on the device
        self._last_val: tuple[int, dict[str, float]] | None = None
        self._last_saved_step = -1
        self._epoch_results: list[StepResult] | None = None  # the current epoch's steps, in train_epochs
        self._signal: int | None = None
        self._first_compiled_step = True
        if run.resumed:
            self._restore()
        # A resumed run that already reached train.max_steps (or spent train.max_time) has nothing to do
        # and changes nothing.
        self.complete = run.resumed and (self.step >= self.cfg.train.max_steps or self.clock.expired)
        if self.world.is_main and not self.complete:  # a refused resume leaves the old config intact
            save_config(self.cfg, run.run_dir / "config.yaml")
        n_params = sum(p.numel() for p in self.model.parameters())
        if run.custom_model:
            self.flops_per_token = 6 * n_params
        elif self.cfg.finetune.method != "full":  # a frozen base: no weight gradients but the adapters'
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            self.flops_per_token = adapter_flops_per_token(self.cfg.model, self.cfg.seq_len, trainable,
                                                           run.objective)  # T5: its rows' lengths
        else:
            self.flops_per_token = flops_per_token(self.cfg.model, self.cfg.seq_len, run.objective)
        # MFU's denominator: never undercut by a busy start-up (metrics/peak.py)
        self.peak = PeakFlops.for_device(self.device, self.precision.dtype, write=self.world.is_main,
                                         say=self.console)
        self.monitor = Monitor(self.cfg, self.model, self.parallel.comm, self.device, self.dims,
                               self.parallel.pipeline)
        self.last_save_seconds = 0.0

    # -- what callbacks read and ask ------------------------------------------------------------
    step = property(lambda self: self.progress.step)
    tokens_seen = property(lambda self: self.progress.tokens_seen)
    skipped_steps = property(lambda self: self.progress.skipped_steps)
    run_dir = property(lambda self: self.run.run_dir)

    @property
    def lr_scale(self) -> float:
        return self.control.lr_scale

    @lr_scale.setter
    def lr_scale(self, value: float) -> None:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"lr_scale must be a positive number, got {value}")
        self.control.lr_scale = float(value)

    def request_stop(self, event: str | None = None, **fields: Any) -> None:
        """End the run after the current step; `event` (with `fields`) is recorded in metrics.jsonl."""
        self.control.stop = (event, fields)

    def is_log_step(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step == self.cfg.train.max_steps

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to `train.max_steps`, the end of `train.max_time` or a stop request; returns the final
        metrics: step, train_loss (the last step's) and the final validation's loss, ppl, tokens, bpb."""
        final = None
        if self.complete:
            return self._completed()
        old_handlers = self._install_signal_handlers()
        self._emit("on_train_start")
        try:
            self._sanity_check()
            with keep_freed_memory(self.cfg.train.keep_host_memory):
                self._loop()
            final = self._finish()
        finally:
            restore_handlers(old_handlers)
            try:
                self._emit("on_train_end", final)
            finally:
                self._release()
        return final

    def train_epochs(self) -> Iterator[dict[str, Any]]:
        """`fit`, one pass over the training data at a time: a generator of epoch summaries that the
        caller may stop between epochs (a checkpoint is saved there); see train/epochs.py."""
        return train_epochs(self)

    def adjust_learning_rate(self, factor: float) -> float:
        """Multiply the lr by `factor` from the next step on, on top of the schedule and of earlier
        adjustments (and of the stability machinery's own lowering); the scale is saved with every
        checkpoint, so a resumed run keeps it. Returns the lr scale now in force."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                math.isfinite(factor) and factor > 0):
            raise ValueError(f"adjust_learning_rate: factor must be a positive finite number, got {factor!r}")
        self.lr_scale = self.lr_scale * factor
        return self.lr_scale

    def _finish(self) -> dict[str, Any]:
        """The end of a run: the final checkpoint, then the final validation; returns fit's metrics."""
        if self.cfg.checkpoint.save_final and self._last_saved_step != self.step:
            self.save()  # before the final evaluation: a failure there loses no training
        evaluated_now = self._last_val is not None and self._last_val[0] == self.step
        return {"step": self.step,
                "train_loss": self._last_result.loss if self._last_result is not None else math.nan,
                **(self._last_val[1] if evaluated_now else self.validate())}

    def _loop(self, until: Callable[[], bool] | None = None) -> bool:
        """Steps until train.max_steps, the end of train.max_time, a stop request or, when given, `until()`
        after a step; True when `until` ended it."""
        tc = self.cfg.train
        while self.step < tc.max_steps:
            if self._out_of_time():
                break
            self.clock.start()
            result = self._train_step()
            if result.verdict is not None and self._recover(result.verdict.finding):
                self.clock.stop()
                continue  # rolled back: the steps since the checkpoint are redone on new data
            self._account(result)
            self._emit("on_step_end", self.step, result)
            # before validation and checkpointing, which the budget does not count
            self.clock.stop()
            at_eval = tc.eval_every and self.step % tc.eval_every == 0
            if (at_eval or pass_ended(self.cfg, self.run.train_loader)) and self.step < tc.max_steps:
                self.validate()
            if self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0:
                self.save()
            # Decide on the agreed flag only: a rank must never stop (and save) alone.
            if any_rank(self._signal is not None):
                self._stop_on_signal()
            if self.control.stop is not None:
                event, fields = self.control.stop
                if event:
                    self._event(event, **fields)
                break
            if until is not None and until():
                self._settle()
                return True
        self._settle()
        return False

    def _sanity_check(self) -> None:
        if self.cfg.train.sanity_check != "none" and self.step == 0:  # a resumed run was checked at its start
            sanity_check(self)

    def _release(self) -> None:
        """The run dir is free for another process (the loop is over)."""
        self.run.release()

    def _completed(self) -> dict[str, Any]:
        """fit() of a resumed run that already reached train.max_steps or spent train.max_time: its recorded
        final metrics."""
        from lmforge.metrics.loggers import read_metrics

        tc = self.cfg.train
        if self.step >= tc.max_steps:
            self.console.warn(f"the run in {self.run_dir} is complete (step {self.step} of train.max_steps="
                              f"{tc.max_steps}); nothing to do. Raise train.max_steps to train on.")
        else:
            self.console.warn(f"the run in {self.run_dir} has spent its time budget ({self.clock.elapsed:.1f}"
                              f"s of train.max_time={self.clock.budget:g}s); nothing to do. Raise "
                              "train.max_time to train on.")
        records = read_metrics(self.run_dir / "metrics.jsonl")
        val = [r for r in records if r.get("step") == self.step and "val_loss" in r]
        train = [r["loss"] for r in records if "loss" in r and "event" not in r]
        out: dict[str, Any] = {"step": self.step, "train_loss": train[-1] if train else math.nan}
        if val:
            v = val[-1]
            out.update(loss=v["val_loss"], ppl=v["val_ppl"])
            if "val_bpb" in v:
                out["bpb"] = v["val_bpb"]
        self._release()
        return out

    # -- pieces of the loop -------------------------------------------------------------------
    def _out_of_time(self) -> bool:
        """train.max_time: stop before a step that, taking as long as the last one, would end past the
        budget (a budget never overruns by a step). Records the stop in metrics.jsonl."""
        clock = self.clock
        if not clock.expired:
            return False
        self._event("time_budget", train_seconds=round(clock.elapsed, 3), max_time=clock.budget,
                    tokens_seen=self.tokens_seen)
        self.console(f"train.max_time={clock.budget:g}s reached after {clock.elapsed:.1f}s of training "
                     f"(step {self.step}); saving and evaluating")
        return True

    def _train_step(self) -> StepResult:
        tc, run = self.cfg.train, self.run
        self.lr = run.schedule.apply(self.optimizer, self.step, self.tokens_seen, self.control.lr_scale,
                                     seconds=self.clock.elapsed)
        t0 = time.perf_counter()
        again = self.replay.take() if self.replay is not None else None
        if again is not None:
            batches = [b.to(self.device) for b in again]
        else:
            batches = [self._next_batch() for _ in range(run.ramp.micro_batches(self.tokens_seen))]
        self.monitor.batches(batches, time.perf_counter() - t0, self.step + 1)
        result = self._guard_compile(
            lambda: self.parallel.step(
                batches,
                self.optimizer,
                self.precision,
                grad_clip=tc.grad_clip,
                grad_clip_value=tc.grad_clip_value,
                group_stats=tc.log_group_stats and self.is_log_step(self.step + 1),
                judge=self._judge if self.spikes is not None else None,
                hooks=run.hooks,
                defer=self._defer(),
            )
        )
        result.seconds = time.perf_counter() - t0
        self._last_result = result
        return result

    def _guard_compile(self, step: Callable[[], StepResult]) -> StepResult:
        if not (self.cfg.train.compile and self._first_compiled_step):
            return step()
        self._first_compiled_step = False
        try:  # torch.compile works lazily: a missing C++ compiler or an unsupported op shows up here
            return step()
        except Exception as e:
            raise LmforgeError(f"train.compile=true failed on the first step ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}); set train.compile=false "
                               "to train without torch.compile") from e

    def _judge(self, loss: float) -> Verdict | None:
        """Rule on the step's loss before its update is applied: a spike stays out of the weights
        unless stability.spike_action is log."""
        spike = self.spikes.check(loss)
        return (
            None if spike is None else Verdict(apply=self.cfg.stability.spike_action == "log", finding=spike)
        )

    def _next_batch(self):
        batch = self.run.train_loader.next_batch()
        if self.device.type == "cuda" and hasattr(batch, "pin_memory"):
            # Page-locked, the copy below is asynchronous: with no synchronisation inside a step (see
            # _defer) the host prepares and sends the next batches while the GPU is still busy.
            batch = batch.pin_memory()
        return batch.to(self.device, non_blocking=True)

    def _defer(self) -> bool:
        """Whether the coming step may keep its loss and skip flag on the device (no host
        synchronisation): nothing reads them before the next log step. The spike guard judges every
        loss and the weight averages skip the steps that were not applied, so either needs them now.
        `defer_steps` None: on accelerators only (on a CPU a read costs nothing, and the optimizer's
        device-side skip costs a little: 1.20 vs 1.12 ms for a step of a tiny model)."""
        wanted = self.device.type != "cpu" if self.defer_steps is None else self.defer_steps
        return wanted and self.spikes is None and not self.averages and not self.is_log_step(self.step + 1)

    def _account(self, result: StepResult) -> None:
        """Counters after one step; the non-finite guard and the weight averages once its loss and skip
        flag are on the host (at once, or for a deferred step at the next `_settle`)."""
        self.progress.step += 1
        self.progress.tokens_seen += result.tokens
        self._unsettled.append((self.step, result))
        if self._epoch_results is not None:
            self._epoch_results.append(result)
        if result.settled:
            self._settle()

    def _settle(self) -> None:
        """Read the deferred steps' losses and skip flags (one device-to-host copy for all of them) and
        run the non-finite guard and the weight averages over every unsettled step, in order. Runs at
        log steps and before anything that saves or reports the run's state."""
        pending, self._unsettled = self._unsettled, []
        StepResult.settle_all([r for _, r in pending])
        for step, result in pending:
            self._judge_finite(step, result)

    def _event(self, name: str, **fields) -> None:
        self._emit("on_event", {"step": self.step, "event": name, **fields})

    def _emit(self, event: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(self, *args)

    def validate(self) -> dict[str, float]:
        """Validation loss of the weights (and of their EMA/SWA averages); {} without validation data.
        Early stopping and the keep-best checkpoint (callbacks) follow the trained weights' loss."""
        self._settle()
        if self.run.val_loader is None:
            return {}
        out = self._val_loss()
        record = {"step": self.step, "val_loss": out["loss"], "val_ppl": out["ppl"]}
        if "bpb" in out:
            record["val_bpb"] = out["bpb"]
        # the objective's own metrics (preference: reward accuracy and margins), means per target
        record.update({f"val_{k}": v for k, v in out.items() if k not in ("loss", "ppl", "tokens", "bpb")})
        record.update(self._task_scores())
        if self.cfg.averaging.eval_averaged:
            for kind, avg in self.averages.items():
                if avg.n_averaged:
                    with avg.swapped_into(self.model):
                        record[f"val_loss_{kind}"] = self._val_loss()["loss"]
        self._last_val = (self.step, out)
        self._emit("on_evaluate", record)
        return out

    def _task_scores(self) -> dict[str, float]:
        """train.eval_tasks: every task's metrics on the trained weights, as task/<task>/<metric>. Every
        rank scores the same documents (sharded layouts run their forwards together); rank 0 logs."""
        if not self._eval_tasks:
            return {}
        from lmforge.eval.scorer import Scorer
        from lmforge.eval.tasks import run_task

        scorer = Scorer(self.model, self.run.tokenizer, device=self.device, autocast=self.precision.autocast)
        out = {}
        for task in self._eval_tasks:
            result = run_task(task, scorer, limit=self.cfg.train.eval_tasks_limit, seed=self.cfg.run.seed)
            out.update({f"task/{task.name}/{k}": v for k, v in result.metrics.items()})
        return out

    def _val_loss(self) -> dict[str, float]:
        batches = self.run.val_loader.iter_eval_batches(self.run.eval_batches)
        return evaluate_loss(self.parallel, batches, self.run.objective, self.parallel.comm,
                             precision=self.precision, token_bytes=self.run.token_bytes, device=self.device)

    def save(self, name: str | None = None) -> Path:
        """A checkpoint of the run now (`name`, e.g. "best": outside the step sequence and its retention)."""
        self._settle()
        t0 = time.perf_counter()
        path = self.ckpt.save(
            self.step, self.model, self.optimizer, self.states, self.averages.tensors(), name=name
        )
        self.last_save_seconds = time.perf_counter() - t0
        if name is None:
            self._last_saved_step = self.step
        self._emit("on_save", path)
        return path

    def _save_now(self) -> Path:
        return self.save() if self._last_saved_step != self.step else self.ckpt.latest().path

    def _restore(self) -> None:
        """Load the newest checkpoint that reads back whole. Unreadable newer ones are moved aside to
        checkpoints/unreadable/ (never deleted, never overwritten by the resumed run); when none can
        be read the resume is refused with nothing changed."""
        ckpts = on_rank0(lambda: list_checkpoints(self.ckpt.root))
        failed: list[tuple[Path, str]] = []
        for info in reversed(ckpts):
            error = None
            try:
                self._load_checkpoint(info.path, full=True)
            except CheckpointMismatchError:
                raise
            except CheckpointError as e:
                error = e
            if not any_rank(error is not None):  # every rank must take the same one
                break
            failed.append((info.path, str(error or "unreadable on another rank")))
        else:
            if ckpts:
                detail = "; ".join(f"{p.name}: {why}" for p, why in failed)
                raise CheckpointError(
                    f"--resume: no checkpoint in {self.ckpt.root} could be read ({detail}); nothing was "
                    "changed. Restore a readable checkpoint, or start a new run (another run.dir)")
            # The assembly built the starting model as for a new run (nothing was loaded): train from step 0.
            self.console.warn(f"{self.ckpt.root} holds no checkpoint yet: starting the run from step 0")
            return
        if failed:
            moved = on_rank0(lambda: [str(self.ckpt.set_aside(p)) for p, _ in failed])
            for (p, why), to in zip(failed, moved):
                self.console.warn(f"checkpoint {p.name} is unreadable ({why}); moved it to {to}")
        self.console(f"resumed from {info.path} (step {self.step})")

    def _load_checkpoint(self, path: Path, full: bool) -> None:
        """Weights, optimizer and the run state from `path`: all of it on resume (`full`), what a
        spike rollback restores otherwise."""
        parts = self.states if full else {k: self.states[k] for k in _ROLLBACK_PARTS if k in self.states}
        loaded = self.ckpt.load(path, self.model, self.optimizer, parts, self.averages.tensors())
        if "progress" not in loaded.states:  # a checkpoint with weights only (an imported model)
            self.progress.step = loaded.step
        for kind, avg in self.averages.items():
            if kind not in loaded.averages:  # averaging turned on after this checkpoint: start it here
                avg.reset(self.model)
        self._last_saved_step = self.step

    # -- signals: a preempted job (SIGTERM) or Ctrl-C saves at the next step boundary (train/signals.py) --
    def _install_signal_handlers(self) -> dict[int, Any]:
        return install_handlers(lambda signum: setattr(self, "_signal", signum))

    def _stop_on_signal(self) -> None:
        signum = self._signal or signal.SIGTERM  # the signal may have reached another rank only
        raise TrainingInterrupted(
            f"{signal.Signals(signum).name} at step {self.step}: checkpoint saved to {self._save_now()}; "
            "continue with the same command plus --resume", signum,
        )


def train(cfg: Config, resume: bool = False) -> dict[str, Any]:
    """Train the model the config describes; returns the final metrics (see `Trainer.fit`).

    Under torchrun every rank calls this; the process group is joined in `Trainer` and left here."""
    t0 = time.perf_counter()
    try:
        trainer = Trainer(cfg, resume=resume)
        out = trainer.fit()
    except BaseException:
        abandon()
        raise
    trainer.console(f"done in {time.perf_counter() - t0:.0f}s; run dir {trainer.run_dir}")
    shutdown()
    return out
