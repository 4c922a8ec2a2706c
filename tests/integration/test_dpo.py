"""`lmforge dpo` end to end on a tiny pretrained base and the shipped task pairs: the first step's
loss is ln 2 (policy = reference), the reward metrics are logged for training and validation, `eval`
reports them, a crashed run resumes bit for bit (LoRA, with ChatML's new token rows training and
left out of the reference; full fine-tuning with a frozen copy as reference), and bad input exits 2."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.instruct_tasks import pairs_of, split_disjoint, unpaired_of, write_jsonl
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

STEPS = 6
METHODS = {
    "lora": ("finetune.method=lora", "finetune.r=4", "finetune.alpha=8"),
    "full": ("finetune.method=full",),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("dpo")
    base = tmp / "base"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=8", "checkpoint.every=0",
                                           "train.eval_every=0")))
    split = split_disjoint(None, 200, 40, seed=2)
    write_jsonl(pairs_of(split.train, 2), tmp / "pairs.jsonl")
    write_jsonl(pairs_of(split.test, 2), tmp / "held_out.jsonl")
    write_jsonl(unpaired_of(pairs_of(split.train, 2)), tmp / "unpaired.jsonl")
    write_jsonl(unpaired_of(pairs_of(split.test, 2)), tmp / "unpaired_held_out.jsonl")
    return SimpleNamespace(tmp=tmp, base=base, pairs=tmp / "pairs.jsonl", held_out=tmp / "held_out.jsonl",
                           unpaired=tmp / "unpaired.jsonl", unpaired_held_out=tmp / "unpaired_held_out.jsonl")


def overrides(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.init_from={w.base}", f"preference.data=[{w.pairs}]", f"preference.val_data=[{w.held_out}]",
        "preference.beta=0.2", f"run.dir={run_dir}", f"train.max_steps={STEPS}", "train.micro_batch_size=4",
        "train.grad_accum_steps=2", "train.precision=fp32", "train.threads=1", "train.log_every=1",
        "train.eval_every=3", "train.eval_batches=100", "checkpoint.every=3", "checkpoint.keep_last=3",
        "optim.lr=3e-3", "schedule.warmup_steps=1", "logging.progress=none", *extra,
    ]


def cli(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [a for o in overrides(w, run_dir, *extra) for a in ("--set", o)]



@pytest.mark.parametrize("method", sorted(METHODS))
def test_dpo_runs_logs_rewards_and_resumes_bit_identically(world, tmp_path, method, capsys):
    extra = METHODS[method]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(["dpo", *cli(world, straight, *extra)]) == 0
    rows = read_metrics(straight / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    # step 1: the policy is the reference (LoRA B = 0 / the copy of the same weights): ln 2 per pair
    assert train_rows[0]["loss"] == pytest.approx(math.log(2.0), rel=1e-6)
    assert train_rows[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert all(k in train_rows[-1] for k in ("reward_accuracy", "reward_margin", "logp_accuracy"))
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [3, 6] and "val_reward_accuracy" in val[-1]
    assert any(r["reward_margin"] != 0.0 for r in train_rows[1:])  # the policy moved off the reference

    config = load_config(None, overrides(world, crashed, "objective.name=dpo", *extra))
    with pytest.raises(Crash):
        Trainer(config, callbacks=[CrashAt(5)]).fit()
    assert main(["dpo", *cli(world, crashed, *extra), "--resume"]) == 0
    compared = ("step", "loss", "grad_norm", "lr", "val_loss", "reward_accuracy", "val_reward_accuracy")
    curve = lambda d: [{k: r[k] for k in compared if k in r} for r in read_metrics(d / "metrics.jsonl")]  # noqa: E731
    assert curve(straight) == curve(crashed)

    capsys.readouterr()
    assert main(["eval", str(straight)]) == 0
    out = capsys.readouterr().out
    assert "pairs): loss" in out and "reward_accuracy" in out and "ref_logp_accuracy" in out
    evaluated = json.loads(next(straight.glob("eval_val_step_*.json")).read_text())
    assert evaluated["loss"] == pytest.approx(val[-1]["val_loss"], rel=1e-6)


def test_simpo_needs_no_reference_and_orpo_trains(world, tmp_path):
    for loss in ("simpo", "orpo"):
        run = tmp_path / loss
        assert main(["dpo", *cli(world, run, "finetune.method=lora", f"preference.loss={loss}",
                                 "train.max_steps=2", "train.eval_every=0", "checkpoint.every=0")]) == 0
        rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
        assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_kto_on_unpaired_examples(world, tmp_path, capsys):
    """KTO: at step 1 policy = reference and z = 0, so every example's loss is 1 - sigmoid(0) = 0.5;
    the policy then moves off the reference (rewards and z leave 0); a crashed run resumes bit for bit."""
    extra = ("finetune.method=lora", "finetune.r=4", "finetune.alpha=8", "preference.loss=kto",
             f"preference.data=[{world.unpaired}]", f"preference.val_data=[{world.unpaired_held_out}]")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(["dpo", *cli(world, straight, *extra)]) == 0
    rows = read_metrics(straight / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert train_rows[0]["loss"] == pytest.approx(0.5, abs=1e-6) and train_rows[0]["kl"] == 0.0
    assert any(r["kl"] > 0 and r["reward_desirable"] != 0 for r in train_rows[2:])  # the policy moved
    assert "val_reward_desirable" in [r for r in rows if "val_loss" in r][-1]
    config = load_config(None, overrides(world, crashed, "objective.name=dpo", *extra))
    with pytest.raises(Crash):
        Trainer(config, callbacks=[CrashAt(5)]).fit()
    assert main(["dpo", *cli(world, crashed, *extra), "--resume"]) == 0
    compared = ("step", "loss", "grad_norm", "kl", "reward_desirable", "val_loss")
    curve = lambda d: [{k: r[k] for k in compared if k in r} for r in read_metrics(d / "metrics.jsonl")]  # noqa: E731
    assert curve(straight) == curve(crashed)
    capsys.readouterr()
    assert main(["eval", str(straight)]) == 0
    assert "reward_undesirable" in capsys.readouterr().out


def test_bad_preference_input_exits_2(world, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(["dpo", *cli(world, tmp_path / "a", f"preference.data=[{missing}]")]) == 2
    assert "preference data" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "a"}) + "\n")
    args = cli(world, tmp_path / "b", f"preference.data=[{bad}]", "preference.val_data=[]")
    assert main(["dpo", *args]) == 2
    err = capsys.readouterr().err
    assert "no usable training pair" in err and "same completion" in err
    assert main(["dpo", *cli(world, tmp_path / "c", "objective.name=sft")]) == 2
    assert "trains objective dpo" in capsys.readouterr().err
    assert main(["dpo", *cli(world, tmp_path / "d", "preference.loss=nope")]) == 2
    assert "preference.loss" in capsys.readouterr().err
    assert main(["dpo", *cli(world, tmp_path / "e", "preference.loss=kto")]) == 2  # pairs are not unpaired
    assert "needs 'label'" in capsys.readouterr().err


def test_precomputed_reference_log_probs_train_the_same_curve(world, tmp_path):
    """Full fine-tuning with the reference's log-probs computed ahead (the frozen copy freed before the
    first step) trains the curve of the reference computed each step, and resumes exactly (computing
    them again). A run that dies before its first checkpoint resumes as a new run."""
    extra = ("finetune.method=full", "train.max_steps=4")
    ahead, each = tmp_path / "ahead", tmp_path / "each"
    assert main(["dpo", *cli(world, ahead, *extra, "preference.precompute_reference=true")]) == 0
    assert main(["dpo", *cli(world, each, *extra)]) == 0
    keys = ("loss", "reward_margin", "val_loss", "val_reward_accuracy")
    rows = lambda d: [r for r in read_metrics(d / "metrics.jsonl") if "event" not in r]  # noqa: E731
    for a, b in zip(rows(ahead), rows(each), strict=True):
        for k in keys:
            if k in b:  # batch shapes differ (padding), so the reference sums may differ in the last bits
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a, b)
    config = load_config(None, overrides(world, tmp_path / "crashed", "objective.name=dpo", *extra,
                                         "preference.precompute_reference=true"))
    with pytest.raises(Crash):
        Trainer(config, callbacks=[CrashAt(4)]).fit()
    assert main(["dpo", *cli(world, tmp_path / "crashed", *extra, "preference.precompute_reference=true"),
                 "--resume"]) == 0
    compared = ("step", "loss", "grad_norm", "val_loss")
    curve = lambda d: [{k: r[k] for k in compared if k in r} for r in read_metrics(d / "metrics.jsonl")]  # noqa: E731
    assert curve(ahead) == curve(tmp_path / "crashed")
    # died at step 2, before the first checkpoint (step 3): --resume starts it afresh, same curve
    early = tmp_path / "early"
    with pytest.raises(Crash):
        Trainer(load_config(None, overrides(world, early, "objective.name=dpo", *extra,
                                            "preference.precompute_reference=true")),
                callbacks=[CrashAt(2)]).fit()
    assert main(["dpo", *cli(world, early, *extra, "preference.precompute_reference=true"), "--resume"]) == 0
    assert curve(early) == curve(ahead)
