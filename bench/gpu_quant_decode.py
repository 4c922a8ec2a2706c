"""Greedy decode tokens/s of lmforge's weight-only quantized layers on a GPU: bf16 vs int8 vs int4, and
transformers' `generate` on the same bf16 weights: the quantized-decode row of the GPU suite.

    .venv/bin/python bench/gpu_quant_decode.py --preset tiny --device cpu     # seconds; what the tests run
    .venv/bin/python bench/gpu_quant_decode.py --preset gpu                   # Llama 1.1B shape, CUDA

Model: the Llama-layout lmforge Transformer of bench/engine_decode.py (built with `build_model`, written
with `to_hf` and loaded by `LlamaForCausalLM.from_pretrained`, fp32 logits checked to 1e-4), both cast
to the preset's dtype. Variants, all on the same weights:

  bf16          the lmforge model as it is (the preset's dtype: fp32 on the tiny CPU preset)
  int8          its block linear layers quantized in memory as `lmforge quantize --method rtn` writes
                them (QuantLinear, int8 per output channel; cpu_decode.quantize_in_memory)
  int4          the same, int4 in symmetric groups (128 where every layer's inputs allow it)
  transformers  `LlamaForCausalLM.generate` (its default dynamic cache, SDPA), the competitor

On CUDA, QuantLinear has no int kernel: every call dequantizes its weight to the activations' dtype and
runs F.linear (its reference path; torch's int8/int4 kernels it uses on a CPU are CPU ones, and `lmforge
serve --quantized` refuses a CUDA model). So this row measures what a quantized run costs on a GPU
today: the weights take 1/2 (int8) or ~1/4 (int4) of bf16's memory, and each step pays a dequantize.

Measured: for each batch B (--batches), B random prompts of --prompt tokens, a prefill and exactly --new
greedy tokens (no stop token), wall time of all of it (synchronized); tokens/s = B x new / wall. The
lmforge variants decode with the model's KVCache in a plain loop (what the serving engine runs per step,
without its scheduling); transformers with `generate(min_new_tokens=max_new_tokens=new)`. Variants
interleaved round by round, the order reversed every other round; medians over --rounds. Reported too:
each variant's weight bytes, and how many sequences' greedy tokens equal the bf16 model's (quantization
changes some: reported, not asserted). Neither side is compiled. Writes --json with the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from engine_decode import build, sync  # noqa: E402  (bench/engine_decode.py: the same model and check)
from lmforge.compress import cpu_decode  # noqa: E402
from lmforge.models.common.attention import KVCache  # noqa: E402
from machine import machine_info, print_markdown_table  # noqa: E402  (bench/machine.py)

PRESETS = {
    # d_ff 192: int4 groups need a size in cpu_decode.INT4_GROUPS dividing every layer's inputs (64 here)
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, vocab=256, prompt=16, new=8,
                 dtype=torch.float32, batches=[1, 2]),
    "gpu": dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, vocab=32000, prompt=128,
                new=64, dtype=torch.bfloat16, batches=[1, 8]),
}
TARGETS = ["layers.*"]  # the block linear layers (QuantConfig's default targets): the head stays dense


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (the int weights, scales and the dense rest)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def quantized(model: torch.nn.Module, bits: int) -> torch.nn.Module:
    q = copy.deepcopy(model)
    cpu_decode.quantize_in_memory(q, bits, TARGETS)
    return q.eval()


@torch.no_grad()
def run_ours(model, prompts: torch.Tensor, new: int, device) -> tuple[float, list[list[int]]]:
    """Prefill + `new` greedy steps of every row at once; (seconds, the generated ids)."""
    B, L = prompts.shape
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    sync(device)
    t0 = time.perf_counter()
    cache = KVCache(model, B, L + new, device=device, dtype=dtype)
    nxt = model(prompts, cache=cache)[:, -1].argmax(-1, keepdim=True)
    out = [nxt]
    for _ in range(new - 1):
        nxt = model(nxt, cache=cache)[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
    ids = torch.cat(out, dim=1)
    sync(device)
    return time.perf_counter() - t0, ids.tolist()


@torch.no_grad()
def run_hf(hf, prompts: torch.Tensor, new: int, device) -> tuple[float, list[list[int]]]:
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                      min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t0, out[:, prompts.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the preset's)")
    ap.add_argument("--new", type=int, default=None, help="tokens generated per sequence (default: the "
                    "preset's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    new = args.new or p["new"]
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else p["batches"]
    base, hf, diff = build(dict(p, new=new), device)
    sides = {"bf16": base, "int8": quantized(base, 8), "int4": quantized(base, 4)}
    nbytes = {n: weight_bytes(m) for n, m in sides.items()}
    nbytes["transformers"] = weight_bytes(hf)
    group4 = next(m.group_size for m in cpu_decode.quantized_layers(sides["int4"]).values())
    gen = torch.Generator().manual_seed(1)
    results = {}
    for B in batches:
        prompts = torch.randint(0, p["vocab"], (B, p["prompt"]), generator=gen).to(device)
        names = [*sides, "transformers"]
        # warm-up, a whole untimed round: allocator, kernels, the first dequantize, the cache at full length
        # (a 2-token warm-up left the first timed round 3-5x slower on an H200, 2026-11-29)
        for n in names:
            if n == "transformers":
                run_hf(hf, prompts, new, device)
            else:
                run_ours(sides[n], prompts, new, device)
        times = {n: [] for n in names}
        toks = {}
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else reversed(names):
                if n == "transformers":
                    t, toks[n] = run_hf(hf, prompts, new, device)
                else:
                    t, toks[n] = run_ours(sides[n], prompts, new, device)
                times[n].append(t)
        row = {}
        for n in names:
            tps = B * new / statistics.median(times[n])
            row[n] = dict(tok_s=tps, seconds=times[n], agree_bf16=sum(a == b for a, b in zip(toks[n],
                                                                                          toks["bf16"])))
        for n in names:
            row[n]["vs_transformers"] = row[n]["tok_s"] / row["transformers"]["tok_s"]
            row[n]["vs_bf16"] = row[n]["tok_s"] / row["bf16"]["tok_s"]
        results[B] = row
        print(f"batch {B}: " + ", ".join(f"{n} {row[n]['tok_s']:.0f} tok/s" for n in names), flush=True)
    info = machine_info(preset=args.preset, device=str(device), dtype=str(p["dtype"]), prompt=p["prompt"],
                        new=new, rounds=args.rounds, max_logit_diff=diff, int4_group=group4)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    table = []
    for B, row in results.items():
        for n, r in row.items():
            table.append([str(B), n, f"{r['tok_s']:.0f}", f"{r['vs_bf16']:.2f}x",
                          f"{r['vs_transformers']:.2f}x", f"{nbytes[n] / 2**20:.0f}",
                          f"{r['agree_bf16']}/{B}"])
    print_markdown_table(["batch", "variant", "tok/s", "vs bf16", "vs transformers", "weights MiB",
                          "greedy = bf16"], table)
    print(f"{'bf16' if p['dtype'] == torch.bfloat16 else 'fp32'} activations; int4 groups of {group4}; "
          f"prompt {p['prompt']}, {new} new tokens; QuantLinear on {device.type}: "
          + ("dequantizes per call" if device.type != "cpu" else "torch's CPU int kernels"))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "weight_bytes": nbytes, "results": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
