"""`lmforge train`: build the components from the config, then run the loop.

The loop (`Trainer.fit`) reads top to bottom: schedule -> step -> log -> validate -> checkpoint.
Everything with state (model, optimizer, loader, RNG, precision scaler, counters) is captured in
checkpoints, so a run killed at any point resumes onto the exact same loss curve.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path
from typing import Any

import torch

from lmforge.checkpoint.hf_io import apply_init_from, load_init_weights
from lmforge.checkpoint.manager import CheckpointManager, list_checkpoints
from lmforge.config.load import save_config
from lmforge.config.schema import Config
from lmforge.data import TokenLoader, prepare
from lmforge.errors import CheckpointError, CheckpointMismatchError, ConfigError, LmforgeError
from lmforge.eval.perplexity import evaluate_loss
from lmforge.metrics.console import Console
from lmforge.metrics.loggers import MetricsLogger, truncate_metrics
from lmforge.metrics.throughput import Throughput, measure_peak_flops, peak_memory_mib
from lmforge.models import build_model
from lmforge.models.flops import flops_per_token
from lmforge.optim.builder import build_optimizer
from lmforge.optim.schedule import make_schedule
from lmforge.parallel.api import parallelize
from lmforge.parallel.coord import any_rank, on_rank0, rank0_first
from lmforge.parallel.dims import ParallelDims
from lmforge.parallel.init import abandon, init_distributed, shutdown
from lmforge.parallel.world import World, resolve_device
from lmforge.train.averaging import build_averages
from lmforge.train.batch_ramp import BatchRamp
from lmforge.train.precision import Precision, resolve_precision
from lmforge.train.run_dir import mark_job, open_run_dir, restarted_job_owns
from lmforge.train.stability import EarlyStopping, NonFiniteGuard, SpikeDetector
from lmforge.train.state import capture_rng, restore_rng, seed_everything
from lmforge.train.step import IGNORE_INDEX, StepResult


class TrainingDiverged(LmforgeError):
    """The stability machinery gave up (too many non-finite steps or loss spikes); a checkpoint
    of the last good weights was saved."""

    exit_code = 3


class TrainingInterrupted(LmforgeError):
    """SIGINT/SIGTERM arrived; a checkpoint was saved at a step boundary."""

    def __init__(self, msg: str, signum: int) -> None:
        super().__init__(msg)
        self.exit_code = 128 + signum


def resolve_vocab_size(cfg: Config, tokenizer_vocab: int) -> int:
    """The model's vocabulary: the config's, or the tokenizer's rounded up to a multiple of 64
    (matmul-friendly; the extra rows are never targets)."""
    if cfg.model.vocab_size is None:
        return 64 * math.ceil(tokenizer_vocab / 64)
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab}); set it to at least {tokenizer_vocab} or leave it unset"
        )
    return cfg.model.vocab_size


def check_parallel_support(cfg: Config, dims: ParallelDims) -> None:
    """Refuse, before any work, training features whose maths a parallel layout would change."""
    sharded = dims.fsdp or dims.tp > 1
    problems = []
    if cfg.optim.name == "muon" and sharded:
        problems.append("optim.name=muon orthogonalises whole matrices, but parallel.dp_shard/tp shard them; "
                        "use DDP (parallel.dp_replicate) or another optimizer")
    if cfg.optim.name == "muon" and dims.pp > 1:
        problems.append("optim.name=muon finds its matrices in model.layers, which pipeline stages "
                        "(parallel.pp > 1) split; use DDP (parallel.dp_replicate) or another optimizer")
    if cfg.optim.name == "adamw8bit" and sharded:
        problems.append("optim.name=adamw8bit is not supported with sharded parameters "
                        "(parallel.dp_shard/tp); use parallel.zero=1 or DDP (parallel.dp_replicate)")
    if cfg.optim.name == "sophia" and dims.pp > 1:
        problems.append("optim.name=sophia estimates its Hessian with a whole-model forward, which a "
                        "pipeline (parallel.pp > 1) does not have")
    if cfg.optim.name == "sophia" and cfg.optim.hessian_estimator == "hutchinson" and dims.dp_size > 1:
        problems.append("optim.hessian_estimator=hutchinson's second backward bypasses the data-parallel "
                        "gradient reduction; use hessian_estimator=gnb")
    if cfg.train.batch_warmup_tokens and dims.pp > 1:
        problems.append("train.batch_warmup_tokens varies the micro-batches per step, but a pipeline "
                        "schedule (parallel.pp > 1) has a fixed number")
    if problems:
        raise ConfigError("this parallel layout cannot run the run as configured:\n  "
                          + "\n  ".join(problems))


class Trainer:
    """Owns the components of one training run."""

    def __init__(self, cfg: Config, resume: bool = False, console: Console | None = None) -> None:
        self.cfg = cfg
        self.world = World.from_env()
        self.console = console or Console(cfg.logging.progress, enabled=self.world.is_main)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.device = resolve_device(cfg.train.device, self.world)
        # A distributed job: join it (collective timeouts set), check the layout before any work.
        init_distributed(cfg.parallel.timeout_s, self.device, cfg.train.threads)
        self.dims = ParallelDims.resolve(cfg.parallel, self.world.world_size, cfg.model,
                                         cfg.train.grad_accum_steps)
        check_parallel_support(cfg, self.dims)
        if self.world.world_size > 1:
            self.dims.build_mesh(self.device.type)
        self.run_dir = Path(cfg.run.dir)
        # torchrun --max-restarts: a restarted job continues from the last checkpoint by itself, but
        # only a run this job started (a first attempt refused for a foreign run dir must stay refused).
        resume = resume or on_rank0(lambda: restarted_job_owns(self.run_dir))
        resuming = on_rank0(lambda: open_run_dir(self.run_dir, resume=resume, overwrite=cfg.run.overwrite,
                                                 say=self.console))
        if self.world.is_main:
            mark_job(self.run_dir)

        if cfg.model.init_from:
            apply_init_from(cfg, say=self.console)
        self.data = rank0_first(lambda: prepare(cfg, console=self.console.print))
        cfg.model.vocab_size = resolve_vocab_size(cfg, self.data.tokenizer.vocab_size)

        seed_everything(cfg.run.seed)  # the same seed on every rank: replicas start equal
        model = build_model(cfg.model, device=self.device)
        if not resuming:
            self._load_init_from(model)
        seq_len = cfg.seq_len
        precision = on_rank0(lambda: resolve_precision(cfg.train.precision, self.device, model,
                                                       cfg.train.micro_batch_size, seq_len,
                                                       cfg.model.vocab_size))
        self.precision = Precision(precision, self.device)
        # TP -> activation checkpointing -> compile -> FSDP/DDP, from outside the model.
        self.parallel = parallelize(model, cfg, self.dims, precision)
        self.model = self.parallel.model
        self.optimizer = self.parallel.wrap_optimizer(build_optimizer(self.model, cfg.optim))
        self.averages = build_averages(self.model, cfg.averaging)
        dp_rank, dp_size = self.dims.dp_rank, self.dims.dp_size
        self.ramp = BatchRamp(cfg, dp_size)
        self.lr_at = make_schedule(cfg.schedule, cfg.optim.lr, cfg.train.max_steps,
                                   self.ramp.total_tokens(cfg.train.max_steps))
        self.train_loader = TokenLoader(self.data.shards("train"), seq_len, cfg.train.micro_batch_size,
                                        seed=cfg.run.seed, rank=dp_rank, world_size=dp_size)
        # Every rank must run the same number of evaluation batches (their forwards are collective);
        # a pipeline splits each one into its micro-batches.
        val_rows = cfg.train.micro_batch_size * (self.dims.microbatches(cfg.train.grad_accum_steps)
                                                 if self.dims.pp > 1 else 1)
        # The same sequences as `eval_batches` micro-batches, whatever the rows per batch.
        self.eval_batches = max(1, math.ceil(cfg.train.eval_batches * cfg.train.micro_batch_size / val_rows))
        self.val_loader = TokenLoader(self.data.shards("val"), seq_len, val_rows,
                                      seed=cfg.run.seed, rank=dp_rank, world_size=dp_size, shuffle=False,
                                      drop_last=self.world.world_size > 1)
        self.token_bytes = torch.as_tensor(self.data.tokenizer.token_byte_lengths(), dtype=torch.long)
        self.ckpt = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last, self.world.rank,
                                      self.world.world_size)
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.lr_scale = 1.0  # lowered by spike recoveries (stability.spike_lr_factor)
        self.guard = NonFiniteGuard(cfg.stability.max_nonfinite)
        self.spikes = SpikeDetector(cfg.stability) if cfg.stability.spike_detection else None
        sc = cfg.stability
        self.early = EarlyStopping(sc.early_stopping_patience, sc.early_stopping_min_delta)
        self._last_val: tuple[int, dict[str, float]] | None = None
        self._spike = None
        if resuming:
            self._restore()
        if self.world.is_main:  # only now: a refused resume must leave the old run's config intact
            save_config(cfg, self.run_dir / "config.yaml")
        self.logger = MetricsLogger.for_run(self.run_dir, cfg.logging.tensorboard, self.world.is_main)
        self.flops_per_token = flops_per_token(cfg.model, cfg.seq_len)
        self.peak_flops = measure_peak_flops(self.device, self.precision.dtype)
        self._signal: int | None = None
        self._first_compiled_step = True
        self._last_saved_step = self.step if resuming else -1

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to `train.max_steps` (or an early stop); returns the final validation metrics."""
        tc = self.cfg.train
        n_params = sum(p.numel() for p in self.model.parameters())
        full = self.ramp.full * self.ramp.micro_tokens
        ramp = (f" (ramping from {self.ramp.start * self.ramp.micro_tokens:,} over "
                f"{self.ramp.ramp_tokens:,} tokens)" if self.ramp.ramp_tokens else "")
        self.console(f"model {n_params / 1e6:.2f}M params, {self.flops_per_token / 1e6:.1f} MFLOP/token, "
                     f"precision {self.precision.name}, device {self.device}, {full:,} tokens/step{ramp}")
        window, losses, norms = Throughput(), [], []
        old_handlers = self._install_signal_handlers()
        self.console.start(total=tc.max_steps, completed=self.step)
        try:
            while self.step < tc.max_steps:
                lr = self._set_lr()
                window.start()
                batches = [self._next_batch() for _ in range(self.ramp.micro_batches(self.tokens_seen))]
                log_now = (self.step + 1) % tc.log_every == 0 or self.step + 1 == tc.max_steps
                result = self._train_step(batches, group_stats=log_now and tc.log_group_stats)
                window.stop(result.tokens * self.dims.dp_size)
                if self._spike is not None and self._recover():
                    window, losses, norms = Throughput(), [], []  # the rolled-back steps do not count
                    continue  # the steps since the checkpoint are redone on new data
                self._account(result)
                losses.append(result.loss)
                norms.append(result.grad_norm)
                if log_now:
                    self._log_train(lr, losses, norms, window, result)
                    window, losses, norms = Throughput(), [], []
                else:
                    self.console.step(self.step)
                if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.max_steps:
                    self.validate()
                if self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0:
                    self.save()
                # Decide on the agreed flag only: a rank must never stop (and save) alone.
                if any_rank(self._signal is not None, self.device):
                    self._stop_on_signal()
                if self.early.should_stop:
                    self._event("early_stop", best_val_loss=self.early.best, best_step=self.early.best_step)
                    break
            if self.cfg.checkpoint.save_final and self._last_saved_step != self.step:
                self.save()  # before the final evaluation: a failure there loses no training
            evaluated_now = self._last_val is not None and self._last_val[0] == self.step
            final = self._last_val[1] if evaluated_now else self.validate()
        finally:
            self.console.stop()
            self._restore_signal_handlers(old_handlers)
            self.logger.close()
            self._plot()
        return final

    # -- pieces of the loop -------------------------------------------------------------------
    def _set_lr(self) -> float:
        """The schedule's lr for the coming step (times the spike-recovery scale); groups with their
        own peak (Muon's matrices) follow the same shape from their peak."""
        lr = self.lr_at(self.step, self.tokens_seen) * self.lr_scale
        for group in self.optimizer.param_groups:
            peak = group.get("peak_lr")
            group["lr"] = lr if peak is None else lr * peak / self.cfg.optim.lr
        return lr

    def _train_step(self, batches, group_stats: bool = False) -> StepResult:
        tc = self.cfg.train
        self._spike = None

        def run():
            return self.parallel.step(batches, self.optimizer, self.precision, tc.grad_clip,
                                      tc.grad_clip_value, group_stats, accept=self._accept_loss)

        if not (tc.compile and self._first_compiled_step):
            return run()
        self._first_compiled_step = False
        try:  # torch.compile works lazily: a missing C++ compiler or an unsupported op shows up here
            return run()
        except Exception as e:
            raise LmforgeError(f"train.compile=true failed on the first step ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}); set train.compile=false "
                               "to train without torch.compile") from e

    def _accept_loss(self, loss: float) -> bool:
        """Judge the step's loss before its update is applied: False keeps a spike out of the weights."""
        if self.spikes is None:
            return True
        self._spike = self.spikes.check(loss)
        return self._spike is None or self.cfg.stability.spike_action == "log"

    def _account(self, result: StepResult) -> None:
        """Counters, the non-finite guard and the weight averages after one step."""
        self.step += 1
        self.tokens_seen += result.tokens * self.dims.dp_size
        # With fp16 a gradient overflow is the loss scaler's business (it skips and lowers the scale);
        # only a non-finite loss counts then.
        grad_ok = self.precision.scaler is not None or math.isfinite(result.grad_norm)
        nonfinite = result.skipped and not (math.isfinite(result.loss) and grad_ok)
        self.skipped_steps += result.skipped
        if nonfinite:
            self._event("nonfinite", loss=result.loss, grad_norm=result.grad_norm,
                        consecutive=self.guard.consecutive + 1)
        if self.guard.observe(not nonfinite):
            path = self.save() if self._last_saved_step != self.step else self.ckpt.latest().path
            raise TrainingDiverged(
                f"{self.guard.consecutive} consecutive steps with NaN/Inf loss or gradients at step "
                f"{self.step} "
                f"(none was applied); checkpoint of the last good weights: {path}. Lower optim.lr, raise "
                "schedule warm-up, check the data, or use train.precision=bf16/fp32 instead of fp16; "
                "then continue with --resume"
            )
        if not result.skipped:
            for avg in self.averages.values():
                if avg.due(self.step):
                    avg.update(self.model)

    def _recover(self) -> bool:
        """Act on the loss spike the step just showed. True when the run rolled back."""
        sc, spike = self.cfg.stability, self._spike
        self._spike = None
        action = sc.spike_action
        latest = on_rank0(self.ckpt.latest) if action == "rollback" else None
        if action == "rollback" and latest is None:
            action = "skip"  # nothing to roll back to yet: at least keep this update out
        fields = {"loss": spike.loss, "median": spike.median, "z": spike.z, "action": action}
        if action == "log":
            self._event("loss_spike", step=self.step + 1, **fields)
            return False
        self.spikes.recoveries += 1
        if self.spikes.recoveries > sc.spike_max_recoveries:
            path = self.save() if self._last_saved_step != self.step else self.ckpt.latest().path
            raise TrainingDiverged(
                f"loss spike at step {self.step + 1} (loss {spike.loss:.4f}, trailing median "
                f"{spike.median:.4f}, robust z {spike.z:.1f}) after {sc.spike_max_recoveries} recoveries; "
                f"stopping. Checkpoint: {path}. Lower optim.lr or raise stability.spike_max_recoveries"
            )
        self.lr_scale *= sc.spike_lr_factor
        if action == "skip":
            self._event("loss_spike", step=self.step + 1, lr_scale=self.lr_scale, **fields)
            return False  # the step counts (its data is consumed) but its update was never applied
        spike_step = self.step + 1
        self._load_checkpoint(latest.path, full=False)
        if self.world.is_main:  # the discarded steps leave the record, as after a resume
            # The file is rewritten (temp + rename): reopen the logger on the new one.
            self.logger.close()
            truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
            self.logger = MetricsLogger.for_run(self.run_dir, self.cfg.logging.tensorboard, True)
        # Logged at the checkpoint's step so a later resume from it keeps the event.
        self._event("loss_spike", spike_step=spike_step, rolled_back_to=self.step, lr_scale=self.lr_scale,
                    redone_steps=spike_step - 1 - self.step, **fields)
        return True

    def _event(self, name: str, **fields) -> None:
        record = {"step": self.step, "event": name, **fields}
        self.logger.log(record)
        detail = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in record.items() if k not in ("event", "step"))
        self.console(f"[yellow]step {record['step']}: {name}: {detail}[/yellow]")

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.train_loader.next_batch()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _log_train(self, lr: float, losses: list[float], norms: list[float], window: Throughput,
                   last: StepResult) -> None:
        tps = window.tokens_per_s
        record = {
            "step": self.step,
            "loss": sum(losses) / len(losses),
            "lr": lr,
            "grad_norm": sum(norms) / len(norms),
            "tokens_per_s": tps,
            "mfu": self.flops_per_token * tps / (self.peak_flops * self.world.world_size),
            "peak_mem_mib": peak_memory_mib(self.device),
            "tokens_seen": self.tokens_seen,
        }
        if self.ramp.ramp_tokens:
            record["tokens_per_step"] = last.tokens * self.dims.dp_size
        if self.skipped_steps:
            record["skipped_steps"] = self.skipped_steps
        # Per-group detail of the window's last step (the console shows only the headline numbers).
        record.update({f"grad_norm/{k}": v for k, v in last.group_grad_norms.items()})
        record.update({f"update_ratio/{k}": v for k, v in last.update_ratios.items()})
        self.logger.log(record)
        self.console.log(record, self.cfg.train.max_steps)

    def validate(self) -> dict[str, float]:
        """Validation loss of the weights (and of their EMA/SWA averages); early stopping and the
        keep-best checkpoint follow the trained weights' loss."""
        out = self._val_loss()
        record = {"step": self.step, "val_loss": out["loss"], "val_ppl": out["ppl"]}
        if "bpb" in out:
            record["val_bpb"] = out["bpb"]
        if self.cfg.averaging.eval_averaged:
            for kind, avg in self.averages.items():
                if avg.n_averaged:
                    with avg.swapped_into(self.model):
                        record[f"val_loss_{kind}"] = self._val_loss()["loss"]
        self.logger.log(record)
        self.console(f"step {self.step}: val_loss {out['loss']:.4f}  val_ppl {out['ppl']:.2f}"
                     + (f"  val_bpb {out['bpb']:.4f}" if "bpb" in out else "")
                     + "".join(f"  {k} {record[k]:.4f}" for k in record if k.startswith("val_loss_")))
        self._last_val = (self.step, out)
        if self.early.observe(out["loss"], self.step) and self.cfg.checkpoint.keep_best:
            path = self.ckpt.save(self.step, self.model, self.optimizer, self.train_state(),
                                  self._average_tensors(), name="best")
            self.console(f"step {self.step}: best val_loss so far; saved {path}")
        return out

    def _val_loss(self) -> dict[str, float]:
        batches = self.val_loader.iter_eval_batches(self.eval_batches)
        if self.world.world_size == 1:
            # The eager model: a compiled one would recompile for the shorter last batch of the split.
            return evaluate_loss(self.model, batches, self.precision, self.token_bytes, self.device)
        # Distributed: each data-parallel rank evaluates its own batches; sums are taken over all.
        loss_sum, n_tokens, n_bytes = 0.0, 0, 0
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            s, n = self.parallel.loss_sum(x, y, self.precision)
            loss_sum, n_tokens = loss_sum + s, n_tokens + n
            n_bytes += self.parallel.comm.sum_count(int(self.token_bytes[y[y != IGNORE_INDEX].cpu()].sum()))
        loss = loss_sum / max(n_tokens, 1)
        return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": n_tokens,
                "bpb": loss_sum / math.log(2) / max(n_bytes, 1)}

    def train_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "loader": self.train_loader.state_dict(),
            "rng": capture_rng(),
            "precision": self.precision.state_dict(),
            "lr_scale": self.lr_scale,
            "guard": self.guard.state_dict(),
            "spikes": self.spikes.state_dict() if self.spikes else None,
            "early": self.early.state_dict(),
            "averages": {k: a.state_dict() for k, a in self.averages.items()},
        }

    def _average_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: a.tensors() for k, a in self.averages.items()}

    def save(self) -> Path:
        path = self.ckpt.save(self.step, self.model, self.optimizer, self.train_state(),
                              self._average_tensors())
        self._last_saved_step = self.step
        self.console(f"step {self.step}: saved checkpoint {path}")
        self._plot()
        return path

    def _restore(self) -> None:
        """Load the newest checkpoint that reads back whole; an unreadable one is reported and skipped."""
        for info in reversed(on_rank0(lambda: list_checkpoints(self.ckpt.root))):
            error = None
            try:
                self._load_checkpoint(info.path, full=True)
            except CheckpointMismatchError:
                raise
            except CheckpointError as e:
                error = e
            if not any_rank(error is not None, self.device):  # every rank must take the same one
                break
            reason = error or "unreadable on another rank"
            self.console(f"[yellow]skipping damaged checkpoint {info.path}: {reason}[/yellow]")
        else:
            self.console(f"[yellow]no usable checkpoint in {self.ckpt.root}: starting from step 0[/yellow]")
            if self.world.is_main:
                truncate_metrics(self.run_dir / "metrics.jsonl", 0)
            self._reinitialise()
            return
        if self.world.is_main:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.console(f"resumed from {info.path} (step {self.step})")

    def _load_checkpoint(self, path: Path, full: bool) -> None:
        """Weights, optimizer, averages and counters from `path`. `full` (resume) also restores the
        data position, RNG and stability state; a spike rollback (`full=False`) keeps them, so the
        data between the checkpoint and the spike is skipped and the recovery count survives."""
        state = self.ckpt.load(path, self.model, self.optimizer, self._average_tensors())
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.precision.load_state_dict(state["precision"])
        for kind, avg in self.averages.items():
            if kind in state["averages_loaded"]:
                avg.load_state_dict(state["averages"][kind])
            else:  # averaging turned on after this checkpoint was written: start the average here
                avg.reset(self.model)
        self._last_saved_step = self.step
        if not full:
            return
        self.train_loader.load_state_dict(state["loader"])
        restore_rng(state["rng"])
        self.lr_scale = state.get("lr_scale", 1.0)
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
            self.early.load_state_dict(state["early"])
        if self.spikes is not None and state.get("spikes"):
            self.spikes.load_state_dict(state["spikes"])

    def _reinitialise(self) -> None:
        """Undo what a failed partial load may have written: fresh weights and optimizer state."""
        seed_everything(self.cfg.run.seed)
        self.model.init_weights()
        self._load_init_from(self.model)
        self.optimizer.state.clear()

    def _load_init_from(self, model: torch.nn.Module) -> None:
        if self.cfg.model.init_from:
            load_init_weights(self.cfg.model.init_from, model)
            self.console(f"initialised the weights from {self.cfg.model.init_from}")

    # -- signals: a preempted job (SIGTERM) or Ctrl-C saves at the next step boundary ----------
    def _install_signal_handlers(self) -> dict[int, Any]:
        def handler(signum, frame):  # noqa: ARG001
            self._signal = signum

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return old

    def _restore_signal_handlers(self, old: dict[int, Any]) -> None:
        for sig, h in old.items():
            signal.signal(sig, h)

    def _stop_on_signal(self) -> None:
        signum = self._signal or signal.SIGTERM  # the signal may have reached another rank only
        path = self.save() if self._last_saved_step != self.step else self.ckpt.latest().path
        raise TrainingInterrupted(
            f"{signal.Signals(signum).name} at step {self.step}: checkpoint saved to {path}; "
            "continue with the same command plus --resume", signum,
        )

    def _plot(self) -> None:
        if not (self.world.is_main and self.cfg.logging.plot):
            return
        from lmforge.tools.plots import plot_curves

        plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png", title=self.cfg.run.name)


def train(cfg: Config, resume: bool = False) -> dict[str, Any]:
    """Train the model the config describes; returns the final validation metrics.

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
