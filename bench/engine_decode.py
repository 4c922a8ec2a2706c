"""Decode throughput of `lmforge serve`'s engine (continuous batching, no HTTP) against transformers'
`generate` on the same weights, prompts and batch: the serve tokens/s row of the GPU suite.

    .venv/bin/python bench/engine_decode.py --preset tiny --device cpu      # seconds; what the tests run
    .venv/bin/python bench/engine_decode.py --preset gpu                    # Llama 1.1B shape, bf16, CUDA

Model: a Llama-layout lmforge Transformer built with `build_model` and written to a Hugging Face dir with
`lmforge.models.hf.to_hf`, loaded by `LlamaForCausalLM.from_pretrained` (their fp32 logits checked to 1e-4
first), both then cast to the preset's dtype. Presets:

  tiny  d_model 64, 2 layers, 4 heads, 2 kv heads, d_ff 176, vocab 256, fp32; prompts 16, new tokens 16
  gpu   d_model 2048, 22 layers, 32 heads, 4 kv heads, d_ff 5632, vocab 32000 (TinyLlama 1.1B's shape),
        bf16; prompts 128, new tokens 128

For each batch size B (--batches): B random prompts of the same length, greedy, exactly --new tokens per
sequence (no stop token: the engine's stop ids are empty, transformers' eos_token_id None). lmforge:
`Engine(model, max_batch_size=B).generate(prompts, SamplingParams(max_tokens=new, temperature=0))`, all
B submitted at once, so the time includes the B prefills and the decode steps (the engine prefills each
prompt alone and decodes every running row together). transformers: `model.generate(input_ids (B, L),
max_new_tokens=new, min_new_tokens=new, do_sample=False)` (its default dynamic cache, SDPA). Rounds
alternate the order; reported: median generated tokens/s (B x new / wall), ratio = lmforge /
transformers (> 1: lmforge faster), and how many sequences' greedy tokens agree (bf16 sums may differ
between two implementations: reported, not asserted). Neither side is compiled. Writes --json with the
machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lmforge.config import ModelConfig  # noqa: E402
from lmforge.models import build_model  # noqa: E402
from lmforge.models.hf import to_hf  # noqa: E402
from lmforge.serve.engine import Engine, SamplingParams  # noqa: E402
from machine import machine_info, print_markdown_table  # noqa: E402  (bench/machine.py)

PRESETS = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=176, vocab=256, prompt=16, new=16,
                 dtype=torch.float32, batches=[1, 4]),
    "gpu": dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, vocab=32000, prompt=128,
                new=128, dtype=torch.bfloat16, batches=[1, 16, 64]),
}


def model_config(p: dict) -> ModelConfig:
    return ModelConfig(
        vocab_size=p["vocab"], d_model=p["d_model"], n_layers=p["n_layers"], n_heads=p["n_heads"],
        n_kv_heads=p["n_kv_heads"], d_ff=p["d_ff"], max_seq_len=2 * (p["prompt"] + p["new"]), norm="rmsnorm",
        norm_eps=1e-5, pos_embedding="rope", rope_theta=10000.0, mlp="swiglu", bias=False, qkv_bias=False,
        tie_embeddings=False, dropout=0.0,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(p: dict, device: torch.device):
    from transformers import LlamaForCausalLM

    cfg = model_config(p)
    torch.manual_seed(0)
    ours = build_model(cfg, device).eval()
    with tempfile.TemporaryDirectory() as tmp:
        to_hf(ours, tmp)
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(device).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        diff = float((ours(x).float() - hf(input_ids=x).logits.float()).abs().max())
    print(f"logit check (fp32): max |lmforge - transformers| = {diff:.2e}")
    if not diff <= 1e-4:
        raise SystemExit(f"the two models disagree (max logit diff {diff:.2e} > 1e-4): timing them is moot")
    return ours.to(p["dtype"]), hf.to(p["dtype"]), diff


def as_text(ids: list[int]) -> str:
    """One character per token id (the engine decodes its rows' tokens every step, as with a tokenizer):
    the text says exactly which tokens were generated."""
    return "".join(chr(0x100 + t) for t in ids)


def run_ours(engine: Engine, prompts: list[list[int]], new: int, device) -> tuple[float, list[list[int]]]:
    texts = [""] * len(prompts)
    left = [len(prompts)]
    finished = threading.Event()
    errors: list[str] = []

    def on_event(ev) -> None:
        if ev.error is not None:
            errors.append(ev.error)
            finished.set()
            return
        texts[ev.index] += ev.text
        if ev.finish_reason is not None:
            left[0] -= 1
            if left[0] == 0:
                finished.set()

    sync(device)
    t0 = time.perf_counter()
    engine.submit(prompts, SamplingParams(max_tokens=new, temperature=0.0), on_event)
    if not finished.wait(600) or errors:
        raise SystemExit(f"the engine failed or did not finish within 600 s: {errors}")
    sync(device)
    return time.perf_counter() - t0, [[ord(c) - 0x100 for c in t] for t in texts]


@torch.no_grad()
def run_hf(hf, prompts: list[list[int]], new: int, device) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                      min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the preset's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else p["batches"]
    ours, hf, diff = build(p, device)
    gen = torch.Generator().manual_seed(1)
    results = {}
    for B in batches:
        prompts = torch.randint(0, p["vocab"], (B, p["prompt"]), generator=gen).tolist()
        with Engine(ours, as_text, max_batch_size=B) as engine:
            # warm-up, a whole untimed round: allocator, kernels, the cache at full length (a 2-token one
            # left the first timed round 2-5x slower on an H200, 2026-11-29)
            run_ours(engine, prompts, p["new"], device)
            run_hf(hf, prompts, p["new"], device)
            t_ours, t_hf = [], []
            for r in range(args.rounds):
                order = ["ours", "hf"] if r % 2 == 0 else ["hf", "ours"]
                for side in order:
                    if side == "ours":
                        t, toks_ours = run_ours(engine, prompts, p["new"], device)
                        t_ours.append(t)
                    else:
                        t, toks_hf = run_hf(hf, prompts, p["new"], device)
                        t_hf.append(t)
            agree = sum(a == b for a, b in zip(toks_ours, toks_hf))
        n = B * p["new"]
        ours_tps, hf_tps = n / statistics.median(t_ours), n / statistics.median(t_hf)
        results[B] = dict(lmforge_tok_s=ours_tps, transformers_tok_s=hf_tps, ratio=ours_tps / hf_tps,
                          agree=agree, sequences=B, lmforge_s=t_ours, transformers_s=t_hf)
        print(f"batch {B}: lmforge {ours_tps:.0f} tok/s, transformers {hf_tps:.0f} tok/s, "
              f"ratio {ours_tps / hf_tps:.2f}x, greedy agreement {agree}/{B}", flush=True)
    info = machine_info(preset=args.preset, device=str(device), dtype=str(p["dtype"]), prompt=p["prompt"],
                        new=p["new"], rounds=args.rounds, max_logit_diff=diff)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    print_markdown_table(["batch", "lmforge tok/s", "transformers tok/s", "ratio", "greedy agree"],
                         [[str(B), f"{r['lmforge_tok_s']:.0f}", f"{r['transformers_tok_s']:.0f}",
                           f"{r['ratio']:.2f}x", f"{r['agree']}/{B}"] for B, r in results.items()])
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
