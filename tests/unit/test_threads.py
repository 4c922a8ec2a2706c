"""train.threads: auto times the candidate thread counts (a fake timer here), takes the fastest unless
torch's default is within noise of it, says so in one line and caches the verdict."""

from __future__ import annotations

import pytest
import torch

from lmforge.engine import threads as th
from lmforge.utils.machine import CpuFacts, ProbeCache


def facts(physical: int = 2, logical: int = 2) -> CpuFacts:
    return CpuFacts(name="Test CPU", capability="AVX2", flags=("avx2",), physical_cores=physical,
                    logical_cores=logical, bf16_units=False)


class FakeMlp:
    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds, self.calls = seconds, []

    def __call__(self, n: int) -> float:
        self.calls.append(n)
        return self.seconds[n]


@pytest.fixture(autouse=True)
def _no_omp(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def resolve(tmp_path, mlp, cpu=None, lines=None):
    lines = [] if lines is None else lines
    out = th.resolve_threads("auto", rows=4096, d_model=256, d_ff=1024, say=lines.append,
                             facts=cpu or facts(),
                             cache=ProbeCache(tmp_path / "probes.json"), time_mlp=mlp)
    return out, lines


def test_none_and_counts_pass_through():
    assert th.resolve_threads(None, rows=1, d_model=8, d_ff=8) is None
    assert th.resolve_threads(3, rows=1, d_model=8, d_ff=8) == 3


def test_candidates_are_default_physical_logical_and_half_physical():
    assert th.candidates(facts(2, 2), 2) == [1, 2]  # this 2-core machine: 1 or 2
    assert th.candidates(facts(8, 16), 8) == [4, 8, 16]
    assert th.candidates(facts(1, 1), 1) == [1]


def test_the_fastest_count_wins_and_is_said(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    mlp = FakeMlp({1: 0.020, 2: 0.030})  # a loaded machine: one thread is faster
    out, lines = resolve(tmp_path, mlp)
    assert out == 1 and set(mlp.calls) == {1, 2}
    assert lines == [f"threads auto: 1 (an MLP of 2048x256x1024: 1 thread 20.0 ms, 2 threads 30.0 ms; cached "
                     f"in {tmp_path / 'probes.json'})"]


def test_torch_default_stays_within_noise(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    out, _ = resolve(tmp_path, FakeMlp({1: 0.0200, 2: 0.0204}))
    assert out == 2


def test_the_verdict_is_cached_and_not_timed_again(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    resolve(tmp_path, FakeMlp({1: 0.020, 2: 0.030}))
    again = FakeMlp({1: 0.020, 2: 0.030})
    out, lines = resolve(tmp_path, again)
    assert out == 1 and again.calls == []
    assert lines[0].startswith("threads auto: 1 (measured before on this machine")


def test_one_candidate_or_omp_num_threads_is_taken_without_timing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    mlp = FakeMlp({})
    assert resolve(tmp_path, mlp, cpu=facts(1, 1))[0] == 1 and mlp.calls == []
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    out, lines = resolve(tmp_path, mlp)
    assert out == 2 and mlp.calls == [] and "OMP_NUM_THREADS" in lines[0]


def test_the_timing_stops_at_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    mlp = FakeMlp({1: 1.5, 2: 1.0})  # the warm-ups alone exceed DEADLINE_S: one timed round
    assert resolve(tmp_path, mlp)[0] == 2
    assert len(mlp.calls) == 4


def test_the_real_timer_restores_torch_threads(tmp_path):
    before = torch.get_num_threads()
    lines = []
    out = th.resolve_threads("auto", rows=64, d_model=32, d_ff=64, say=lines.append,
                             facts=facts(max(2, before), max(2, before)),
                             cache=ProbeCache(tmp_path / "p.json"))
    assert torch.get_num_threads() == before
    assert out in th.candidates(facts(max(2, before), max(2, before)), before)
    assert lines[0].startswith(f"threads auto: {out} (")


@pytest.mark.parametrize("bad", [True, "2", [2], 7, None])
def test_a_malformed_cached_count_is_measured_again(tmp_path, monkeypatch, bad):
    import json

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    resolve(tmp_path, FakeMlp({1: 0.020, 2: 0.030}))
    path = tmp_path / "probes.json"
    obj = json.loads(path.read_text())
    for entry in obj["entries"].values():
        entry["threads"] = bad
    path.write_text(json.dumps(obj))
    again = FakeMlp({1: 0.030, 2: 0.020})
    assert resolve(tmp_path, again)[0] == 2 and again.calls


def test_ranks_of_a_job_take_their_share_instead_of_measuring(tiny_cfg):
    from lmforge.assembly.build import _threads
    from lmforge.parallel.world import World

    cfg = tiny_cfg("train.threads=auto")
    assert _threads(cfg, World(rank=0, world_size=2, local_rank=0), lambda _: pytest.fail("said")) is None
    assert _threads(tiny_cfg("train.threads=3"), World(rank=0, world_size=1, local_rank=0), print) == 3


@pytest.mark.parametrize("value, expected", [(None, None), ("auto", "auto"), (3, 3), ("4", 4), (2.0, 2)])
def test_config_accepts_counts_auto_and_null(value, expected):
    from lmforge.config.train import TrainConfig

    assert TrainConfig(threads=value).threads == expected


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "many", [2]])
def test_config_refuses_anything_else_in_one_message(value):
    from pydantic import ValidationError

    from lmforge.config.train import TrainConfig

    with pytest.raises(ValidationError) as e:
        TrainConfig(threads=value)
    errors = e.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == ("threads",)
    assert "give a number of threads >= 1, 'auto' (measured) or null" in errors[0]["msg"]
