"""What the training loop does when a step goes wrong: a non-finite loss or gradient (skip, count, stop
with a checkpoint after too many in a row) and a loss spike (log, skip the update, or roll back to the
latest checkpoint with a lower lr). A mixin of `Trainer`: it acts on the trainer's own parts."""

from __future__ import annotations

import math

from lmforge.engine.step import StepResult
from lmforge.parallel.coord import on_rank0
from lmforge.train.signals import TrainingDiverged
from lmforge.train.stability import Spike


class Recovery:
    """The non-finite guard's and the spike detector's actions, on `Trainer`'s state."""

    def _judge_finite(self, step: int, result: StepResult) -> None:
        # With fp16 a gradient overflow is the loss scaler's business (it skips and lowers the scale);
        # only a non-finite loss counts then.
        grad_ok = self.precision.scaler is not None or math.isfinite(result.grad_norm)
        nonfinite = result.skipped and not (math.isfinite(result.loss) and grad_ok)
        self.progress.skipped_steps += result.skipped
        if nonfinite:
            self._emit("on_event", {"step": step, "event": "nonfinite", "loss": result.loss,
                                    "grad_norm": result.grad_norm, "consecutive": self.guard.consecutive + 1})
        if self.guard.observe(not nonfinite):
            raise TrainingDiverged(
                f"{self.guard.consecutive} consecutive steps with NaN/Inf loss or gradients at step "
                f"{step} (none was applied); checkpoint of the last good weights: {self._save_now()}. "
                "Lower optim.lr, raise schedule warm-up, check the data, or use train.precision=bf16/fp32 "
                "instead of fp16; then continue with --resume"
            )
        if not result.skipped:
            for avg in self.averages.values():
                if avg.due(step):
                    avg.update(self.model)

    def _recover(self, spike: Spike) -> bool:
        """Act on the loss spike the step just showed. True when the run rolled back."""
        sc = self.cfg.stability
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
            raise TrainingDiverged(
                f"loss spike at step {self.step + 1} (loss {spike.loss:.4f}, trailing median "
                f"{spike.median:.4f}, robust z {spike.z:.1f}) after {sc.spike_max_recoveries} recoveries; "
                f"stopping. Checkpoint: {self._save_now()}. Lower optim.lr or raise "
                "stability.spike_max_recoveries"
            )
        self.control.lr_scale *= sc.spike_lr_factor
        if action == "skip":
            self._event("loss_spike", step=self.step + 1, lr_scale=self.lr_scale, **fields)
            return False  # the step counts (its data is consumed) but its update was never applied
        spike_step = self.step + 1
        self._load_checkpoint(latest.path, full=False)
        # Logged at the checkpoint's step so a later resume from it keeps the event.
        self._event("loss_spike", spike_step=spike_step, rolled_back_to=self.step, lr_scale=self.lr_scale,
                    redone_steps=spike_step - 1 - self.step, **fields)
        return True
