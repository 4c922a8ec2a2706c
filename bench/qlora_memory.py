"""QLoRA base weights: lmforge's NF4Linear vs bitsandbytes' Linear4bit (NF4, double quant), fp32 on CPU.

    .venv/bin/python bench/qlora_memory.py                      # ~4 minutes on 2 busy cores
    .venv/bin/python bench/qlora_memory.py --rounds 20 --mem-repeats 5 --threads 2
    .venv/bin/python bench/qlora_memory.py --json /tmp/qlora_memory.json

Cases (both sides quantise the same seeded fp32 nn.Linear weights, blocksize 64, compute dtype fp32):
  single  one Linear 2048 -> 5632 (a 1B-class MLP projection), 512 input tokens
  stack   a trainable Linear(1024, 1024) (standing in for LoRA's trainable part) followed by 4 frozen
          blocks of Linear(1024 -> 2816), GELU, Linear(2816 -> 1024); 256 tokens
A third side, "fp32", is the same stack of plain frozen nn.Linear layers, for scale.

Columns:
  bytes/param     quantised storage per base weight value: packed codes + uint8 block scales + fp32
                  level-2 scales + offset (bitsandbytes: the same tensors of its QuantState); bias excluded
  sd bytes/param  the same from the state dict (bitsandbytes also saves its two code tables and a JSON blob)
  same weight     whether both sides dequantise to identical weights (informational, never asserted)
  fwd+bwd ms      one forward + backward (loss = sum of squares; gradients w.r.t. the input / the trainable
                  layer only): --warmup untimed, then --rounds rounds, one call per side, the order rotating
                  every round; median per side, ratio = ours / bitsandbytes
  saved MiB       bytes autograd holds between forward and backward (torch.autograd.graph.saved_tensors_hooks,
                  unique storages not owned by the modules): what a QLoRA step keeps per layer
  peak MiB        peak RSS growth of one forward + backward, measured in a fresh process per side and repeat
                  (interleaved, --mem-repeats, median): warm-up step, glibc malloc_trim, reset the kernel's
                  RSS high-water mark (/proc/self/clear_refs = 5), one step, VmHWM minus the RSS before it.
                  RSS, not tracemalloc: tracemalloc does not see torch's allocations.
Never asserts: prints machine info and markdown tables (and writes JSON with --json).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lmforge.finetune.nf4 import NF4Linear
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

CASES = {
    "single": dict(layers=[(2048, 5632)], tokens=512, adapter=None),
    "stack": dict(layers=[(1024, 2816), (2816, 1024)] * 4, tokens=256, adapter=1024),
}
SIDES = ("ours", "bnb", "fp32")


def bnb_linear4bit(lin: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(
        lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=torch.float32,
        compress_statistics=True, quant_type="nf4",
    )  # fmt: skip
    layer.load_state_dict(lin.state_dict())
    return layer.to("cpu")  # the move is where Params4bit quantises


def is_bnb(module: nn.Module) -> bool:
    return type(module).__module__.startswith("bitsandbytes")  # Linear4bit subclasses nn.Linear


def build(case: str, side: str) -> tuple[nn.Module, list[nn.Module], torch.Tensor, float]:
    """(model, its frozen base layers, input, seconds spent quantising), the same weights for every side."""
    c = CASES[case]
    torch.manual_seed(0)
    linears = [nn.Linear(i, o) for i, o in c["layers"]]
    quant_s = 0.0
    bases: list[nn.Module] = []
    for lin in linears:
        t0 = time.perf_counter()
        if side == "ours":
            base = NF4Linear.from_linear(lin)
        elif side == "bnb":
            base = bnb_linear4bit(lin)
        else:
            base = lin
        quant_s += time.perf_counter() - t0
        bases.append(base.requires_grad_(False))  # Linear4bit leaves its bias trainable
    body: list[nn.Module] = []
    for k, base in enumerate(bases):
        body.append(base)
        if len(bases) > 1 and k % 2 == 0:
            body.append(nn.GELU())
    if c["adapter"]:
        body.insert(0, nn.Linear(c["adapter"], c["adapter"]))  # trainable
    x = torch.randn(c["tokens"], c["layers"][0][0], generator=torch.Generator().manual_seed(1))
    return nn.Sequential(*body), bases, x, quant_s


def fwd_bwd(model: nn.Module, x: torch.Tensor) -> None:
    xi = x if any(p.requires_grad for p in model.parameters()) else x.detach().requires_grad_()
    model(xi).square().sum().backward()
    model.zero_grad(set_to_none=True)


def storage_bytes(base: nn.Module) -> tuple[int, int]:
    """(quantised storage, state-dict bytes without the bias) of one base layer."""
    sd = sum(t.nbytes for k, t in base.state_dict().items() if k != "bias" and isinstance(t, torch.Tensor))
    if isinstance(base, NF4Linear):
        return base.storage_bytes(), sd
    if is_bnb(base):
        qs = base.weight.quant_state
        return base.weight.data.nbytes + qs.absmax.nbytes + qs.state2.absmax.nbytes + qs.offset.nbytes, sd
    return base.weight.nbytes, sd


def dequantized(base: nn.Module) -> torch.Tensor:
    if isinstance(base, NF4Linear):
        return base.dequantized_weight()
    if is_bnb(base):
        import bitsandbytes.functional as bf

        return bf.dequantize_4bit(base.weight.data, base.weight.quant_state)
    return base.weight.detach()


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    owned |= {b.weight.data.untyped_storage().data_ptr() for b in model if hasattr(b, "weight")}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in owned:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    xi = x if any(p.requires_grad for p in model.parameters()) else x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(xi)
    seen.pop(xi.untyped_storage().data_ptr(), None)  # the input exists anyway
    y.square().sum().backward()
    return sum(seen.values())


def status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return -1


def mem_worker(case: str, side: str, threads: int) -> None:
    """Fresh process: peak RSS growth of one steady-state forward + backward, one JSON line."""
    torch.set_num_threads(threads)
    model, _, x, _ = build(case, side)
    fwd_bwd(model, x)  # warm-up: thread pools, lazy kernels, the gradient buffers of the trainable layer
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    before = status_bytes("VmRSS")
    fwd_bwd(model, x)
    print(json.dumps(dict(before=before, peak=status_bytes("VmHWM"))))


def measure_peak(case: str, repeats: int, threads: int) -> dict[str, float]:
    growth: dict[str, list[int]] = {s: [] for s in SIDES}
    for r in range(repeats):
        for side in SIDES[r % 3 :] + SIDES[: r % 3]:
            cmd = [sys.executable, __file__, "--mem-worker", case, side, "--threads", str(threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            m = json.loads(out.stdout.strip().splitlines()[-1])
            growth[side].append(m["peak"] - m["before"])
    return {s: statistics.median(v) / 2**20 for s, v in growth.items()}


def run_case(case: str, args) -> dict:
    built = {s: build(case, s) for s in SIDES}
    res: dict = {"case": case, "sides": {}}
    for side, (model, bases, x, quant_s) in built.items():
        n = sum(b.in_features * b.out_features for b in bases)
        store, sd = (sum(v) for v in zip(*(storage_bytes(b) for b in bases)))
        res["sides"][side] = dict(
            params=n, bytes_per_param=store / n, sd_bytes_per_param=sd / n, quantize_s=quant_s,
            saved_mib=saved_bytes(model, x) / 2**20, times=[],
        )  # fmt: skip
    res["same_weight"] = all(
        torch.equal(dequantized(a), dequantized(b)) for a, b in zip(built["ours"][1], built["bnb"][1])
    )
    for _ in range(args.warmup):
        for model, _, x, _ in built.values():
            fwd_bwd(model, x)
    for r in range(args.rounds):
        for side in SIDES[r % 3 :] + SIDES[: r % 3]:
            model, _, x, _ = built[side]
            t0 = time.perf_counter()
            fwd_bwd(model, x)
            res["sides"][side]["times"].append(time.perf_counter() - t0)
    for side in SIDES:
        res["sides"][side]["ms_median"] = 1e3 * statistics.median(res["sides"][side]["times"])
    if args.mem_repeats:
        for side, mib in measure_peak(case, args.mem_repeats, args.threads).items():
            res["sides"][side]["peak_mib"] = mib
    o, b = res["sides"]["ours"], res["sides"]["bnb"]
    res["time_ratio"] = o["ms_median"] / b["ms_median"]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mem-repeats", type=int, default=3, help="fresh processes per side, peak RSS (0: skip)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    p.add_argument("--mem-worker", nargs=2, metavar=("CASE", "SIDE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mem_worker:
        mem_worker(*args.mem_worker, args.threads)
        return
    torch.set_num_threads(args.threads)
    import bitsandbytes

    info = machine_info(threads=args.threads, bitsandbytes=bitsandbytes.__version__)
    print(json.dumps(info))
    results = [run_case(c, args) for c in args.cases]
    headers = ["case", "side", "bytes/param", "sd bytes/param", "quantise s", "fwd+bwd ms", "saved MiB"]
    headers.append("peak MiB")
    rows = []
    for r in results:
        for side, s in r["sides"].items():
            peak = f"{s['peak_mib']:.1f}" if "peak_mib" in s else "-"
            rows.append([
                r["case"], side, f"{s['bytes_per_param']:.6f}", f"{s['sd_bytes_per_param']:.6f}",
                f"{s['quantize_s']:.3f}", f"{s['ms_median']:.1f}", f"{s['saved_mib']:.2f}", peak,
            ])  # fmt: skip
    print()
    print_markdown_table(headers, rows)
    print()
    print_markdown_table(
        ["case", "params", "same dequantised weight", "fwd+bwd ratio ours / bnb"],
        [[r["case"], str(r["sides"]["ours"]["params"]), str(r["same_weight"]), f"{r['time_ratio']:.2f}"]
         for r in results],
    )  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(machine=info, args=vars(args) | {"json": str(args.json)},
                                             results=results), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
