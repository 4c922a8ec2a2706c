"""A run's start-up probes as build_run wires them: precision auto and threads auto say what they chose
(and, precision, what it times first) through the run's own `say`, within the budget's deadline."""

from __future__ import annotations

import pytest
import torch

from lmforge.assembly import build_run
from lmforge.engine import precision as prec
from lmforge.engine import threads as th
from lmforge.utils.machine import CpuFacts


def _facts(bf16: bool) -> CpuFacts:
    return CpuFacts(name="Test CPU", capability="AVX512" if bf16 else "AVX2", flags=(), physical_cores=2,
                    logical_cores=2, bf16_units=bf16)


@pytest.fixture
def restore_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_avx2_run_says_fp32_at_once_and_threads_auto_sets_the_fastest(tiny_cfg, monkeypatch, restore_threads):
    monkeypatch.setattr(prec, "cpu_facts", lambda: _facts(False))
    monkeypatch.setattr(prec, "_step_timer", lambda *a, **k: pytest.fail("timed a bf16 step on an AVX2 CPU"))
    monkeypatch.setattr(th, "cpu_facts", lambda: _facts(False))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(th, "_mlp_timer", lambda rows, d, f: {1: 0.01, 2: 0.02}.__getitem__)
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    lines: list[str] = []
    run = build_run(tiny_cfg("train.precision=auto", "train.threads=auto"), "experiment", say=lines.append)
    assert run.precision.name == "fp32"
    assert "precision auto: fp32 (this CPU has no bf16 matrix units: AVX2)" in lines
    assert chosen[-1] == 1
    assert any(line.startswith("threads auto: 1 (an MLP of ") for line in lines)


def test_bf16_probe_is_announced_and_bounded_by_the_time_budget(tiny_cfg, monkeypatch):
    monkeypatch.setattr(prec, "cpu_facts", lambda: _facts(True))
    calls: list[tuple[str, int]] = []

    def fake_timer(*_a, **_k):
        def step(name, rows):
            calls.append((name, rows))
            return {"fp32": 0.025, "bf16": 0.0125}[name] * rows
        return step

    monkeypatch.setattr(prec, "_step_timer", fake_timer)
    lines: list[str] = []
    # max_time 20 s: the probe gets 3% of it, 0.6 s; a row costs 0.025 s in fp32
    cfg = tiny_cfg("train.precision=auto", "train.max_time=20", "train.micro_batch_size=64")
    run = build_run(cfg, "experiment", say=lines.append)
    assert run.precision.name == "bf16"
    timing = [line for line in lines if line.startswith("precision auto")]
    assert timing[0].startswith("precision auto: timing a bf16 and an fp32 training step at 64x")
    assert "at most 0.6 s" in timing[0]
    assert "timing 5x" in timing[1]  # (0.6 - 2 x 0.025) / (4 x 0.025) rows
    assert timing[-1].startswith("precision auto: bf16 (a step at 5x")
    assert sum({"fp32": 0.025, "bf16": 0.0125}[n] * r for n, r in calls) <= 0.6
