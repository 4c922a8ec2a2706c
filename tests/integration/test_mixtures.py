"""A weighted data.sources mixture end to end: prepared per source, the logged per-source tokens add up
and follow the weights, a crashed run resumes bit for bit mid-mixture, and replay (the old corpus at a
small weight) is a mixture like any other."""

from __future__ import annotations

import json
import math

import pytest

from conftest import CORPUS, TINY, Crash, CrashAt, tiny_overrides
from lmforge.config import load_config
from lmforge.data import load_prepared
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
