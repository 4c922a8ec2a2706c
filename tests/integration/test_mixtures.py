"""A weighted data.sources mixture end to end: prepared per source, the logged per-source tokens add up
and follow the weights, a crashed run resumes bit for bit mid-mixture, and replay (the old corpus at a
small weight) is a mixture like any other."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from conftest import CORPUS, TINY, Crash, CrashAt, tiny_overrides
from lmforge.config import load_config
from lmforge.data import load_prepared
from lmforge.errors import ConfigError
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The shipped corpus cut in two sources: "old" (the first 50 records) and "new" (the rest)."""
    d = tmp_path_factory.mktemp("corpora")
    lines = CORPUS.read_text().splitlines()
    (d / "old.jsonl").write_text("\n".join(lines[:50]) + "\n")
    (d / "new.jsonl").write_text("\n".join(lines[50:]) + "\n")
    return d


def config(run, data, corpora, *extra, old=0.1):
    new, old_path = corpora / "new.jsonl", corpora / "old.jsonl"
    sources = f"data.sources=[{{path: {new}}}, {{path: {old_path}, weight: {old}}}]"
    over = [o for o in tiny_overrides(run, data) if not o.startswith("data.sources=")]
    return load_config(TINY, [*over, sources, "data.tokenizer.vocab_size=512", *extra])


def test_replay_mixture_logs_per_source_tokens_at_the_weights(tmp_path, corpora):
    data = tmp_path / "data"
    cfg = config(tmp_path / "run", data, corpora, "train.max_steps=30")
    train(cfg)
    t = cfg.seq_len
    meta = load_prepared(data).meta["splits"]["train"]
    assert [s["name"] for s in meta["sources"]] == ["new", "old"]
    assert meta["shards"] == [f for s in meta["sources"] for f in s["shards"]]
    last = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r][-1]
    new, old = last["tokens_seen/new"], last["tokens_seen/old"]
    rows = 30 * cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    assert new + old == last["tokens_seen"] == rows * t
    n, p, k = rows, 1 / 1.1, new // t  # windows drawn, the weight of "new", windows it gave
    assert abs(k - n * p) <= 4 * math.sqrt(n * p * (1 - p))
    assert last["epochs/old"] > 0 and last["epochs/new"] > 0


@pytest.mark.slow  # 9 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_crashed_mixture_run_resumes_bit_for_bit(tmp_path, corpora):
    extra = ("train.max_steps=16", "checkpoint.every=5", "train.eval_every=8")
    data = tmp_path / "data"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(config(straight, data, corpora, *extra, old=3))
    with pytest.raises(Crash):
        Trainer(config(crashed, data, corpora, *extra, old=3), callbacks=[CrashAt(8)]).fit()
    train(config(crashed, data, corpora, *extra, old=3), resume=True)

    def curve(run):
        return [json.dumps(r, sort_keys=True) for r in read_metrics(run / "metrics.jsonl")
                if "loss" in r or "val_loss" in r for r in [{k: v for k, v in r.items()
                if k.startswith(("step", "loss", "val_loss", "tokens_seen", "epochs/"))}]]

    a, b = curve(straight), curve(crashed)
    assert len(a) >= 16 and a == b


def test_resume_with_other_weights_is_refused(tmp_path, corpora):
    extra = ("train.max_steps=4", "checkpoint.every=2")
    data = tmp_path / "data"
    with pytest.raises(Crash):
        Trainer(config(tmp_path / "run", data, corpora, *extra), callbacks=[CrashAt(3)]).fit()
    with pytest.raises(Exception, match="weights"):
        train(config(tmp_path / "run", data, corpora, *extra, old=0.5), resume=True)


# ---- train.epochs / train.max_tokens --------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_max_steps(tmp_path_factory):
    """configs/debug/tiny.yaml without its train.max_steps (which would contradict epochs / max_tokens)."""
    raw = yaml.safe_load(TINY.read_text())
    del raw["train"]["max_steps"]
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def small(base, run, data, *extra):
    return load_config(base, [*tiny_overrides(run, data), "data.max_chars=30000",
                              "data.tokenizer.vocab_size=512", "train.eval_every=0", *extra])


def test_epochs_derive_max_steps_and_validate_at_the_end_of_each_pass(tmp_path, no_max_steps):
    cfg = small(no_max_steps, tmp_path / "run", tmp_path / "data", "train.epochs=3")
    trainer = Trainer(cfg)
    loader, accum = trainer.run.train_loader, cfg.train.grad_accum_steps
    per_pass = loader.batches_per_epoch
    assert trainer.cfg.train.max_steps == math.ceil(3 * per_pass / accum)
    summaries = list(trainer.train_epochs())
    assert [s["epoch"] for s in summaries] == [1, 2, 3] and summaries[-1]["complete"]
    vals = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    ends = [math.ceil(e * per_pass / accum) for e in (1, 2, 3)]
    assert vals == ends  # one validation per pass end (the last is the final one), none else


def test_max_tokens_derives_the_steps_that_reach_it(tmp_path, no_max_steps):
    cfg = small(no_max_steps, tmp_path / "run", tmp_path / "data", "train.max_tokens=10000")
    train(cfg)
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.seq_len
    last = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r][-1]
    assert last["step"] == math.ceil(10000 / per_step)
    assert last["tokens_seen"] >= 10000 > last["tokens_seen"] - per_step


def test_contradicting_lengths_are_refused_naming_both_keys(tmp_path, no_max_steps):
    with pytest.raises(ConfigError, match=r"train.max_steps=40 and train.epochs=1"):
        Trainer(small(TINY, tmp_path / "run", tmp_path / "data", "train.epochs=1"))
    assert not (tmp_path / "run" / "checkpoints").exists()
    with pytest.raises(ConfigError, match=r"train.epochs=2 and train.max_tokens=5"):
        small(no_max_steps, tmp_path / "run", tmp_path / "data", "train.epochs=2", "train.max_tokens=5")
