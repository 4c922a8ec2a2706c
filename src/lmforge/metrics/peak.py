"""An MFU denominator that a busy start-up cannot undercut, so the logged MFU is never above 100%.

A GPU in the datasheet table (metrics/throughput.py) uses its vendor peak, which no step can exceed.
Elsewhere (CPUs, GPUs not in the table) the peak is measured, and a measurement taken while other
processes share the cores reads low: a run on a busy 2-core machine logged `mfu 113.6%` (and 343%).
So the denominator is the best peak ever seen on this kind of machine (CPU facts, torch version, matmul
dtype and thread count), kept in the per-machine probe cache (utils/machine.py), and raised whenever a
training step itself achieves more than it: that step's MFU is then capped at 100%, the new peak is
stored, and the console says so once.

A cores x FMA units x vector width x clock figure is not used for CPUs: the clock Linux reports is the
current one (it moves with turbo and power states), and the FMA unit count per core is not reported at
all, so the product could be off by 2x either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lmforge.metrics.throughput import peak_flops
from lmforge.utils.machine import ProbeCache, cpu_facts

# A stored peak more than this many times the one measured now is not believed (a hand-edited or foreign
# cache file would otherwise make every MFU read ~0); a busy machine measures a few times low, not 64x.
_MAX_CACHED_RATIO = 64.0


class PeakFlops:
    """The MFU denominator of one device: `flops` (FLOP/s), `source` (where it comes from), and `mfu()`."""

    def __init__(self, flops: float, source: str, fixed: bool, cache: ProbeCache | None = None,
                 key: str | None = None, say: Callable[[str], None] | None = None) -> None:
        self.flops = flops
        self.source = source
        self.fixed = fixed  # a datasheet peak: nothing measured can raise it
        self.cache, self.key = cache, key
        self.say = say
        self.raised = 0  # how many times a step beat the peak (the console hears of the first)

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype, cache: ProbeCache | None = None,
                   write: bool = True, say: Callable[[str], None] | None = None) -> PeakFlops:
        """The peak for matmuls in `dtype` on `device`: datasheet where known, else max(measured now,
        best stored for this machine). `write`: store a new best (one rank writes)."""
        measured, source = peak_flops(device, dtype)
        if "datasheet" in source:
            return cls(measured, source, fixed=True, say=say)
        cache = cache if cache is not None else ProbeCache()
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        facts = {"gpu": name} if name else cpu_facts().key()
        key = ProbeCache.key("mfu_peak", dtype=str(dtype), threads=torch.get_num_threads(), **facts)
        peak = cls(measured, source, fixed=False, cache=cache if write else None, key=key, say=say)
        stored = stored_peak(cache.get(key), measured)
        if stored is not None and stored > measured:
            peak.flops, peak.source = stored, f"best {source.removeprefix('measured ')} on this machine"
        elif write:
            cache.put(key, {"flops": measured})
        return peak

    def mfu(self, achieved: float) -> float:
        """achieved FLOP/s of one device -> MFU in [0, 1]; an achieved rate above a measured peak
        becomes the new peak (stored) and this step's MFU is 1."""
        if not math.isfinite(achieved) or achieved <= 0:
            return 0.0
        if achieved <= self.flops or self.fixed:
            return min(achieved / self.flops, 1.0)
        if self.raised == 0 and self.say is not None:
            self.say(f"a step ran at {achieved / 1e12:.3g} TFLOP/s, above the MFU peak measured at start-up "
                     f"({self.flops / 1e12:.3g}, {self.source}; the machine was busier then): the peak is "
                     "raised to it and kept for later runs on this machine, and MFU is capped at 100%")
        self.raised += 1
        self.flops, self.source = achieved, "best step on this machine"
        if self.cache is not None:
            self.cache.put(self.key, {"flops": achieved})
        return 1.0


def stored_peak(entry: dict | None, measured: float) -> float | None:
    """The FLOP/s in a cache entry, or None where it is missing, malformed or not believable."""
    value = entry.get("flops") if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    if not math.isfinite(value) or value <= 0 or value > measured * _MAX_CACHED_RATIO:
        return None
    return value
