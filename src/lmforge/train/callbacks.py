"""Callbacks: the training loop's events, and the built-in callbacks that log metrics and stop early.

    class PrintLoss(lmforge.Callback):
        def on_step_end(self, trainer, step, result):
            if result.loss > 10:
                trainer.lr_scale *= 0.5          # from the next step on
        def on_evaluate(self, trainer, metrics):
            if metrics["val_loss"] < 2.0:
                trainer.request_stop("good_enough", val_loss=metrics["val_loss"])

Every event gets the Trainer first. Requests go through it: `trainer.request_stop(event, **fields)`
ends the run after the current step (the event is recorded in metrics.jsonl; a final checkpoint and
evaluation follow as at the end of a run), and `trainer.lr_scale` multiplies every group's scheduled
lr. A callback with `state_dict()` / `load_state_dict()` is saved in every checkpoint under its
`state_key` (default: its class name) and restored on resume.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.config.methods import method_facts
from lmforge.engine.step import StepResult
from lmforge.metrics.loggers import MetricsLogger, truncate_metrics
from lmforge.metrics.throughput import Throughput, peak_memory_mib
from lmforge.metrics.trackers import Trackers

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


class Callback:
    """Base class: override the events you need; each default does nothing."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Before the first step (after a resume: before the first step still to do)."""

    def on_step_end(self, trainer: Trainer, step: int, result: StepResult) -> None:
        """After optimizer step `step` (1-based; `result.skipped` when no update was applied)."""

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After a validation: `metrics` holds step, val_loss, val_ppl, val_bpb and val_loss_<average>."""

    def on_save(self, trainer: Trainer, path: Path) -> None:
        """After a checkpoint was written to `path`."""

    def on_event(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """After something notable happened: record = {step, event, ...} (nonfinite, loss_spike, a stop)."""

    def on_train_end(self, trainer: Trainer, metrics: dict[str, float] | None) -> None:
        """When the loop ends: `metrics` are fit()'s final metrics, None when it ended with an error."""




class MetricsLogging(Callback):
    """metrics.jsonl (and TensorBoard, MLflow, W&B), the console and curves.png: train records at log
    steps (loss and grad norm averaged over the window, lr, tokens/s, MFU, memory), validation records,
    events. A rollback truncates metrics.jsonl to the checkpoint, so no step is logged twice."""

    def __init__(self) -> None:
        self.logger: MetricsLogger | None = None
        self.trackers: Trackers | None = None
        self._reset()

    def _reset(self) -> None:
        self.window, self.results = Throughput(), []

    def _open(self, trainer: Trainer) -> None:
        self.logger = MetricsLogger.for_run(
            trainer.run_dir, trainer.cfg.logging.tensorboard, trainer.world.is_main, self.trackers
        )

    def on_train_start(self, trainer: Trainer) -> None:
        if trainer.run.resumed and trainer.world.is_main:  # the steps after the checkpoint are redone
            truncate_metrics(trainer.run_dir / "metrics.jsonl", trainer.step)
        self.trackers = Trackers.open(trainer.cfg, trainer.run_dir, resumed=trainer.run.resumed,
                                      is_main=trainer.world.is_main, say=trainer.console.warn)
        self._open(trainer)
        run, tc = trainer.run, trainer.cfg.train
        n_params = sum(p.numel() for p in trainer.model.parameters())
        full = run.ramp.full * run.ramp.micro_tokens
        ramp = (f" (ramping from {run.ramp.start * run.ramp.micro_tokens:,} over "
                f"{run.ramp.ramp_tokens:,} tokens)" if run.ramp.ramp_tokens else "")
        trainer.console(
            f"model {n_params / 1e6:.2f}M params, {trainer.flops_per_token / 1e6:.1f} MFLOP/token, "
            f"precision {run.precision.name}, device {run.device}, {full:,} tokens/step{ramp}; MFU against "
            f"{trainer.peak.flops / 1e12:.3g} TFLOP/s ({trainer.peak.source})"
        )
        trainer.console.start(total=tc.max_steps, completed=trainer.step)

    def on_step_end(self, trainer: Trainer, step: int, result: StepResult) -> None:
        self.window.seconds += result.seconds
        self.window.tokens += result.tokens
        self.results.append(result)  # read at the log step: a deferred step's loss is still on the device
        if not trainer.is_log_step(step):
            trainer.console.step(step)
            return
        tps = self.window.tokens_per_s
        record = {
            "step": step,
            "loss": sum(r.loss for r in self.results) / len(self.results),
            "lr": trainer.lr,
            "grad_norm": sum(r.grad_norm for r in self.results) / len(self.results),
            "tokens_per_s": tps,
            "mfu": trainer.peak.mfu(trainer.flops_per_token * tps / trainer.world.world_size),
            "peak_mem_mib": peak_memory_mib(trainer.device),
            "tokens_seen": trainer.tokens_seen,
        }
        if trainer.run.ramp.ramp_tokens:
            record["tokens_per_step"] = result.tokens
        if trainer.skipped_steps:
            record["skipped_steps"] = trainer.skipped_steps
        record.update(trainer.monitor.collect(tps))
        mix = getattr(trainer.run.train_loader, "metrics", None)  # a weighted mixture's per-source counts
        if mix is not None:
            record.update(mix())
        record.update(result.metrics)
        # Per-group detail of the window's last step (the console shows only the headline numbers).
        record.update({f"grad_norm/{k}": v for k, v in result.group_grad_norms.items()})
        record.update({f"update_ratio/{k}": v for k, v in result.update_ratios.items()})
        self.logger.log(record)
        left = trainer.clock.remaining  # the one clock owns train.max_time
        if left is None:  # a console of the user's own (lmforge.Trainer(console=...)) may take no more
            trainer.console.log(record, trainer.cfg.train.max_steps)
        else:
            trainer.console.log(record, trainer.cfg.train.max_steps, budget_left=left)
        self._reset()

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.logger.log(metrics)
        trainer.console(
            f"step {metrics['step']}: val_loss {metrics['val_loss']:.4f}"
            # perplexity means something for token losses only (not pairs, scores or policy gradients)
            + (f"  val_ppl {metrics['val_ppl']:.2f}" if method_facts(trainer.cfg).token_loss else "")
            + (f"  val_bpb {metrics['val_bpb']:.4f}" if "val_bpb" in metrics else "")
            + "".join(f"  {k} {v:.4f}" for k, v in metrics.items()
                      if k.startswith(("val_loss_", "val_reward", "val_accuracy")))
        )

    def on_save(self, trainer: Trainer, path: Path) -> None:
        if trainer.cfg.logging.monitor.checkpoint_time:
            self.logger.log({"step": trainer.step, "checkpoint_save_s": trainer.last_save_seconds})
        trainer.console(f"step {trainer.step}: saved checkpoint {path}")
        self._plot(trainer)

    def on_event(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if "rolled_back_to" in record:
            self._reset()  # the rolled-back steps do not count
            if trainer.world.is_main:  # the discarded steps leave the record, as after a resume
                # The file is rewritten (temp + rename): reopen the logger on the new one.
                self.logger.close()
                truncate_metrics(trainer.run_dir / "metrics.jsonl", record["step"])
                self._open(trainer)
        self.logger.log(record)
        detail = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in record.items() if k not in ("event", "step"))
        trainer.console(f"[yellow]step {record['step']}: {record['event']}: {detail}[/yellow]")

    def on_train_end(self, trainer: Trainer, metrics: dict[str, float] | None) -> None:
        trainer.console.stop()
        if self.logger is not None:
            self.logger.close()
        self._plot(trainer)
        if self.trackers is not None:  # after the plot: curves.png is one of the final artifacts
            latest = trainer.ckpt.latest() if self.trackers.trackers else None
            self.trackers.finish(latest.path if latest else None, ok=metrics is not None)

    def _plot(self, trainer: Trainer) -> None:
        if not (trainer.world.is_main and trainer.cfg.logging.plot):
            return
        from lmforge.metrics.curves import plot_curves

        plot_curves(
            trainer.run_dir / "metrics.jsonl", trainer.run_dir / "curves.png", title=trainer.cfg.run.name
        )


class EarlyStopping(Callback):
    """Tracks the best validation loss; stops the run when `patience` evaluations brought no
    improvement of at least `min_delta` (patience 0: never), and with `keep_best` saves the best
    weights to checkpoints/best. Stateful: a resumed run judges exactly as the uninterrupted one."""

    state_key = "early"

    def __init__(self, patience: int = 0, min_delta: float = 0.0, keep_best: bool = False) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.keep_best = keep_best
        self.best = math.inf
        self.best_step = -1
        self.bad_evals = 0

    def observe(self, val_loss: float, step: int) -> bool:
        """Record one evaluation; True when it is the best so far."""
        if val_loss < self.best - self.min_delta:
            self.best, self.best_step, self.bad_evals = val_loss, step, 0
            return True
        self.bad_evals += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_evals >= self.patience

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self.observe(metrics["val_loss"], metrics["step"]) and self.keep_best:
            trainer.save(name="best")
        if self.should_stop:
            trainer.request_stop("early_stop", best_val_loss=self.best, best_step=self.best_step)

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals}

    def load_state_dict(self, sd: dict) -> None:
        self.best, self.best_step = float(sd["best"]), int(sd["best_step"])
        self.bad_evals = int(sd["bad_evals"])


def state_key(callback: Callback) -> str | None:
    """Where a Stateful callback's state goes in a checkpoint; None for a stateless one."""
    if not (hasattr(callback, "state_dict") and hasattr(callback, "load_state_dict")):
        return None
    return getattr(callback, "state_key", None) or type(callback).__name__
