"""What this CPU can do, and a small per-machine cache of what start-up probes measured on it.

The probes (precision `auto`, threads `auto`) time real kernels; their verdicts depend on the machine,
torch's version and the shape timed, so they are cached under those facts and re-measured only when one
changes. The cache file is untrusted input (another process, a disk error or a person may have written
it): it is read with a size bound, anything malformed in it is ignored, and it is replaced atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import LmforgeError
from lmforge.utils.io import atomic_write_json

# The instructions that give a CPU bf16 matrix units: AVX512-BF16 / AMX-BF16 on x86 (/proc/cpuinfo and
# torch's cpuinfo names), BF16 (BFMMLA, Armv8.6) on Arm ("bf16" in /proc/cpuinfo's Features line).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
_X86 = ("x86_64", "amd64", "i386", "i686")
_CPUINFO_BYTES = 1 << 20


@dataclass(frozen=True)
class CpuFacts:
    name: str
    capability: str  # torch's kernel level: AVX2, AVX512, DEFAULT, ...
    flags: tuple[str, ...]  # the feature flags known to be present, sorted (part of every cache key)
    physical_cores: int
    logical_cores: int  # the cores this process may run on
    bf16_units: bool | None  # None: nothing says either way

    def key(self) -> dict:
        """What a measurement on this CPU depends on (with torch's version)."""
        return {"cpu": self.name, "capability": self.capability, "flags": list(self.flags),
                "torch": torch.__version__, "machine": platform.machine()}


def _torch_cpu_info() -> dict[str, Any]:
    """torch's cpuinfo dict (torch >= 2.9 has torch._C._cpu._get_cpu_capability); {} where it has none."""
    get = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    try:
        info = get() if get is not None else {}
    except Exception:  # noqa: BLE001 - a private API: any failure means "no facts from torch"
        return {}
    return info if isinstance(info, dict) else {}


def _cpuinfo() -> tuple[str | None, set[str] | None]:
    """(model name, flags) from /proc/cpuinfo's first processor; (None, None) where it cannot be read."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            text = f.read(_CPUINFO_BYTES).decode("utf-8", "replace")
    except OSError:
        return None, None
    name, flags = None, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and name is None:
            name = value.strip()
        elif key in ("flags", "features") and flags is None:
            flags = set(value.split())
    return name, flags


def cpu_facts() -> CpuFacts:
    """This CPU's name, kernel level, feature flags, cores, and whether it has bf16 matrix units."""
    info = _torch_cpu_info()
    name, proc_flags = _cpuinfo()
    arch = str(info.get("architecture", platform.machine())).lower()
    torch_flags = {k for k, v in info.items() if v is True}
    if arch in _X86 and "avx512_bf16" in info:
        bf16: bool | None = bool(info.get("avx512_bf16") or info.get("amx_bf16"))
    elif proc_flags is not None:
        bf16 = any(f in proc_flags for f in _BF16_FLAGS)
    else:
        bf16 = None  # e.g. macOS: measure rather than guess
    try:
        logical = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        logical = os.cpu_count() or 1
    physical = info.get("num_physical_cores")
    physical = min(physical, logical) if isinstance(physical, int) and physical > 0 else logical
    flags = tuple(sorted(torch_flags | (proc_flags or set())))
    return CpuFacts(name=str(info.get("cpu_name") or name or platform.processor() or "unknown"),
                    capability=torch.backends.cpu.get_cpu_capability(), flags=flags,
                    physical_cores=physical, logical_cores=logical, bf16_units=bf16)


def cache_dir() -> Path:
    """LMFORGE_CACHE_DIR, else $XDG_CACHE_HOME/lmforge, else ~/.cache/lmforge."""
    if os.environ.get("LMFORGE_CACHE_DIR"):
        return Path(os.environ["LMFORGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmforge"


class ProbeCache:
    """Verdicts of start-up probes, keyed by what they depend on; at most MAX_ENTRIES, newest kept.

    Every failure to read or write is swallowed: a cache only saves time, it never stops a run.
    """

    MAX_BYTES = 256 * 1024
    MAX_ENTRIES = 64
    VERSION = 1

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else cache_dir() / "probes.json"

    @staticmethod
    def key(kind: str, **facts: Any) -> str:
        blob = json.dumps({"kind": kind, **facts}, sort_keys=True, default=str)
        return f"{kind}:{hashlib.sha256(blob.encode()).hexdigest()[:32]}"

    def _entries(self) -> dict[str, dict]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(self.MAX_BYTES + 1)
        except OSError:
            return {}
        if len(raw) > self.MAX_BYTES:
            return {}  # not a file this class wrote: start afresh rather than parse an unbounded blob
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return {}
        if not isinstance(obj, dict) or obj.get("version") != self.VERSION:
            return {}
        entries = obj.get("entries")
        if not isinstance(entries, dict):
            return {}
        return {k: v for k, v in entries.items()
                if isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("at"), (int, float))}

    def get(self, key: str) -> dict | None:
        return self._entries().get(key)

    def put(self, key: str, value: dict) -> bool:
        """Store `value` under `key`; False where the file could not be written (the run goes on)."""
        entries = self._entries()
        entries[key] = {**value, "at": time.time()}
        newest = sorted(entries.items(), key=lambda kv: kv[1]["at"], reverse=True)[: self.MAX_ENTRIES]
        try:
            atomic_write_json(self.path, {"version": self.VERSION, "entries": dict(newest)})
        except (OSError, LmforgeError, ValueError, TypeError):
            return False
        return True
