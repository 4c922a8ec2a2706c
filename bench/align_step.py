"""Time and memory of one DPO step and one GRPO iteration, phase by phase, with the reference model's
cost shown on its own line.

    .venv/bin/python bench/align_step.py                          # demo-sized model, LoRA and full, ~2 min
    .venv/bin/python bench/align_step.py --preset small --rounds 5 --json bench/results/align_step.json
    .venv/bin/python bench/align_step.py --device cuda --preset 1b  # on a GPU

The model is lmforge's Transformer with seeded random weights (the costs do not depend on what it has
learned); data are seeded random token ids. Both methods train the same model:
  lora  rank-16 adapters on every linear layer; the reference is the same model with its adapters
        disabled (no extra weights)
  full  every weight trains; the reference is a frozen copy (one more model in memory)

DPO step (`--pairs` pairs of `--seq` tokens, the last `--completion` of each the completion):
  reference   the reference model's summed completion log-probs (no gradients): Preference.batch_of
  policy      forward + backward of the DPO loss and the AdamW update: lmforge's train_step
GRPO iteration (`--prompts` prompts of `--prompt-len` tokens, `--group` completions each, exactly
`--new-tokens` new tokens: no stop token is ever sampled, so every round does the same work):
  generate    sampling through the KV cache (models.generation.sample_replies, one batch)
  reference   the reference model's per-token log-probs of the completions (rl.beta > 0)
  policy      forward + backward of the GRPO loss (token-mean) and the AdamW update
Each phase is timed --rounds times after one warm-up round; medians are reported.

Memory (bytes, exact from the tensors): weights, trainable gradients, AdamW state, the reference's
own weights (0 for LoRA), and the KV cache of a GRPO batch. On CUDA also the peak allocated memory
of each phase (torch.cuda.max_memory_allocated, reset before it). Never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import lmforge.finetune.rollout as rollout_mod
from lmforge.config.schema import FinetuneConfig, ModelConfig, RLConfig
from lmforge.data.batch import IGNORE_INDEX, PreferenceBatch, PromptBatch
from lmforge.engine.loss import logits_of
from lmforge.engine.objectives import PolicyGradient, Preference
from lmforge.engine.precision import Precision
from lmforge.engine.preference_loss import token_logps
from lmforge.engine.step import train_step
from lmforge.finetune.lora import adapters_disabled
from lmforge.finetune.setup import apply_finetune
from lmforge.models import build_model
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

PRESETS = {
    "demo": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4160, max_seq_len=256),
    "small": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=8192, max_seq_len=512),
    "1b": dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000, max_seq_len=2048),
}
MiB = 2**20


class Decoder:
    def decode(self, ids):
        return " ".join(map(str, ids))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / MiB if device.type == "cuda" else None
    return out, (time.perf_counter() - t0) * 1000, peak


def setup(args, method: str, device: torch.device):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**PRESETS[args.preset]), device=device)
    frozen = None
    if method == "lora":
        apply_finetune(model, FinetuneConfig(method="lora", r=16, alpha=32, targets=["all-linear"]), seed=0)

        def reference(ids, targets):
            with adapters_disabled(model):
                return token_logps(logits_of(model(ids)), targets)
    else:
        frozen = build_model(ModelConfig(**PRESETS[args.preset]), device=device).requires_grad_(False)
        frozen.load_state_dict(model.state_dict())

        def reference(ids, targets):
            return token_logps(logits_of(frozen(ids)), targets)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=0.0)
    return model, frozen, reference, trainable, opt


def state_memory(model, frozen, trainable, opt) -> dict:
    return {
        "weights_mib": nbytes(model.parameters()) / MiB,
        "grads_mib": nbytes(trainable) / MiB,
        "adamw_mib": nbytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)) / MiB,
        "reference_mib": (nbytes(frozen.parameters()) / MiB) if frozen is not None else 0.0,
    }


def dpo(args, method: str, device: torch.device) -> dict:
    model, frozen, reference, trainable, opt = setup(args, method, device)
    obj = Preference(reference=lambda b: reference(b.input_ids, b.targets).sum(-1))
    precision = Precision(args.precision, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, PRESETS[args.preset]["vocab_size"], (2 * args.pairs, args.seq), generator=g)
    targets = torch.full_like(ids, IGNORE_INDEX)
    start = args.seq - args.completion - 1
    targets[:, start:-1] = ids[:, start + 1 :]
    raw = PreferenceBatch(ids, targets, real_tokens=ids.numel()).to(device)
    times: dict[str, list[float]] = {"reference": [], "policy": []}
    peaks: dict[str, float | None] = {}
    for r in range(args.rounds + 1):
        batch, t_ref, p_ref = timed(lambda: obj.batch_of(raw), device)
        _, t_pol, p_pol = timed(lambda b=batch: train_step(model, [b], opt, precision, objective=obj), device)
        if r:
            times["reference"].append(t_ref)
            times["policy"].append(t_pol)
        peaks = {"reference": p_ref, "policy": p_pol}
    return dict(times=times, peaks=peaks, memory=state_memory(model, frozen, trainable, opt))


def grpo(args, method: str, device: torch.device) -> dict:
    model, frozen, reference, trainable, opt = setup(args, method, device)
    vocab = PRESETS[args.preset]["vocab_size"]
    rl = RLConfig(group_size=args.group, max_new_tokens=args.new_tokens, beta=0.04, rewards={"format": 1.0})
    stop = vocab  # an id past the output layer: never sampled, so every row makes --new-tokens tokens
    times: dict[str, list[float]] = {"generate": [], "reference": [], "policy": []}
    clock: dict[str, float] = {}
    sample = rollout_mod.sample_replies
    merged = rollout_mod.merged_for_inference

    def timed_sample(*a, **k):
        out, clock["generate"], clock["generate_peak"] = timed(lambda: sample(*a, **k), device)
        return out

    @contextlib.contextmanager
    def timed_merge(m):
        """generate: the adapters' merge and unmerge around sampling count too (--no-merge: none)."""
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with contextlib.nullcontext() if args.no_merge else merged(m):
            yield
        if device.type == "cuda":
            torch.cuda.synchronize()
        clock["generate"] = (time.perf_counter() - t0) * 1000

    def timed_reference(ids, targets):
        out, clock["reference"], clock["reference_peak"] = timed(lambda: reference(ids, targets), device)
        return out

    rollout_mod.sample_replies = timed_sample
    rollout_mod.merged_for_inference = timed_merge
    try:
        roll = rollout_mod.Rollout(model, Decoder(), {stop}, rl, PRESETS[args.preset]["max_seq_len"],
                                   reference=timed_reference)
        obj = PolicyGradient(beta=rl.beta, rollout=roll)
        precision = Precision(args.precision, device)
        g = torch.Generator().manual_seed(2)
        prompts = tuple(tuple(torch.randint(2, vocab - 1, (args.prompt_len,), generator=g).tolist())
                        for _ in range(args.prompts))
        peaks: dict[str, float | None] = {}
        for r in range(args.rounds + 1):
            batch = obj.batch_of(PromptBatch(prompts, tuple({"answer": "1"} for _ in prompts), seed=r))
            new = int((batch.targets != IGNORE_INDEX).sum(-1).float().mean())
            step = lambda b=batch: train_step(model, [b], opt, precision, objective=obj)  # noqa: E731
            _, t_pol, p_pol = timed(step, device)
            if r:
                times["generate"].append(clock["generate"])
                times["reference"].append(clock["reference"])
                times["policy"].append(t_pol)
            peaks = {"generate": clock["generate_peak"], "reference": clock["reference_peak"],
                     "policy": p_pol}
    finally:
        rollout_mod.sample_replies = sample
        rollout_mod.merged_for_inference = merged
    cfg = model.cfg
    rows = args.prompts * args.group
    head_dim = cfg.d_model // cfg.n_heads
    kv = 2 * cfg.n_layers * rows * (args.prompt_len + args.new_tokens) * cfg.n_kv_heads * head_dim
    mem = state_memory(model, frozen, trainable, opt)
    mem["kv_cache_mib"] = kv * next(model.parameters()).element_size() / MiB
    return dict(times=times, peaks=peaks, memory=mem, new_tokens_per_row=new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-merge", action="store_true", help="GRPO: sample with the LoRA adapters unmerged "
                    "(lmforge folds them into the weights while sampling)")
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--completion", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    machine = machine_info(threads=torch.get_num_threads(), preset=args.preset, device=str(device))
    print(json.dumps(machine))
    results = {}
    for method in args.methods.split(","):
        results[method] = {"dpo": dpo(args, method, device), "grpo": grpo(args, method, device)}
    rows = []
    for method, res in results.items():
        for kind, r in res.items():
            med = {k: statistics.median(v) for k, v in r["times"].items()}
            total = sum(med.values())
            for phase, ms in med.items():
                peak = r["peaks"].get(phase)
                rows.append([method, kind, phase, f"{ms:,.1f}", f"{ms / total:.0%}",
                             "-" if peak is None else f"{peak:,.0f}"])
            rows.append([method, kind, "total", f"{total:,.1f}", "100%", ""])
    print(f"\n{args.preset}: DPO {args.pairs} pairs x {args.seq} tokens; GRPO {args.prompts} prompts x "
          f"{args.group} completions x {args.new_tokens} new tokens (prompt {args.prompt_len}); {device}, "
          f"{args.precision}, median of {args.rounds}\n")
    print_markdown_table(["method", "step", "phase", "ms", "share", "peak MiB"], rows)
    mem_rows = []
    for method, res in results.items():
        m = dict(res["dpo"]["memory"])
        m["kv_cache_mib"] = res["grpo"]["memory"]["kv_cache_mib"]
        mem_rows.append([method, *(f"{m[k]:,.1f}" for k in ("weights_mib", "grads_mib", "adamw_mib",
                                                           "reference_mib", "kv_cache_mib"))])
    print()
    print_markdown_table(["method", "weights MiB", "grads MiB", "AdamW MiB", "reference MiB",
                          "GRPO KV cache MiB"], mem_rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(machine=machine, command=" ".join(sys.argv), args=vars(args),
                                             results=results), indent=1, default=str))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
