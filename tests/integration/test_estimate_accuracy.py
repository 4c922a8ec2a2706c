"""`lmforge estimate` against the measured peak of real training steps on the CPU: within 10% of the
measured peak RSS growth (busiest rank) on every configuration of `estimate_measure.grid()` (shapes x
activation checkpointing x optimizers x single process, DDP, ZeRO-1/2/3, TP, PP (GPipe, 1F1B,
interleaved) on gloo, mixture of experts in one process and with expert parallelism, and the
fine-tuning methods: SFT full / LoRA / QLoRA, DPO full with its reference copy and LoRA, a reward
model)."""

from __future__ import annotations

import pytest

from lmforge.tools.estimate_measure import compare, grid


@pytest.mark.slow
@pytest.mark.parametrize("name,config,world_size", grid(), ids=[g[0] for g in grid()])
def test_estimate_within_10_percent_of_measured_peak(name, config, world_size):
    est, measured = compare(config, world_size, steps=3)
    assert measured > 50 * 2**20, "the configuration must be big enough to measure"
    assert abs(est - measured) / measured < 0.10, f"{name}: estimate {est / 2**20:.1f} MiB, measured " \
                                                  f"{measured / 2**20:.1f} MiB"
