"""Whether a CPU has bf16 matrix units: torch's cpuinfo on x86, /proc/cpuinfo's flags elsewhere or as the
fallback, unknown where neither says; the probe cache bounds what it reads and survives a bad disk."""

from __future__ import annotations

import pytest

from lmforge.utils import machine


@pytest.mark.parametrize("info, proc, expected", [
    ({"architecture": "x86_64", "avx512_bf16": False, "amx_bf16": False, "avx2": True}, None, False),
    ({"architecture": "x86_64", "avx512_bf16": False, "amx_bf16": True}, None, True),
    ({"architecture": "x86_64", "avx512_bf16": True, "amx_bf16": False}, None, True),
    ({}, ("Intel Xeon", {"avx2", "avx512_bf16"}), True),
    ({}, ("Neoverse-V1", {"fp", "asimd", "bf16", "sve"}), True),  # Arm: "bf16" in Features
    ({}, ("AMD EPYC", {"avx2", "fma"}), False),
    ({}, (None, None), None),  # no cpuinfo at all (macOS): measure rather than guess
])
def test_bf16_units(monkeypatch, info, proc, expected):
    monkeypatch.setattr(machine, "_torch_cpu_info", lambda: info)
    monkeypatch.setattr(machine, "_cpuinfo", lambda: proc or (None, None))
    assert machine.cpu_facts().bf16_units is expected


def test_cpuinfo_is_parsed_from_the_first_processor(monkeypatch, tmp_path):
    text = "processor: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor: 1\nflags: fpu\n"
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(tmp_path / "ci", *a, **k)
                        if p == "/proc/cpuinfo" else real_open(p, *a, **k))
    (tmp_path / "ci").write_text(text)
    assert machine._cpuinfo() == ("Test CPU", {"fpu", "avx2", "amx_bf16"})


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LMFORGE_CACHE_DIR", str(tmp_path / "a"))
    assert machine.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LMFORGE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert machine.cache_dir() == tmp_path / "x" / "lmforge"


def test_cache_keeps_the_newest_entries_and_ignores_an_oversized_file(tmp_path, monkeypatch):
    cache = machine.ProbeCache(tmp_path / "p.json")
    monkeypatch.setattr(machine.ProbeCache, "MAX_ENTRIES", 3)
    for i in range(5):
        assert cache.put(f"k{i}", {"v": i})
    assert [cache.get(f"k{i}") is not None for i in range(5)] == [False, False, True, True, True]
    (tmp_path / "p.json").write_text('{"version": 1, "entries": {}, "pad": "' + "x" * 300_000 + '"}')
    assert cache.get("k4") is None
    assert cache.put("k5", {"v": 5}) and cache.get("k5")["v"] == 5  # replaced by a well-formed file


def test_an_unwritable_cache_does_not_stop_anything(tmp_path):
    (tmp_path / "file").write_text("")
    cache = machine.ProbeCache(tmp_path / "file" / "p.json")  # its directory is a file
    assert cache.put("k", {"v": 1}) is False and cache.get("k") is None
