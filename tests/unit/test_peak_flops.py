"""MFU's denominator: datasheet peaks for known GPUs, a short measured matmul on CPUs, never an fp16
probe on a CPU (emulated there: the honest peak is fp32's)."""

from __future__ import annotations

import time

import pytest
import torch

from lmforge.metrics.throughput import datasheet_peak, peak_flops

CPU = torch.device("cpu")


@pytest.mark.parametrize("name, dtype, tf32, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, False, 756e12),
    ("NVIDIA H100 80GB HBM3", torch.float32, False, 67e12),
    ("NVIDIA H100 80GB HBM3", torch.float32, True, 494e12),
    ("NVIDIA H200", torch.bfloat16, False, 989e12),
    ("NVIDIA A100-SXM4-80GB", torch.float16, False, 312e12),
    ("NVIDIA L4", torch.bfloat16, False, 121e12),
    ("Tesla V100-SXM2-16GB", torch.bfloat16, False, None),  # no bf16 units
    ("Some Future GPU", torch.bfloat16, False, None),
])
def test_datasheet_peaks(name, dtype, tf32, peak):
    assert datasheet_peak(name, dtype, tf32) == peak


def test_fp16_on_a_cpu_uses_the_fp32_peak_quickly():
    t0 = time.perf_counter()
    fp16, source = peak_flops(CPU, torch.float16)
    assert time.perf_counter() - t0 < 10 and source == "measured fp32 matmul"
    fp32, _ = peak_flops(CPU, torch.float32)
    assert 0.3 < fp16 / fp32 < 3  # both fp32 measurements of the same machine


def test_bf16_on_a_cpu_takes_the_faster_of_fp32_and_bf16():
    peak, source = peak_flops(CPU, torch.bfloat16)
    assert source in ("measured fp32 matmul", "measured bf16 matmul") and peak > 1e9


def test_an_fp16_run_on_a_cpu_logs_an_honest_mfu(tiny_cfg, tmp_path):
    from lmforge.metrics.loggers import read_metrics
    from lmforge.train.trainer import Trainer

    t0 = time.perf_counter()
    Trainer(tiny_cfg("train.precision=fp16", "train.max_steps=4", "checkpoint.every=0", "train.eval_every=0",
                     "train.eval_batches=1")).fit()
    assert time.perf_counter() - t0 < 120
    mfu = [r["mfu"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "mfu" in r]
    assert mfu and all(0 < m < 1 for m in mfu)
