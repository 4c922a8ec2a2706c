"""data.workers: documents encoded in worker processes give the shards of one worker, byte for byte."""

from __future__ import annotations

import importlib

import pytest

from conftest import TINY, tiny_overrides
from lmforge.config import load_config
from lmforge.errors import ConfigError

# the module, not the function lmforge.data re-exports under the same name
prepare_mod = importlib.import_module("lmforge.data.prepare")


def test_two_workers_write_the_shards_of_one_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "_BATCH_DOCS", 5)  # many chunks in flight, finishing out of order
    out = {}
    for workers in (1, 2):
        cfg = load_config(TINY, tiny_overrides(tmp_path / "run", tmp_path / f"data{workers}",
                                               "data.tokenizer.vocab_size=400", "data.shard_tokens=4096",
                                               f"data.workers={workers}"))
        data = prepare_mod.prepare(cfg, console=lambda *_: None)
        shards = data.shards("train") + data.shards("val")
        out[workers] = ([p.name for p in shards], [p.read_bytes() for p in shards], data.meta["splits"])
    assert len(out[1][0]) > 4
    assert out[1] == out[2]


def test_bad_worker_counts_are_refused():
    for bad in ("0", "65", "many"):
        with pytest.raises(ConfigError, match="data.workers"):
            load_config(TINY, [f"data.workers={bad}"])
