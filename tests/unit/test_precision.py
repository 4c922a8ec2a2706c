"""Precision 'auto': fp32 at once on a CPU without bf16 matrix units; elsewhere a bounded, announced and
cached measurement; never a change to the run's RNG or gradients."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.engine import precision as prec
from lmforge.models import build_model
from lmforge.utils.machine import CpuFacts, ProbeCache

CPU = torch.device("cpu")


def facts(bf16: bool | None, capability: str = "AVX512") -> CpuFacts:
    return CpuFacts(name="Test CPU", capability=capability, flags=("amx_bf16",) if bf16 else (),
                    physical_cores=4, logical_cores=8, bf16_units=bf16)


class FakeSteps:
    """A step timer: seconds per row of each precision; records every call."""

    def __init__(self, fp32: float, bf16: float) -> None:
        self.per_row = {"fp32": fp32, "bf16": bf16}
        self.calls: list[tuple[str, int]] = []

    def __call__(self, name: str, rows: int) -> float:
        self.calls.append((name, rows))
        return self.per_row[name] * rows

    def spent(self) -> float:
        return sum(self.per_row[n] * r for n, r in self.calls)


def resolve(tmp_path, steps, cpu=None, lines=None, **kw):
    lines = [] if lines is None else lines
    model = torch.nn.Linear(2, 2)
    out = prec.resolve_precision("auto", CPU, model, kw.pop("batch", 16), 256, 64, say=lines.append,
                                 facts=cpu or facts(True), cache=ProbeCache(tmp_path / "probes.json"),
                                 time_step=steps, **kw)
    return out, lines


def test_explicit_names_pass_through_and_auto_without_model_is_fp32():
    for name in ("fp32", "bf16", "fp16"):
        assert prec.resolve_precision(name, CPU) == name
    assert prec.resolve_precision("auto", CPU) == "fp32"


def test_a_cpu_without_bf16_units_is_fp32_at_once_and_says_so(tmp_path):
    steps = FakeSteps(0.01, 0.07)
    out, lines = resolve(tmp_path, steps, cpu=facts(False, "AVX2"))
    assert out == "fp32" and steps.calls == []  # 0 s of timing
    assert lines == ["precision auto: fp32 (this CPU has no bf16 matrix units: AVX2)"]
    assert not (tmp_path / "probes.json").exists()


def test_this_machine_without_bf16_units_times_nothing(monkeypatch, tmp_path):
    from lmforge.utils.machine import cpu_facts

    if cpu_facts().bf16_units is not False:
        pytest.skip("this CPU has (or may have) bf16 units")
    monkeypatch.setattr(prec, "_step_timer", lambda *a, **k: pytest.fail("timed a step"))
    lines = []
    model = build_model(ModelConfig(preset="debug", vocab_size=64, max_seq_len=16))
    assert prec.resolve_precision("auto", CPU, model, 2, 16, 64, say=lines.append,
                                  cache=ProbeCache(tmp_path / "p.json")) == "fp32"
    assert lines[0].startswith("precision auto: fp32 (this CPU has no bf16 matrix units")


def test_auto_follows_the_measurement_and_announces_it(tmp_path):
    out, lines = resolve(tmp_path, FakeSteps(0.010, 0.005))  # bf16 2x faster
    assert out == "bf16"
    assert lines[0].startswith("precision auto: timing a bf16 and an fp32 training step at 16x256")
    assert lines[-1].startswith("precision auto: bf16 (a step at 16x256: bf16 0.080 s, fp32 0.160 s, 2.00x")
    out, _ = resolve(tmp_path / "other", FakeSteps(0.010, 0.0095))  # within noise: stay fp32
    assert out == "fp32"


def test_the_verdict_is_cached_per_shape_and_not_timed_again(tmp_path):
    first = FakeSteps(0.010, 0.005)
    assert resolve(tmp_path, first)[0] == "bf16" and first.calls
    again = FakeSteps(0.010, 0.005)
    out, lines = resolve(tmp_path, again)
    assert out == "bf16" and again.calls == []
    assert lines == [f"precision auto: bf16 (measured before on this machine at 16x256: bf16 0.080 s, fp32 "
                     f"0.160 s, 2.00x; cached in {tmp_path / 'probes.json'})"]
    other = FakeSteps(0.010, 0.005)
    resolve(tmp_path, other, batch=8)  # another micro-batch is another key: measured
    assert other.calls


def test_the_probe_keeps_to_its_deadline_by_timing_fewer_rows(tmp_path):
    steps = FakeSteps(0.1, 0.05)  # a full 16-row fp32 step takes 1.6 s
    out, lines = resolve(tmp_path, steps, deadline_s=2.0)
    assert steps.spent() <= 2.0
    assert steps.calls[:2] == [("fp32", 1), ("fp32", 1)]  # a cold and a warm price of one row
    rows = {r for _, r in steps.calls[2:]}
    assert rows == {4}  # (2.0 - 0.2) / (4 x 0.1 per row) -> 4 rows
    assert any("timing 4x256 instead" in line for line in lines)
    assert out == "bf16" and "a step at 4x256" in lines[-1]


def test_a_deadline_too_short_for_one_pair_is_fp32_without_overrunning(tmp_path):
    steps = FakeSteps(1.0, 1.0)
    out, lines = resolve(tmp_path, steps, deadline_s=2.0)
    assert out == "fp32" and steps.spent() <= 2.0
    assert "do not fit in 2.0 s" in lines[-1]
    assert not (tmp_path / "probes.json").exists()  # nothing measured, nothing cached


def test_the_deadline_is_a_few_percent_of_a_time_budget():
    assert prec.probe_deadline(None) == prec.DEADLINE_S
    assert prec.probe_deadline(3600) == prec.DEADLINE_S
    assert prec.probe_deadline(30) == pytest.approx(0.9)


@pytest.mark.parametrize("junk", [b"{", b"[]", b'{"version": 1, "entries": []}', b"\xff\xfe",
                                  b'{"version": 1, "entries": {"k": 3}}', b"[" * 100_000])
def test_a_malformed_cache_is_ignored_and_replaced(tmp_path, junk):
    (tmp_path / "probes.json").write_bytes(junk)
    steps = FakeSteps(0.010, 0.005)
    assert resolve(tmp_path, steps)[0] == "bf16" and steps.calls
    assert json.loads((tmp_path / "probes.json").read_text())["version"] == 1


def test_a_cached_entry_with_a_bad_verdict_is_measured_again(tmp_path):
    resolve(tmp_path, FakeSteps(0.010, 0.005))
    path = tmp_path / "probes.json"
    obj = json.loads(path.read_text())
    for entry in obj["entries"].values():
        entry["verdict"] = "fp64"
    path.write_text(json.dumps(obj))
    steps = FakeSteps(0.010, 0.005)
    assert resolve(tmp_path, steps)[0] == "bf16" and steps.calls


def test_probe_leaves_rng_and_grads_alone():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="debug", vocab_size=64, max_seq_len=16, dropout=0.1))
    before = torch.get_rng_state()
    speedup = prec.bf16_step_speedup(model, 2, 16, 64, CPU)
    assert speedup > 0
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in model.parameters())


def test_a_measured_auto_leaves_rng_and_grads_alone(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="debug", vocab_size=64, max_seq_len=16, dropout=0.1))
    before = torch.get_rng_state()
    prec.resolve_precision("auto", CPU, model, 2, 16, 64, say=lambda _: None, facts=facts(None),
                           cache=ProbeCache(tmp_path / "p.json"), deadline_s=2.0)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in model.parameters())
