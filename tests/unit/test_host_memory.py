"""keep_freed_memory: inside it, allocating and freeing the same large tensors again costs no page
faults (glibc: no mmap per allocation, no trimming); after it, a 64 MiB allocation is mmapped (and
faulted) again; disabled or off glibc, nothing changes. The trainer holds it around its loop exactly
when train.keep_host_memory says."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lmforge.train.trainer as trainer_module
import lmforge.utils.host_memory as host_memory
from lmforge.train.trainer import Trainer
from lmforge.utils.host_memory import keep_freed_memory

glibc_only = pytest.mark.skipif(host_memory.glibc() is None, reason="needs glibc's malloc (Linux)")


FAULTS = """
import os, resource, sys, torch
from lmforge.utils.host_memory import keep_freed_memory

SIZES = (64, 8, 24, 1, 64)  # MiB: what a step holds at once, then frees

def faults(n=4):  # minor page faults of n such "steps"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        tensors = [torch.ones(m * 2**18) for m in SIZES]  # float32: 2**18 per MiB
        del tensors
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

faults(2)
out = [faults()]
with keep_freed_memory(sys.argv[1] == "on") as on:
    out.append(on)
    faults(6)  # the heap settles at the steps' size
    out.append(faults())
    with keep_freed_memory(sys.argv[1] == "on") as inner:  # nested: the outer one's settings hold
        out.append(inner)
    out.append(faults())
    out.append(rss_mib())
out.append(rss_mib())
print(out)
"""
PAGES = 4 * (64 + 8 + 24 + 1 + 64) * 2**20 // 4096  # pages the 4 steps of FAULTS touch


def run_faults(mode: str) -> list:
    """The fault counts of FAULTS in a fresh process (what the heap holds depends on the process's
    history)."""
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], check=True, capture_output=True, text=True)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_freed_memory_is_reused_inside_and_returned_after():
    before, on, inside, inner, nested, rss_inside, rss_after = run_faults("on")
    assert before >= 0.7 * PAGES  # glibc's defaults: fresh pages for most of every step
    assert on and inner
    assert inside < 0.01 * PAGES and nested < 0.01 * PAGES  # the steps reuse what the last one freed
    assert rss_inside - rss_after > 100  # MiB: on leaving, the kept memory (a step's 161) goes back


@glibc_only
def test_disabled_changes_nothing():
    before, on, inside, inner, nested, _, _ = run_faults("off")
    assert not on and not inner
    assert min(before, inside, nested) >= 0.7 * PAGES


def test_without_glibc_it_does_nothing(monkeypatch):
    monkeypatch.setattr(host_memory, "glibc", lambda: None)
    with keep_freed_memory() as on:
        assert not on


@pytest.mark.parametrize("keep", [True, False])
def test_the_trainer_keeps_memory_around_its_loop_as_configured(tiny_cfg, monkeypatch, keep):
    seen: list = []
    real = trainer_module.keep_freed_memory

    def spy(enabled: bool = True):
        seen.append(enabled)
        return real(enabled)

    monkeypatch.setattr(trainer_module, "keep_freed_memory", spy)
    Trainer(tiny_cfg("train.max_steps=2", f"train.keep_host_memory={str(keep).lower()}")).fit()
    assert seen == [keep]


def test_the_bench_worker_measures_a_step_and_its_memory():
    """bench/host_memory.py's per-process measurement at nanoGPT's shape (2 steps)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import host_memory as bench  # noqa: PLC0415  (bench/ is not a package)

    assert bench.peak_rss_mib_of("Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t 1024 kB\n") == 200.0
    r = bench.worker("nanogpt", keep=False, steps=2)
    assert r["median_ms"] > 0 and r["faults_per_step"] >= 0 and r["peak_rss_mib"] > 0 and not r["took_effect"]
