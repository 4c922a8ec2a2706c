"""One QLoRA training step: lmforge (NF4 base + LoRA) vs transformers + bitsandbytes 4-bit + PEFT.

    python bench/qlora_step.py                  # --preset gpu on CUDA: Llama ~1.1B, batch 4 x 2048
    python bench/qlora_step.py --preset cpu     # the small CPU shape of bench/lora_step.py (slow)
    python bench/qlora_step.py --compile --json /tmp/qlora_step.json

Model: the Llama-layout shapes of bench/lora_step.py (gpu: d_model 2048, 16 layers, ff 5632, vocab
32000; batch 4 x 2048). Both sides start from the same seeded lmforge model, written as a Hugging Face
dir with `to_hf`, in bf16 (fp32 on CPU):
  lmforge  `quantize_model_nf4` (every block linear to NF4, blocksize 64, double quantisation, compute
           dtype bf16), then `apply_lora(model, ["all-linear"], r=16, alpha=32)`; the engine's
           `train_step` with `CausalLM()`
  bnb      `LlamaForCausalLM.from_pretrained(dir, quantization_config=BitsAndBytesConfig(load_in_4bit,
           nf4, double quant, compute dtype bf16))` (lm_head left unquantised, as lmforge leaves `output`),
           then `get_peft_model` with LoRA r 16 / alpha 32 on q/k/v/o/gate/up/down; `loss.backward()`
Neither uses gradient checkpointing. Both: AdamW (fused on CUDA) over the adapters, lr 1e-4.

Reported per side: base bytes per quantised weight (codes + scales), the model's resident bytes after
building (parameters + buffers: what the GPU holds before any step), the peak of one step above that
(torch.cuda.max_memory_allocated minus memory_allocated at the step's start: activations, adapter
gradients and optimizer state, temporaries), their sum, and the median ms per step (--warmup steps,
then --repeats rounds, one step per side, the order alternating). Never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.objectives import CausalLM, ObjectiveModule
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.finetune.lora import apply_lora
from lmforge.finetune.nf4 import NF4Linear, quantize_model_nf4
from lmforge.models import build_model
from lmforge.models.hf import to_hf
from lora_step import ALPHA, HF_TARGETS, LR, PRESETS, R, model_config, sync  # bench/lora_step.py
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)


def resident(model: torch.nn.Module) -> int:
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())


def build(args, device: torch.device):
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    p = PRESETS[args.preset]
    dtype = p["dtype"] if device.type == "cuda" else torch.float32
    cfg = model_config(p)
    torch.manual_seed(0)
    src = build_model(cfg, "cpu").to(dtype)
    tmp = tempfile.TemporaryDirectory()
    to_hf(src, tmp.name)

    sides = {}
    torch.cuda.empty_cache() if device.type == "cuda" else None
    ours = src.to(device)
    stats = quantize_model_nf4(ours, compute_dtype=dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    apply_lora(ours, ["all-linear"], r=R, alpha=ALPHA, dropout=0.0)
    ours.train()
    sides["lmforge"] = dict(model=ours, bytes_per_param=stats["bytes_per_param"], quantized=stats["params"])

    qcfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=torch.uint8,
    )
    hf = LlamaForCausalLM.from_pretrained(
        tmp.name,
        quantization_config=qcfg,
        dtype=dtype,
        device_map={"": device.index or 0} if device.type == "cuda" else "cpu",
    )
    tmp.cleanup()
    peft_model = get_peft_model(
        hf,
        LoraConfig(
            r=R,
            lora_alpha=ALPHA,
            target_modules=HF_TARGETS,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )
    peft_model.train()
    qbytes = qparams = 0
    for m in hf.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            qparams += int(torch.Size(qs.shape).numel())
            qbytes += m.weight.nbytes + qs.absmax.nbytes + qs.state2.absmax.nbytes + qs.offset.nbytes
    sides["bnb"] = dict(model=peft_model, bytes_per_param=qbytes / qparams, quantized=qparams)
    for s in sides.values():
        s["resident"] = resident(s["model"])
    return sides, cfg, p


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sides, cfg, p = build(args, device)
    B, T = p["batch"], p["seq_len"]
    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(4):
        x = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
        y = torch.full_like(x, IGNORE_INDEX)
        y[:, :-1] = x[:, 1:]
        batches.append(TokenBatch(x.to(device), y.to(device)))
    objective = CausalLM()
    precision = Precision("fp32", device)
    fused = device.type == "cuda"

    ours = sides["lmforge"]["model"]
    opt_ours = torch.optim.AdamW(
        [q for q in ours.parameters() if q.requires_grad], lr=LR, weight_decay=0.0, fused=fused
    )
    forward = torch.compile(ObjectiveModule(ours, objective)) if args.compile else None
    sides["lmforge"]["step"] = lambda i: (
        train_step(ours, [batches[i % 4]], opt_ours, precision, objective=objective, forward=forward).loss
    )
    peft_model = sides["bnb"]["model"]
    opt_bnb = torch.optim.AdamW(
        [q for q in peft_model.parameters() if q.requires_grad], lr=LR, weight_decay=0.0, fused=fused
    )
    call = torch.compile(peft_model) if args.compile else peft_model

    def bnb_step(i: int) -> float:
        x = batches[i % 4].input_ids
        loss = call(input_ids=x, labels=x).loss
        loss.backward()
        opt_bnb.step()
        opt_bnb.zero_grad(set_to_none=True)
        return loss.item()

    sides["bnb"]["step"] = bnb_step
    names = list(sides)
    times = {k: [] for k in names}
    peaks = {k: [] for k in names}
    losses = {k: [] for k in names}
    for i in range(args.warmup):
        for k in names:
            losses[k].append(sides[k]["step"](i))
    for r in range(args.repeats):
        for k in names if r % 2 == 0 else names[::-1]:
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            losses[k].append(sides[k]["step"](args.warmup + r))
            sync(device)
            times[k].append(time.perf_counter() - t0)
            if device.type == "cuda":
                peaks[k].append(torch.cuda.max_memory_allocated(device) - before)
    res = dict(preset=args.preset, device=str(device), batch=B, seq_len=T, compile=args.compile, sides={})
    for k in names:
        s = sides[k]
        res["sides"][k] = dict(
            bytes_per_param=s["bytes_per_param"],
            quantized_weights=s["quantized"],
            resident=s["resident"],
            step_peak=statistics.median(peaks[k]) if peaks[k] else None,
            median_ms=1e3 * statistics.median(times[k]),
            losses=losses[k],
        )
    res["ratio"] = res["sides"]["bnb"]["median_ms"] / res["sides"]["lmforge"]["median_ms"]
    res["nf4_layers_lmforge"] = sum(isinstance(m, NF4Linear) for m in ours.modules())
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import bitsandbytes
    import peft
    import transformers

    extra = dict(
        transformers=transformers.__version__, peft=peft.__version__, bitsandbytes=bitsandbytes.__version__
    )
    if torch.cuda.is_available():
        extra["gpu"] = torch.cuda.get_device_name()
    info = machine_info(**extra)
    print(f"machine: {info}", flush=True)
    res = run(args)
    mib = lambda n: "" if n is None else f"{n / 2**20:.0f}"  # noqa: E731
    rows = []
    for k, v in res["sides"].items():
        total = None if v["step_peak"] is None else v["resident"] + v["step_peak"]
        rows.append(
            [
                k,
                f"{v['quantized_weights']:,}",
                f"{v['bytes_per_param']:.4f}",
                mib(v["resident"]),
                mib(v["step_peak"]),
                mib(total),
                f"{v['median_ms']:.1f}",
            ]
        )
    print(
        f"\npreset {res['preset']} on {res['device']}: batch {res['batch']} x {res['seq_len']}, LoRA r {R} "
        f"on all 7 linear kinds, {args.repeats} interleaved rounds"
        + (", torch.compile" if args.compile else "")
    )
    print_markdown_table(
        ["side", "NF4 weights", "bytes/weight", "resident MiB", "step peak MiB", "total MiB", "ms/step"], rows
    )
    ours, theirs = res["sides"]["lmforge"]["losses"], res["sides"]["bnb"]["losses"]
    print(
        f"speed (bnb ms / lmforge ms): {res['ratio']:.3f}; losses first {ours[0]:.4f} / {theirs[0]:.4f}, "
        f"last {ours[-1]:.4f} / {theirs[-1]:.4f}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(dict(machine=info, command=" ".join(sys.argv), results=res), indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
