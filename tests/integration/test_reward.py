"""`lmforge reward` end to end on a tiny pretrained base and shipped task pairs: the score head trains
(with LoRA adapters or every weight), accuracy and margins are logged for training and validation,
per-pair margins from the records reach the loss, a crashed run resumes bit for bit, `eval` reports
the accuracy, and `export` writes a transformers ...ForSequenceClassification whose scores equal
lmforge's; bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data import data_dir
from lmforge.data.batch import IGNORE_INDEX
from lmforge.data.chat_loader import PreferenceLoader
from lmforge.data.instruct_tasks import pairs_of, split_disjoint, write_jsonl
from lmforge.data.sft import load_prepared_sft
from lmforge.engine.objectives.reward import sequence_scores
from lmforge.eval.open_run import load_run
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

STEPS = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("reward")
    base = tmp / "base"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=8", "checkpoint.every=0",
                                           "train.eval_every=0")))
    split = split_disjoint(None, 160, 40, seed=4)
    pairs = pairs_of(split.train, 4)
    for i, p in enumerate(pairs):  # TRL's optional per-pair margin, on some records
        if i % 3 == 0:
            p["margin"] = 0.5
    write_jsonl(pairs, tmp / "pairs.jsonl")
    write_jsonl(pairs_of(split.test, 4), tmp / "held_out.jsonl")
    return SimpleNamespace(tmp=tmp, base=base, pairs=tmp / "pairs.jsonl", held_out=tmp / "held_out.jsonl")


def overrides(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.init_from={w.base}", f"preference.data=[{w.pairs}]", f"preference.val_data=[{w.held_out}]",
        f"run.dir={run_dir}", f"train.max_steps={STEPS}", "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
        "train.precision=fp32", "train.threads=1", "train.log_every=1", "train.eval_every=2",
        "train.eval_batches=100", "checkpoint.every=2", "checkpoint.keep_last=3", "optim.lr=3e-3",
        "schedule.warmup_steps=1", "logging.progress=none", *extra,
    ]


def cli(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [a for o in overrides(w, run_dir, *extra) for a in ("--set", o)]



@pytest.mark.parametrize("method", ["lora", "full"])
def test_reward_model_trains_resumes_and_exports(world, tmp_path, method, capsys):
    extra = ("finetune.method=lora", "finetune.r=4", "finetune.alpha=8") if method == "lora" else ()
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(["reward", *cli(world, straight, *extra)]) == 0
    rows = read_metrics(straight / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert len(train_rows) == STEPS and all(0.0 <= r["accuracy"] <= 1.0 for r in train_rows)
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]  # the head (and adapters) learn
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4] and "val_accuracy" in val[-1] and "val_margin" in val[-1]

    config = load_config(None, overrides(world, crashed, "objective.name=reward", *extra))
    with pytest.raises(Crash):
        Trainer(config, callbacks=[CrashAt(3)]).fit()
    assert main(["reward", *cli(world, crashed, *extra), "--resume"]) == 0
    compared = ("step", "loss", "grad_norm", "lr", "accuracy", "margin", "val_loss", "val_accuracy")
    curve = lambda d: [{k: r[k] for k in compared if k in r} for r in read_metrics(d / "metrics.jsonl")]  # noqa: E731
    assert curve(straight) == curve(crashed)

    capsys.readouterr()
    assert main(["eval", str(straight)]) == 0
    assert "pairs): loss" in capsys.readouterr().out

    # export: a transformers sequence-classification model with lmforge's scores
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "hf"
    assert main(["export", str(straight), str(out)]) == 0
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["architectures"] == ["LlamaForSequenceClassification"] and hf_cfg["num_labels"] == 1
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    run = load_run(straight)
    data = load_prepared_sft(data_dir(run.cfg))
    loader = PreferenceLoader(data.split("val"), 128, 4, shuffle=False, pad_id=data.tokenizer.eos_id)
    batch = loader.next_batch()
    with torch.no_grad():
        ours = sequence_scores(run.model, batch.input_ids, batch.targets)
        pad = hf_cfg["pad_token_id"]
        ids = batch.input_ids.clone()
        last = (batch.targets != IGNORE_INDEX).long().cumsum(1).argmax(1) + 1  # each row's last token
        for r in range(ids.size(0)):
            ids[r, last[r] + 1 :] = pad
        mask = (torch.arange(ids.size(1))[None] <= last[:, None]).long()
        theirs = hf(input_ids=ids, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_bad_reward_input_exits_2(world, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}) + "\n")
    args = cli(world, tmp_path / "a", f"preference.data=[{bad}]", "preference.val_data=[]")
    assert main(["reward", *args]) == 2
    err = capsys.readouterr().err
    assert "no usable training pair" in err and "'margin'" in err
    assert main(["reward", *cli(world, tmp_path / "b", "train.loss_chunk_tokens=64")]) == 2
    assert "score head" in capsys.readouterr().err
