"""MFU's denominator is never undercut by a busy start-up: logged MFU stays <= 100%, the best peak is
kept per machine in a bounded cache that tolerates anything written into it."""

from __future__ import annotations

import json
import math

import pytest
import torch

import lmforge.metrics.peak as peak_mod
from lmforge.metrics.peak import PeakFlops, stored_peak
from lmforge.utils.machine import ProbeCache

CPU = torch.device("cpu")


def _busy(monkeypatch, flops=1e6):
    """Start-up measures `flops` (a machine far busier than it will be during the steps)."""
    monkeypatch.setattr(peak_mod, "peak_flops", lambda device, dtype: (flops, "measured fp32 matmul"))


def test_a_step_faster_than_the_start_up_peak_is_capped_and_raises_the_stored_peak(monkeypatch, tmp_path):
    _busy(monkeypatch)
    cache, said = ProbeCache(tmp_path / "probes.json"), []
    peak = PeakFlops.for_device(CPU, torch.float32, cache=cache, say=said.append)
    assert peak.flops == 1e6 and peak.mfu(5e5) == 0.5
    assert peak.mfu(3e6) == 1.0 and peak.flops == 3e6  # capped, raised
    assert peak.mfu(4e6) == 1.0 and peak.mfu(2e6) == 0.5
    assert len(said) == 1 and "capped at 100%" in said[0]  # said once
    again = PeakFlops.for_device(CPU, torch.float32, cache=cache)  # the next run starts from the best
    assert again.flops == 4e6 and again.source == "best fp32 matmul on this machine"
    assert again.mfu(2e6) == 0.5


def test_a_datasheet_peak_is_fixed_and_caps_mfu():
    peak = PeakFlops(989e12, "NVIDIA H100 datasheet, bf16", fixed=True)
    assert peak.mfu(2000e12) == 1.0 and peak.flops == 989e12
    assert peak.mfu(float("nan")) == 0.0 and peak.mfu(-1.0) == 0.0


@pytest.mark.parametrize("entry", [
    None, {}, {"flops": "1e9"}, {"flops": True}, {"flops": float("nan")}, {"flops": float("inf")},
    {"flops": -5.0}, {"flops": 0}, {"flops": 1e30}, {"flops": [1e9]}, "x",
])
def test_a_malformed_or_unbelievable_stored_peak_is_ignored(entry):
    assert stored_peak(entry, measured=1e9) is None


def test_a_believable_stored_peak_is_read():
    assert stored_peak({"flops": 3e9, "at": 1.0}, measured=1e9) == 3e9


@pytest.mark.parametrize("content", [b"\xff\xfe not json", b"[1, 2]", b'{"version": 1, "entries": 7}',
                                     b"{" * 100_000, b" " * (ProbeCache.MAX_BYTES + 10)])
def test_a_hostile_cache_file_never_stops_the_run_and_is_replaced(monkeypatch, tmp_path, content):
    _busy(monkeypatch, 2e6)
    path = tmp_path / "probes.json"
    path.write_bytes(content)
    peak = PeakFlops.for_device(CPU, torch.float32, cache=ProbeCache(path))
    assert peak.flops == 2e6
    data = json.loads(path.read_text())
    assert [e["flops"] for e in data["entries"].values()] == [2e6]


def test_the_cache_stays_bounded(monkeypatch, tmp_path):
    cache = ProbeCache(tmp_path / "probes.json")
    for threads in range(ProbeCache.MAX_ENTRIES + 20):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t + 1)
        _busy(monkeypatch, 1e6 + threads)
        PeakFlops.for_device(CPU, torch.float32, cache=cache)
    assert len(json.loads(cache.path.read_text())["entries"]) == ProbeCache.MAX_ENTRIES


def test_busy_start_up_then_fast_steps_never_log_mfu_above_100(monkeypatch, tiny_cfg, tmp_path):
    from lmforge.metrics.loggers import read_metrics
    from lmforge.train.trainer import Trainer

    _busy(monkeypatch, 1e3)  # 1 kFLOP/s: every real step beats it
    said = []
    trainer = Trainer(tiny_cfg("train.max_steps=4", "train.log_every=1", "checkpoint.every=0",
                               "train.eval_every=0", "train.eval_batches=1"))
    trainer.peak.say = said.append
    trainer.fit()
    mfu = [r["mfu"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "mfu" in r]
    assert len(mfu) == 4 and all(0 < m <= 1 for m in mfu) and mfu[0] == 1.0
    assert len(said) == 1 and trainer.peak.flops > 1e3 and math.isfinite(trainer.peak.flops)
