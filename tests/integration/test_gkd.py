"""`lmforge gkd` end to end: a tiny pretrained base fine-tuned briefly by `lmforge sft` is the teacher;
students start from the base and learn it on chat data, off-policy (gkd.lmbda=0, full fine-tuning: the
data's completions; the validation loss falls) and on-policy (gkd.lmbda=1, LoRA: every step on the
student's own samples), write checkpoints, evaluate with `lmforge eval loss`, export as any fine-tuned
run, and a crashed run with lmbda=0.5 resumes to the uninterrupted run bit for bit (the same steps drawn
on-policy, the same samples). A teacher with another tokenizer, or none, is refused with exit status 2."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.instruct_tasks import split_disjoint, write_jsonl
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

STEPS = 6


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("gkd")
    base, teacher = tmp / "base", tmp / "teacher"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=8", "checkpoint.every=0",
                                           "train.eval_every=0")))
    split = split_disjoint(None, 200, 24, seed=0)
    write_jsonl(split.train, tmp / "chat.jsonl")
    write_jsonl(split.test, tmp / "held_out.jsonl")
    sft = [f"model.init_from={base}", f"sft.data=[{tmp / 'chat.jsonl'}]", f"run.dir={teacher}",
           "train.max_steps=20", "train.micro_batch_size=8", "optim.lr=3e-3", "schedule.warmup_steps=2",
           "train.eval_every=0", "checkpoint.every=0", "logging.progress=none", "train.threads=1",
           "sft.val_fraction=0"]
    assert main(["sft", *(a for o in sft for a in ("--set", o))]) == 0
    return SimpleNamespace(tmp=tmp, base=base, teacher=teacher, chat=tmp / "chat.jsonl",
                           held_out=tmp / "held_out.jsonl")


def overrides(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.init_from={w.base}", f"gkd.teacher={w.teacher}", f"sft.data=[{w.chat}]",
        f"sft.val_data=[{w.held_out}]", f"run.dir={run_dir}", f"train.max_steps={STEPS}",
        "train.micro_batch_size=4", "train.grad_accum_steps=2", "train.precision=fp32", "train.threads=1",
        "train.log_every=1", "train.eval_every=3", "train.eval_batches=100", "checkpoint.every=3",
        "checkpoint.keep_last=3", "optim.lr=3e-3", "schedule.warmup_steps=1", "gkd.max_new_tokens=8",
        "logging.progress=none", *extra,
    ]


def cli(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [a for o in overrides(w, run_dir, *extra) for a in ("--set", o)]


# full fine-tuning off-policy; LoRA on-policy (sampling folds the adapters in and restores them exactly)
CASES = {"full-0": (0.0, ()), "lora-1": (1.0, ("finetune.method=lora", "finetune.r=4", "finetune.alpha=8"))}


# lora-1 in the slow tier: on-policy sampling runs in the default tier through the resume test (lmbda 0.5)
@pytest.mark.parametrize("case", ["full-0", pytest.param("lora-1", marks=pytest.mark.slow)])
def test_gkd_trains_evaluates_and_exports(world, tmp_path, capsys, case):
    lmbda, extra = CASES[case]
    run = tmp_path / "run"
    assert main(["gkd", *cli(world, run, f"gkd.lmbda={lmbda}", *extra)]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_00000003", "step_00000006"]
    rows = read_metrics(run / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r and "event" not in r]
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and r["loss"] >= 0 and math.isfinite(r["ce"]) for r in train_rows)
    assert all(r["on_policy"] == lmbda for r in train_rows)  # 0: never sampled, 1: every micro-batch
    assert [r["step"] for r in val] == [3, 6] and all("val_ppl" in r for r in val)
    if lmbda == 0.0:  # learning the teacher on the data's completions: the held-out divergence falls
        assert val[1]["val_loss"] < val[0]["val_loss"]
    capsys.readouterr()

    assert main(["eval", "loss", str(run)]) == 0
    evaluated = json.loads((run / "eval_val_step_00000006.json").read_text())
    assert evaluated["loss"] == pytest.approx(val[1]["val_loss"], abs=1e-6)
    assert evaluated["ppl"] == pytest.approx(val[1]["val_ppl"], rel=1e-5)

    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "tokenizer.json").exists()


@pytest.mark.slow  # 6 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_a_crashed_run_resumes_bit_identically(world, tmp_path):
    extra = ("gkd.lmbda=0.5", "gkd.beta=0.3", "gkd.temperature=1.2")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(["gkd", *cli(world, straight, *extra)]) == 0
    config = load_config(None, overrides(world, crashed, "objective.name=gkd", *extra))
    with pytest.raises(Crash):
        Trainer(config, callbacks=[CrashAt(5)]).fit()
    assert main(["gkd", *cli(world, crashed, *extra), "--resume"]) == 0
    compared = ("step", "loss", "ce", "on_policy", "grad_norm", "lr", "val_loss", "tokens_seen")
    curve = lambda d: [{k: r[k] for k in compared if k in r} for r in read_metrics(d / "metrics.jsonl")]  # noqa: E731
    assert curve(straight) == curve(crashed)
    # lmbda 0.5 over 12 micro-batches: some steps trained on samples, some on the data
    assert 0.0 < sum(r["on_policy"] for r in curve(straight) if "on_policy" in r) < STEPS


@pytest.mark.parametrize("case", ["other tokenizer", "no teacher", "missing teacher"])
def test_bad_teachers_exit_2(world, tmp_path, capsys, case):
    teacher = {"other tokenizer": f"gkd.teacher={world.base}",  # the base lacks the chat template's tokens
               "no teacher": "gkd.teacher=null", "missing teacher": f"gkd.teacher={tmp_path / 'nope'}"}[case]
    run = tmp_path / "run"
    assert main(["gkd", *cli(world, run, teacher)]) == 2
    err = capsys.readouterr().err
    assert "gkd.teacher" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("lmforge gkd: error:")
