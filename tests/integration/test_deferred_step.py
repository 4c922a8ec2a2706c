"""Steps without a host synchronisation: between log steps a step with a fused AdamW keeps its loss,
gradient norm and skip flag on the device (the optimizer skips a non-finite update by itself through
its `found_inf`), and the trainer reads them all at the next log step. Checked here: no scalar is read
inside such a step, the weights and logged losses equal those of a run that reads every step, and
non-finite steps are still skipped, reported at their own step and stop the run after K in a row.
(The trainer defers on accelerators only; `Trainer.defer_steps = True` makes it defer on the CPU here.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.eval.open_run import load_run
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, TrainingDiverged

# Ops that copy a tensor's value to the host: float(t), int(t), t.item(), bool(t), t.tolist().
READS = {"_local_scalar_dense", "is_nonzero", "equal"}


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (an op's own kernel, such as the fused Adam
    reading its found_inf flag, is below the dispatcher and not seen: on a GPU it reads it on the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def defer_on_cpu(monkeypatch):
    monkeypatch.setattr(Trainer, "defer_steps", True)


def nan_at(trainer: Trainer, steps: set[int]) -> None:
    """NaN logits in the forward passes of the given optimizer steps (1-based)."""
    def hook(module, args, out):
        return out * float("nan") if trainer.step + 1 in steps and module.training else out

    trainer.model.norm.register_forward_hook(hook)


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r
            and "event" not in r]


def test_a_deferred_step_reads_nothing_on_the_host(tiny_cfg):
    t = Trainer(tiny_cfg("train.max_steps=4", "train.log_every=4", "checkpoint.every=0"))
    run = t.run
    batches = [t._next_batch() for _ in range(2)]
    assert all(b.n_targets == b.targets.numel() for b in batches)  # counted on the host, before the move
    run.parallel.step(batches, run.optimizer, run.precision, grad_clip=1.0)  # warm (lazy state init)
    with HostReads() as mode:
        result = run.parallel.step(batches, run.optimizer, run.precision, grad_clip=1.0, defer=True)
    assert not result.settled
    assert mode.reads == []
    with HostReads() as mode:
        loss, norm, skipped = result.loss, result.grad_norm, result.skipped
    assert result.settled and not skipped and loss > 0 and norm > 0
    with HostReads() as mode:
        immediate = run.parallel.step(batches, run.optimizer, run.precision, grad_clip=1.0)
    assert immediate.settled and len(mode.reads) >= 2  # the loss and the norm, read at once


def test_a_cpu_trainer_reads_every_step_by_default(tiny_cfg, monkeypatch):
    monkeypatch.setattr(Trainer, "defer_steps", None)
    t = Trainer(tiny_cfg("train.max_steps=4", "train.log_every=4"))
    assert t.device.type == "cpu" and not t._defer()
    t.run.release()


def test_deferred_run_equals_a_run_that_reads_every_step(tiny_cfg, tmp_path):
    every = Trainer(tiny_cfg("train.max_steps=12", "train.log_every=1", "checkpoint.every=0",
                             f"run.dir={tmp_path / 'every'}"))
    every.fit()
    deferred = Trainer(tiny_cfg("train.max_steps=12", "train.log_every=4", "checkpoint.every=0",
                                f"run.dir={tmp_path / 'deferred'}"))
    assert deferred._defer()  # step 1 is not a log step: it may defer
    deferred.fit()
    for (n, p), q in zip(every.model.named_parameters(), deferred.model.parameters()):
        assert torch.equal(p, q), n
    per_step = dict(losses(tmp_path / "every"))
    for step, loss in losses(tmp_path / "deferred"):
        window = [per_step[s] for s in range(step - 3, step + 1)]
        assert loss == pytest.approx(sum(window) / 4, rel=1e-12)


def test_deferred_nonfinite_steps_are_skipped_and_reported_at_their_step(tiny_cfg, tmp_path):
    runs = {}
    for log_every in (1, 4):
        t = Trainer(tiny_cfg("train.max_steps=12", f"train.log_every={log_every}", "checkpoint.every=0",
                             f"run.dir={tmp_path / str(log_every)}"))
        nan_at(t, {5, 6})
        t.fit()
        assert t.skipped_steps == 2 and t.guard.consecutive == 0
        records = read_metrics(tmp_path / str(log_every) / "metrics.jsonl")
        ev = [r for r in records if r.get("event") == "nonfinite"]
        assert [(e["step"], e["consecutive"]) for e in ev] == [(5, 1), (6, 2)]
        runs[log_every] = t
    for p, q in zip(runs[1].model.parameters(), runs[4].model.parameters()):
        assert torch.equal(p, q) and torch.isfinite(p).all()
    s1, s4 = runs[1].optimizer.state, runs[4].optimizer.state
    for p1, p4 in zip(runs[1].model.parameters(), runs[4].model.parameters()):
        assert torch.equal(s1[p1]["step"], s4[p4]["step"])  # skipped steps did not count
        assert torch.equal(s1[p1]["exp_avg_sq"], s4[p4]["exp_avg_sq"])


def test_k_deferred_nonfinite_steps_stop_the_run_at_the_next_log_step(tiny_cfg, tmp_path):
    t = Trainer(tiny_cfg("train.max_steps=30", "train.log_every=4", "checkpoint.every=0",
                         "stability.max_nonfinite=3"))
    nan_at(t, set(range(8, 30)))
    with pytest.raises(TrainingDiverged, match=r"3 consecutive steps with NaN/Inf .* at step 10 \("):
        t.fit()
    assert t.step == 12  # read at log step 12: steps 8, 9, 10 were the first three in a row
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000012"
    model = load_run(ckpt).model  # the weights after step 7, the last applied update
    assert all(torch.isfinite(p).all() for p in model.parameters())
