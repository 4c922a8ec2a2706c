"""A fine-tuning run resumes from its own config.yaml, and starting from an adapter run says what fixes it.

The resolved config.yaml a run writes records what the run derived on top of model.init_from: a vocabulary
grown for the chat template's tokens (sft, dpo, reward, rl), the scalar head its objective adds (reward:
score, PPO: value). Read back to resume, those keys used to "contradict the weights" of the source. They
are now checked against what the run derives; stated otherwise, they are refused by name. (distill and
train runs, full or LoRA, resumed from their config.yaml before this fix too.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import CORPUS, TINY
from lmforge.cli import main
from lmforge.data.instruct_tasks import generate, pairs_of, write_jsonl
from lmforge.metrics.loggers import read_metrics

QUIET = ("data.dir=null", f"data.sources=[{CORPUS}]", "data.max_chars=null", "logging.progress=none",
         "logging.plot=false", "train.max_steps=2", "checkpoint.every=1", "train.eval_every=0")


def _args(run: Path, *pairs: str) -> list[str]:
    return ["-c", str(TINY), *(a for p in (f"run.dir={run}", *QUIET, *pairs) for a in ("--set", p))]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A pretrained base, chat and preference data, and a fully fine-tuned SFT model on top."""
    w = tmp_path_factory.mktemp("answers_resume")
    assert main(["train", *_args(w / "base")]) == 0
    write_jsonl(generate(["add", "sub"], 64, seed=1), w / "chat.jsonl")
    write_jsonl(pairs_of(generate(["add", "sub"], 64, seed=2), 2), w / "pairs.jsonl")
    chat = f"sft.data=[{w / 'chat.jsonl'}]"
    assert main(["sft", *_args(w / "sft", f"model.init_from={w / 'base'}", chat)]) == 0
    return w


METHODS = {  # verb and settings, from the SFT model (or the base, for sft itself)
    "sft-lora": ("sft", "base", "sft.data=[{w}/chat.jsonl]", "finetune.method=lora"),
    "sft-full": ("sft", "base", "sft.data=[{w}/chat.jsonl]"),
    "dpo-lora": ("dpo", "sft", "preference.data=[{w}/pairs.jsonl]", "finetune.method=lora"),
    "reward-full": ("reward", "sft", "preference.data=[{w}/pairs.jsonl]"),
    "rl-ppo-lora": ("rl", "sft", "rl.data=[{w}/chat.jsonl]", "rl.algorithm=ppo", "rl.group_size=2",
                    "rl.max_new_tokens=4", "train.micro_batch_size=4", "finetune.method=lora"),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_a_fine_tuning_run_resumes_from_its_own_config_yaml(world, tmp_path, name, capsys):
    verb, source, *pairs = METHODS[name]
    run = tmp_path / name
    assert main([verb, *_args(run, f"model.init_from={world / source}",
                              *(p.format(w=world) for p in pairs))]) == 0
    capsys.readouterr()
    assert main(["prepare", "-c", str(run / "config.yaml")]) == 0, capsys.readouterr().err
    assert main([verb, "-c", str(run / "config.yaml"), "--resume", "--set", "train.max_steps=3"]) == 0, \
        capsys.readouterr().err
    assert (run / "checkpoints" / "step_00000003").is_dir()
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r) == 3


def test_stated_derived_keys_are_checked_not_ignored(world, tmp_path, capsys):
    saved = world / "sft" / "config.yaml"  # vocab_size 576: the base's 512 grown for ChatML's tokens
    for pair, words in (("model.vocab_size=1024", "model.vocab_size=1024: this run's vocabulary is 576, "
                                                  "the source's 512 grown"),
                        ("model.score_head=true", "objective sft has no score head"),
                        ("model.value_head=true", "objective sft has no value head")):
        assert main(["sft", "-c", str(saved), "--set", f"run.dir={tmp_path / 'new'}", "--set", pair]) == 2
        assert words in capsys.readouterr().err, pair
        assert not (tmp_path / "new").exists(), pair  # nothing of the refused command is left
    # a pretraining run from init_from still may not contradict its source's vocabulary
    assert main(["train", *_args(tmp_path / "t", f"model.init_from={world / 'base'}",
                                 "model.vocab_size=1024")]) == 2
    assert "contradict the weights: model.vocab_size=1024" in capsys.readouterr().err


@pytest.mark.parametrize("verb, pair", [("dpo", "preference.data=[{w}/pairs.jsonl]"),
                                        ("sft", "sft.data=[{w}/chat.jsonl]"), ("train", "train.max_steps=2")])
def test_starting_from_an_adapter_run_says_to_merge_it_first(world, tmp_path, capsys, verb, pair):
    lora = world / "sft-lora-source"
    if not lora.is_dir():
        assert main(["sft", *_args(lora, f"model.init_from={world / 'base'}",
                                   f"sft.data=[{world / 'chat.jsonl'}]", "finetune.method=lora")]) == 0
    capsys.readouterr()
    assert main([verb, *_args(tmp_path / "new", f"model.init_from={lora}", pair.format(w=world))]) == 2
    err = capsys.readouterr().err
    assert f"model.init_from={lora} is a finetune.method=lora run" in err
    assert f"lmforge merge {lora} MERGED" in err and not (tmp_path / "new").exists()
    assert "different shape" not in err  # the old advice: resume with another model config
