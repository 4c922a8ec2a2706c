"""`lmforge rl` end to end: a tiny pretrained base is fine-tuned briefly on a shipped task (so that
sampled answers are sometimes right), then trained with GRPO / RLOO on held-out prompts of that task.
Rewards and their validation (greedy exact match) are logged, the completions of a step come from
the weights before it, a crashed run resumes bit for bit (LoRA with the base as KL reference; full
fine-tuning with a frozen copy), `eval` reports the rewards, and bad input exits 2."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.instruct_tasks import generate, pairs_of, split_disjoint, write_jsonl
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

STEPS = 4
METHODS = {
    "lora-kl": ("finetune.method=lora", "finetune.r=4", "finetune.alpha=8", "rl.beta=0.05"),
    "full-kl": ("finetune.method=full", "rl.beta=0.05", "rl.loss_aggregation=seq-mean-token-mean"),
    "ppo-lora": ("finetune.method=lora", "finetune.r=4", "finetune.alpha=8", "rl.algorithm=ppo",
                 "rl.beta=0.05", "rl.group_size=2"),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("rl")
    base, sft = tmp / "base", tmp / "sft"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=8", "checkpoint.every=0",
                                           "train.eval_every=0")))
    write_jsonl(generate(["compare"], 400, seed=3), tmp / "sft.jsonl")
    sft_args = [f"model.init_from={base}", f"sft.data=[{tmp / 'sft.jsonl'}]", f"run.dir={sft}",
                "train.max_steps=60", "train.micro_batch_size=16", "train.seq_len=64", "optim.lr=5e-3",
                "schedule.warmup_steps=5", "train.eval_every=0", "checkpoint.every=0",
                "logging.progress=none", "train.threads=1", "sft.val_fraction=0"]
    assert main(["sft", *(a for o in sft_args for a in ("--set", o))]) == 0
    split = split_disjoint(["compare"], 120, 40, seed=9)
    write_jsonl(split.train, tmp / "prompts.jsonl")
    write_jsonl(split.test, tmp / "held_out.jsonl")
    return SimpleNamespace(tmp=tmp, sft=sft, prompts=tmp / "prompts.jsonl", held_out=tmp / "held_out.jsonl")


def overrides(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.init_from={w.sft}", f"rl.data=[{w.prompts}]", f"rl.val_data=[{w.held_out}]",
        "rl.group_size=4", "rl.max_new_tokens=6", "rl.temperature=1.0", f"run.dir={run_dir}",
        f"train.max_steps={STEPS}",
        "train.micro_batch_size=4", "train.grad_accum_steps=2", "train.seq_len=64", "train.precision=fp32",
        "train.threads=1", "train.log_every=1", "train.eval_every=2", "train.eval_batches=100",
        "checkpoint.every=2", "checkpoint.keep_last=3", "optim.lr=3e-3", "schedule.warmup_steps=1",
        "logging.progress=none", *extra,
    ]


def cli(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [a for o in overrides(w, run_dir, *extra) for a in ("--set", o)]



@pytest.mark.parametrize("method", sorted(METHODS))
def test_rl_runs_logs_rewards_and_resumes_bit_identically(world, tmp_path, method, capsys):
    extra = METHODS[method]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(["rl", *cli(world, straight, *extra)]) == 0
    rows = read_metrics(straight / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert len(train_rows) == STEPS
    # sampled answers are sometimes right and sometimes not: the groups carry a learning signal
    assert any(r["mixed_groups"] > 0 for r in train_rows)
    if "rl.algorithm=ppo" in extra:  # the value head learns the returns
        assert all(k in train_rows[-1] for k in ("value_loss", "value", "returns"))
    assert all(0.0 <= r["reward"] <= 1.0 and r["reward_exact_match"] == r["reward"] for r in train_rows)
    if "rl.algorithm=ppo" not in extra:  # grpo's k3 estimate is >= 0; ppo penalises (and logs) k1
        assert all(r["kl"] >= 0.0 for r in train_rows)
    assert train_rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert any(r["kl"] != 0 for r in train_rows[1:])  # the policy moved off its reference
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4] and 0.0 <= val[-1]["val_reward"] <= 1.0

    config = load_config(None, overrides(world, crashed, "objective.name=rl", *extra))
    with pytest.raises(Crash):
        Trainer(config, callbacks=[CrashAt(3)]).fit()
    assert main(["rl", *cli(world, crashed, *extra), "--resume"]) == 0
    compared = ("step", "loss", "grad_norm", "lr", "reward", "kl", "completion_tokens", "val_reward",
                "value_loss")
    curve = lambda d: [{k: r[k] for k in compared if k in r} for r in read_metrics(d / "metrics.jsonl")]  # noqa: E731
    assert curve(straight) == curve(crashed)

    capsys.readouterr()
    assert main(["eval", str(straight)]) == 0
    out = capsys.readouterr().out
    assert "reward_exact_match" in out
    evaluated = json.loads(next(straight.glob("eval_val_step_*.json")).read_text())
    assert evaluated["reward"] == pytest.approx(val[-1]["val_reward"], rel=1e-6)


def test_rloo_trains(world, tmp_path):
    run = tmp_path / "rloo"
    assert main(["rl", *cli(world, run, "rl.algorithm=rloo", "rl.beta=0.05", "finetune.method=lora",
                            "train.max_steps=2", "train.eval_every=0", "checkpoint.every=0")]) == 0
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_a_reward_model_scores_the_completions(world, tmp_path, capsys):
    """A reward model trained from the same SFT model (so the same tokenizer) is the RL reward."""
    rm = tmp_path / "rm"
    write_jsonl(pairs_of(generate(["compare"], 60, seed=5), 5), tmp_path / "pairs.jsonl")
    rm_args = [f"model.init_from={world.sft}", f"preference.data=[{tmp_path / 'pairs.jsonl'}]",
               "preference.val_fraction=0", f"run.dir={rm}", "train.max_steps=2", "train.micro_batch_size=4",
               "train.seq_len=64", "train.threads=1", "train.eval_every=0", "checkpoint.every=0",
               "logging.progress=none"]
    assert main(["reward", *(a for o in rm_args for a in ("--set", o))]) == 0
    run = tmp_path / "rl"
    assert main(["rl", *cli(world, run, "rl.rewards={reward_model: 1.0}", f"rl.reward_model={rm}",
                            "train.max_steps=2", "train.eval_every=0", "checkpoint.every=0")]) == 0
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2 and all(r["reward"] == pytest.approx(r["reward_reward_model"]) for r in rows)
    assert len({r["reward"] for r in rows}) == 2 and "reward_exact_match" not in rows[0]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "mine.txt").write_text("kept")  # refused before run.overwrite touches anything
    assert main(["rl", *cli(world, tmp_path / "x", "rl.rewards={reward_model: 1.0}",
                            f"rl.reward_model={world.sft}", "run.overwrite=true")]) == 2
    assert "not a reward model" in capsys.readouterr().err
    assert (tmp_path / "x" / "mine.txt").read_text() == "kept"


def test_bad_rl_input_exits_2(world, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(["rl", *cli(world, tmp_path / "a", f"rl.data=[{missing}]")]) == 2
    assert "rl data" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q"}) + "\n" + "not json\n")
    assert main(["rl", *cli(world, tmp_path / "b", f"rl.data=[{bad}]", "rl.val_data=[]")]) == 2
    err = capsys.readouterr().err
    assert "no usable training prompt" in err and "'answer'" in err
    assert main(["rl", *cli(world, tmp_path / "c", "rl.algorithm=rloo", "rl.scale_rewards=group")]) == 2
    assert "rl.scale_rewards=group" in capsys.readouterr().err
    assert main(["rl", *cli(world, tmp_path / "d", "rl.rewards={nope: 1.0}")]) == 2
    assert "rl.rewards" in capsys.readouterr().err
    assert main(["rl", *cli(world, tmp_path / "e", "train.loss_chunk_tokens=64")]) == 2
    assert "loss_chunk_tokens" in capsys.readouterr().err
