"""The stability machinery on real tiny runs: a corrupted data window causes a loss spike that is
rolled back (ending lower than the unguarded run), non-finite steps are never applied and stop the
run after K, resume mid batch-ramp and mid schedule is exact, early stopping with keep-best, and
EMA/SWA weights that are logged, checkpointed, evaluated and exported."""

from __future__ import annotations

import math
import signal

import pytest
import torch

from lmforge.checkpoint.hf_io import export_hf
from lmforge.checkpoint.manager import load_states
from lmforge.cli import main
from lmforge.eval.open_run import evaluate, load_run
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, TrainingDiverged, TrainingInterrupted

COMPARED = ("step", "loss", "grad_norm", "lr", "val_loss", "tokens_seen", "tokens_per_step")


def corrupt_draws(trainer: Trainer, bad_steps: range) -> None:
    """Scramble the labels (a fixed permutation of the vocabulary) of the batches the loader hands
    out for steps `bad_steps` (counted in loader draws, so a rollback does not meet them again)."""
    perm = torch.randperm(trainer.cfg.model.vocab_size, generator=torch.Generator().manual_seed(0))
    orig, draws = trainer._next_batch, [0]

    def next_batch():
        x, y = orig()
        draws[0] += 1
        if (draws[0] - 1) // trainer.cfg.train.grad_accum_steps in bad_steps:
            y = perm[y]
        return x, y

    trainer._next_batch = next_batch


def events(run_dir, name=None):
    return [r for r in read_metrics(run_dir / "metrics.jsonl")
            if "event" in r and (name is None or r["event"] == name)]


SPIKE_RUN = ("train.max_steps=100", "train.log_every=5", "train.eval_every=0", "checkpoint.every=10",
             "train.eval_batches=8", "schedule.warmup_steps=10")


def test_corrupted_window_is_detected_rolled_back_and_ends_lower(tiny_cfg, tmp_path):
    # Checkpoints change no value of a run, and each save cost ~0.5-1 s here: the unguarded run saves
    # none, the guarded one only what it rolls back to (step 60's).
    unguarded = Trainer(tiny_cfg(*SPIKE_RUN, f"run.dir={tmp_path / 'unguarded'}", "checkpoint.every=0"))
    corrupt_draws(unguarded, range(60, 64))
    loss_unguarded = unguarded.fit()["loss"]

    guarded = Trainer(tiny_cfg(*SPIKE_RUN, f"run.dir={tmp_path / 'guarded'}", "checkpoint.every=30",
                               "stability.spike_detection=true"))
    corrupt_draws(guarded, range(60, 64))
    loss_guarded = guarded.fit()["loss"]

    spikes = events(tmp_path / "guarded", "loss_spike")
    # Each of the 4 bad batches is caught before its update and rolled back to step 60's checkpoint;
    # the event is recorded at the checkpoint's step (the discarded steps leave metrics.jsonl).
    assert len(spikes) == 4
    for e in spikes:
        assert e["action"] == "rollback" and e["rolled_back_to"] == 60 == e["step"] and e["spike_step"] == 61
        assert e["z"] > 6 and e["loss"] > e["median"] + 1.0
    train_steps = [r["step"] for r in read_metrics(tmp_path / "guarded" / "metrics.jsonl") if "loss" in r
                   and "event" not in r]
    assert train_steps == sorted(set(train_steps))  # no step logged twice
    assert not events(tmp_path / "unguarded")
    # Measured: unguarded 5.014, guarded 4.786 (a clean run: 4.787); the same with checkpoints every 10 steps.
    assert loss_guarded < loss_unguarded - 0.1
    assert guarded.step == 100 and guarded.spikes.recoveries == 4


def test_spike_skip_action_lowers_lr_and_gives_up_after_max(tiny_cfg, tmp_path):
    cfg = tiny_cfg(*SPIKE_RUN, "train.max_steps=70", "checkpoint.every=0", "stability.spike_detection=true",
                   "stability.spike_action=skip", "stability.spike_lr_factor=0.5",
                   "stability.spike_max_recoveries=3")
    t = Trainer(cfg)
    corrupt_draws(t, range(60, 64))
    with pytest.raises(TrainingDiverged, match="after 3 recoveries"):
        t.fit()
    spikes = events(tmp_path / "run", "loss_spike")
    assert [e["step"] for e in spikes] == [61, 62, 63]
    assert [e["lr_scale"] for e in spikes] == [0.5, 0.25, 0.125]
    assert (tmp_path / "run" / "checkpoints" / "step_00000063" / "meta.json").is_file()


def nan_at(trainer: Trainer, steps: set[int]) -> None:
    """Make the forward pass of the given optimizer steps (1-based) produce NaN logits."""
    def hook(module, args, out):
        return out * float("nan") if trainer.step + 1 in steps and module.training else out

    trainer.model.norm.register_forward_hook(hook)


def test_nonfinite_steps_are_skipped_and_the_run_goes_on(tiny_cfg, tmp_path):
    t = Trainer(tiny_cfg("train.max_steps=12", "checkpoint.every=0"))
    nan_at(t, {5, 6})
    t.fit()
    assert t.skipped_steps == 2 and t.guard.consecutive == 0
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    ev = events(tmp_path / "run", "nonfinite")
    assert [(e["step"], e["consecutive"]) for e in ev] == [(5, 1), (6, 2)]


def test_k_nonfinite_steps_in_a_row_stop_with_a_checkpoint(tiny_cfg, tmp_path):
    t = Trainer(tiny_cfg("train.max_steps=30", "checkpoint.every=0", "stability.max_nonfinite=3"))
    nan_at(t, set(range(8, 30)))
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    with pytest.raises(TrainingDiverged, match="3 consecutive steps with NaN/Inf"):
        t.fit()
    assert t.step == 10  # steps 8, 9, 10 were non-finite: the third stops the run
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000010"
    assert (ckpt / "meta.json").is_file()
    # The checkpoint holds the weights after step 7, the last applied update, all finite.
    model = load_run(ckpt).model
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def curve(run_dir):
    """The logged steps and evaluations (not events, nor the save-time records of checkpoints: a run cut
    by a signal saves one more checkpoint than the straight run)."""
    return [{k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir / "metrics.jsonl")
            if "event" not in r and "checkpoint_save_s" not in r]


# tokens in the slow tier: the same resume end to end again, with the schedule counted in tokens (which
# tests/unit/test_schedule.py and test_cli_schedule.py check in the default tier)
@pytest.mark.parametrize("unit", ["steps", pytest.param("tokens", marks=pytest.mark.slow)])
def test_resume_mid_batch_ramp_and_mid_schedule_is_exact(tiny_cfg, tmp_path, unit):
    ramp = ["train.max_steps=30", "train.grad_accum_steps=4", "train.batch_warmup_tokens=20000",
            "checkpoint.every=6", "train.eval_every=10", "stability.spike_detection=true",
            "averaging.ema=true", "averaging.ema_decay=0.9"]
    if unit == "tokens":
        ramp += ["schedule.unit=tokens", "schedule.warmup_steps=null", "schedule.warmup_tokens=6000"]
    straight = Trainer(tiny_cfg(*ramp, f"run.dir={tmp_path / 'straight'}"))
    straight.fit()
    per_step = [r["tokens_per_step"] for r in curve(tmp_path / "straight") if "loss" in r]
    assert per_step[0] == 512 and per_step[-1] == 2048 and sorted(per_step) == per_step
    assert len(set(per_step)) == 4  # 1, 2, 3, then 4 micro-batches of 8 x 64 tokens

    cut = Trainer(tiny_cfg(*ramp, f"run.dir={tmp_path / 'cut'}"))
    orig = cut._account

    def account(result):
        orig(result)
        if cut.step == 15:  # mid-ramp (2 micro-batches), between checkpoints 12 and 18
            cut._signal = signal.SIGTERM

    cut._account = account
    with pytest.raises(TrainingInterrupted):
        cut.fit()
    resumed = Trainer(tiny_cfg(*ramp, f"run.dir={tmp_path / 'cut'}"), resume=True)
    assert resumed.step == 15
    resumed.fit()
    assert curve(tmp_path / "cut") == curve(tmp_path / "straight")
    for a, b in zip(straight.averages["ema"].params.values(), resumed.averages["ema"].params.values()):
        assert torch.equal(a, b)


def test_early_stopping_and_keep_best(tiny_cfg, tmp_path):
    # min_delta so large that only the first evaluation counts as an improvement.
    cfg = tiny_cfg("train.max_steps=40", "train.eval_every=5", "checkpoint.every=0",
                   "checkpoint.keep_best=true",
                   "stability.early_stopping_patience=2", "stability.early_stopping_min_delta=100")
    t = Trainer(cfg)
    t.fit()
    assert t.step == 15
    stop = events(tmp_path / "run", "early_stop")
    assert len(stop) == 1 and stop[0]["step"] == 15 and stop[0]["best_step"] == 5
    best = tmp_path / "run" / "checkpoints" / "best"
    out = evaluate(best, ["eval.max_batches=2"], say=lambda *_: None)
    assert out["step"] == 5
    val = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [5, 10, 15]  # the stop's evaluation is not repeated
    assert (tmp_path / "run" / "checkpoints" / "step_00000015").is_dir()


def test_ema_and_swa_are_logged_saved_evaluated_and_exported(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.max_steps=20", "train.eval_every=10", "checkpoint.every=10", "averaging.ema=true",
                   "averaging.ema_decay=0.8", "averaging.swa=true", "averaging.swa_start=10",
                   "averaging.swa_every=2")
    t = Trainer(cfg)
    snapshots, orig = [], t._account

    def account(result):
        orig(result)
        snapshots.append({n: p.detach().clone() for n, p in t.model.named_parameters()})

    t._account = account
    t.fit()
    # SWA = plain mean of the weights after steps 10, 12, ..., 20; EMA = the recursion from step 1.
    names = list(snapshots[0])
    swa = {n: torch.stack([snapshots[s - 1][n] for s in range(10, 21, 2)]).mean(0) for n in names}
    ema = {n: snapshots[0][n].clone() for n in names}
    for snap in snapshots[1:]:
        for n in names:
            ema[n] = 0.8 * ema[n] + 0.2 * snap[n]
    for n in names:  # a few fp32 ulps: lerp rounds differently from a*x + b*y (exact vs torch: unit test)
        torch.testing.assert_close(t.averages["swa"].params[n], swa[n], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(t.averages["ema"].params[n], ema[n], rtol=1e-6, atol=1e-7)
    val = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    assert "val_loss_ema" in val[0] and "val_loss_swa" in val[0]
    assert val[-1]["val_loss_ema"] != val[-1]["val_loss"]

    run = tmp_path / "run"
    for kind in ("ema", "swa"):
        model = load_run(run, weights=kind).model
        for n, p in model.named_parameters():
            assert torch.equal(p, t.averages[kind].params[n])
        out = evaluate(run, ["eval.max_batches=2"], say=lambda *_: None, weights=kind)
        assert out["weights"] == kind and math.isfinite(out["loss"])
    assert main(["eval", str(run), "--weights", "swa", "--set", "eval.max_batches=2"]) == 0
    assert (run / "eval_val_step_00000020_swa.json").is_file()
    exported = export_hf(run, tmp_path / "hf_ema", weights="ema", say=lambda *_: None)
    from safetensors.torch import load_file

    tensors = load_file(exported / "model.safetensors")
    ema_embed = t.averages["ema"].params["tok_embeddings.weight"]
    assert torch.equal(tensors["model.embed_tokens.weight"], ema_embed)


def test_eval_of_missing_average_is_a_clear_error(tiny_cfg, tmp_path):
    Trainer(tiny_cfg("train.max_steps=3", "checkpoint.every=0")).fit()
    model = load_run(tmp_path / "run").model
    with pytest.raises(Exception, match="holds no ema weights.*averaging.ema=true"):
        load_states(tmp_path / "run" / "checkpoints" / "step_00000003", model, weights="ema")
