"""`lmforge serve --quantized int8|int4|auto`: serve a run with weight-only quantized linear layers on
the fastest CPU path (lmforge.compress.cpu_decode) whose weights fit a memory budget.

The weights: a run written by `lmforge quantize` is served with its own integers (`auto` or its bit
width; another width is refused: re-quantizing quantized weights compounds the error); a full-precision
run is quantized in memory by round-to-nearest (int8 per channel, int4 in groups), the run on disk
untouched. `auto` on a full-precision run takes int8 (see _bits).

The path: `--quant-path auto` times every candidate that fits on the model's own layer shapes at
start-up (a copy of one layer per shape, at 1 row and at the decode batch, bounded to PROBE_SECONDS) and
takes the fastest; for a run quantized in memory only the kernel paths compete (dequantized, it would be
the run itself with the rounding error added). A probe instead of a fixed rule, because which path wins
depends on the model's size and the CPU (bench/results/quant_decode.json, 2-core AVX2 EPYC: the 4M demo
model decodes fastest dequantized to fp32, a 100M model on the int kernels fed bf16). A named path is
taken as given, if it fits.
"""

from __future__ import annotations

import time

from torch import nn

from lmforge.compress import cpu_decode
from lmforge.errors import LmforgeError

MODES = ("int8", "int4", "auto")
PATH_CHOICES = ("auto", *cpu_decode.PATHS)
PROBE_SECONDS = 3.0


def prepare(model: nn.Module, mode: str, path: str = "auto", budget_bytes: int | None = None,
            max_batch: int = 8, probe_seconds: float = PROBE_SECONDS, say=print,
            measure=cpu_decode.probe) -> tuple[nn.Module, dict]:
    """`model` quantized as `mode` asks and set up on the chosen path; returns it and a report (bits,
    path, weight bytes per candidate, the probe's seconds per step). `measure`: the probe (tests give
    a fake table)."""
    if mode not in MODES:
        raise LmforgeError(f"--quantized {mode!r}; valid: {', '.join(MODES)}")
    if path not in PATH_CHOICES:
        raise LmforgeError(f"--quant-path {path!r}; valid: {', '.join(PATH_CHOICES)}")
    if budget_bytes is not None and budget_bytes <= 0:
        raise LmforgeError("--memory-budget-mb must be a positive number of MiB")
    _check_servable(model)
    bits = _bits(model, mode)
    candidates = cpu_decode.PATHS if path == "auto" else (path,)
    if cpu_decode.model_bits(model) is None:
        from lmforge.config.schema import QuantConfig

        cpu_decode.quantize_in_memory(model, bits, QuantConfig().targets)
        if path == "auto":
            # Dequantizing in-memory integers back to fp32 / bf16 would hold the memory of the run as it
            # is (or in bf16) with the rounding error added: never better than serving without --quantized.
            candidates = tuple(p for p in candidates if p.startswith("kernel"))
    need = {p: cpu_decode.weight_bytes(model, p) for p in candidates}
    fits = {p: n for p, n in need.items() if budget_bytes is None or n <= budget_bytes}
    report = {"bits": bits, "weight_bytes": need, "budget_bytes": budget_bytes}
    if path == "auto" and len(fits) > 1:
        rows = tuple(sorted({1, min(max_batch, cpu_decode.CHUNKED_MAX_ROWS)}))
        t0 = time.perf_counter()
        measured = measure(model, rows, tuple(fits), probe_seconds)
        report["probe"] = {"rows": rows, "seconds": time.perf_counter() - t0, "step_seconds": measured}
    else:
        measured = dict.fromkeys(fits or need, 0.0)
    chosen = cpu_decode.choose(measured, need, budget_bytes)
    report["path"] = chosen
    model = cpu_decode.apply_path(model, chosen)
    say(_summary(report))
    return model, report


def model_preparer(mode: str | None, path: str = "auto", budget_mb: float | None = None, max_batch: int = 1,
                   say=print):
    """`prepare` as a function of the model alone (what `lmforge generate --quantized` hands to
    generate_text), None without --quantized; budget_mb: MiB."""
    check_flags(mode, path, budget_mb)
    if mode is None:
        return None
    budget = None if budget_mb is None else int(budget_mb * 2**20)
    return lambda model: prepare(model, mode, path, budget, max_batch, say=say)[0]


def check_flags(mode: str | None, path: str, budget_mb: float | None) -> None:
    """--quant-path and --memory-budget-mb mean something only with --quantized."""
    if mode is None and (path != "auto" or budget_mb is not None):
        raise LmforgeError("--quant-path and --memory-budget-mb choose how --quantized weights run: give "
                           "--quantized int8, int4 or auto with them")


def _check_servable(model: nn.Module) -> None:
    from lmforge.finetune.lora import lora_layers

    param = next(model.parameters())
    if param.device.type != "cpu":
        raise LmforgeError(f"--quantized runs torch's CPU kernels; this model is on {param.device}: serve it "
                           "without --quantized, or on a CPU (--set device=cpu)")
    if lora_layers(model):
        raise LmforgeError("--quantized needs plain linear layers, and this run holds LoRA adapters: merge "
                           "them first (lmforge export RUN OUT --merge) and serve the merged run")


def _bits(model: nn.Module, mode: str) -> int:
    stored = cpu_decode.model_bits(model)
    if stored is not None:
        if mode != "auto" and int(mode[3:]) != stored:
            raise LmforgeError(f"--quantized {mode}: this run holds int{stored} weights (written by lmforge "
                               f"quantize); quantizing them again to {mode} would add a second rounding "
                               f"error: give --quantized int{stored} or auto, or serve the full-precision "
                               "run")
        return stored
    # auto: int8. Held for the int4 kernel, int4 weights take as much memory as int8 (the stored nibbles
    # and the kernel's repacked copy) and lose more accuracy; int4 saves disk, and is asked for by name.
    return 8 if mode == "auto" else int(mode[3:])


def _summary(r: dict) -> str:
    mb = 2**20
    text = (f"--quantized: int{r['bits']} weights on the {r['path']} path "
            f"({r['weight_bytes'][r['path']] / mb:.1f} MiB of weights"
            + (f", budget {r['budget_bytes'] / mb:.0f} MiB" if r["budget_bytes"] else "") + ")")
    if "probe" in r:
        p = r["probe"]
        parts = ", ".join(f"{k} {v * 1e3:.2f} ms ({r['weight_bytes'][k] / mb:.1f} MiB)"
                          for k, v in sorted(p["step_seconds"].items(), key=lambda kv: kv[1]))
        text += (f"\n--quantized: probe ({p['seconds']:.1f} s, quantized matmuls of one decode step at "
                 f"{' and '.join(map(str, p['rows']))} rows): {parts}")
    return text
