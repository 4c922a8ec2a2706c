"""One LoRA training step: lmforge vs transformers + PEFT, same model, batch and adapter placement.

    .venv/bin/python bench/lora_step.py                        # --preset cpu, ~1 minute on 2 idle cores
    .venv/bin/python bench/lora_step.py --preset demo --loss-chunk-tokens 512 --repeats 40   # CPU target
    .venv/bin/python bench/lora_step.py --method full          # adds lmforge full fine-tuning for scale
    .venv/bin/python bench/lora_step.py --floor                # adds the no-adapter floor (the bound)
    .venv/bin/python bench/lora_step.py --preset gpu --compile # Llama ~1B, bf16 weights, on CUDA

Model: a Llama-layout lmforge Transformer (RMSNorm, RoPE, SwiGLU, no biases, untied embeddings) built
with `build_model`, written to a Hugging Face dir with `lmforge.models.hf.to_hf` and loaded with
`LlamaForCausalLM.from_pretrained`; their fp32 logits must agree to 1e-4 before anything is timed
(the max difference is printed). Presets:

  cpu  d_model 512, 8 layers, 8 heads, 4 kv heads, d_ff 1408, vocab 8192, batch 4 x 256, fp32, 2 threads
  demo the model and batch of scripts/sft_demo.sh: d_model 256, 4 layers, d_ff 704, vocab 4096, 16 x 128
  gpu  d_model 2048, 16 layers, 16 heads, 16 kv heads, d_ff 5632, vocab 32000, batch 4 x 2048, bf16 weights

Adapters: r 16, alpha 32, dropout 0 on q/k/v/o/gate/up/down of every block (lmforge:
`apply_lora(model, ["all-linear"])`; PEFT: `get_peft_model(hf, LoraConfig(target_modules=[...]))`),
fp32 adapter parameters on both sides (PEFT's autocast_adapter_dtype does the same over a bf16 base).
Over a bf16 base PEFT also computes the adapter path in fp32 (it casts x up); lmforge computes it in
the activations' dtype (bf16 here, as autocast computes any linear layer), fused into the base GEMM
(finetune/lora_fused.py, LoRALinearFn), with fp32 gradients on its fp32 A and B. PEFT's
lora_A start as a copy of ours (B = 0 on both), so both sides train the same function on the same
batches and their losses stay equal step after step (printed: the largest loss difference).

Step, both sides: forward, loss (mean over the B x (T-1) next-token targets), backward, AdamW step
(lr 1e-4, fused=False on CPU, fused=True on CUDA) over the trainable parameters only, zero_grad.
  lmforge  the engine step: `lmforge.engine.step.train_step(model, [TokenBatch(x, y)], opt, precision,
           objective=CausalLM())` (summed loss / target count; no clipping, but it computes the
           gradient norm it reports); with --compile the model and its loss compiled as one graph;
           with --loss-chunk-tokens N the chunked output projection + cross-entropy of
           `train.loss_chunk_tokens` (gradients computed in the forward, N tokens at a time).
  PEFT     `loss = peft_model(input_ids=x, labels=x).loss; loss.backward(); opt.step();
           opt.zero_grad(set_to_none=True); loss.item()`; with --compile, torch.compile(peft_model).
--method full adds a third side: lmforge with every parameter training (same weights, same engine
step), to show what LoRA saves (its matmul FLOPs are about 2/3 of full fine-tuning's).
--floor adds a side that bounds the ratio: the same lmforge model with NO adapters, every weight
frozen but the final norm's, its embedding output made to require grad so the backward still runs
through every block (the frozen GEMMs, attention, norms and loss both LoRA sides share): PEFT ms /
floor ms is the ratio adapters that cost nothing would give, and PEFT ms / (floor ms + the adapters'
matmul FLOPs at the machine's GEMM peak, a 1024^3 matmul measured after the rounds) the most a LoRA
step computing its adapters can give.

Method: --warmup steps per side, then --repeats rounds of one step per side, the order alternating
every round (the machines are shared and noisy). Reported: median ms/step, tokens/s (B x T input
tokens), ratio = PEFT median / lmforge median (> 1: lmforge faster), model TFLOP/s from
`adapter_flops_per_token`. Memory: on CPU, peak RSS growth is unreliable in one process, so the bytes
of parameters + gradients + optimizer state are counted (gradients: one per trainable parameter, in
its dtype; optimizer state: every tensor in the optimizer's state); on CUDA also the median of
torch.cuda.max_memory_allocated per step minus what was allocated when the step began (activations,
gradients and temporaries of that side alone). Never asserts on speed; prints machine info and tables
(and writes JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmforge.config.schema import ModelConfig
from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.objectives import CausalLM, ObjectiveModule
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.finetune.lora import apply_lora, lora_layers
from lmforge.models import build_model
from lmforge.models.flops import adapter_flops_per_token, flops_per_token
from lmforge.models.hf import to_hf
from lmforge.models.hf.llama import KEYS
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

PRESETS = {
    "cpu": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1408, vocab=8192, batch=4,
                seq_len=256, dtype=torch.float32),
    "demo": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=704, vocab=4096, batch=16,
                 seq_len=128, dtype=torch.float32),
    "gpu": dict(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, d_ff=5632, vocab=32000, batch=4,
                seq_len=2048, dtype=torch.bfloat16),
}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA, LR = 16, 32, 1e-4


def model_config(p: dict) -> ModelConfig:
    return ModelConfig(
        vocab_size=p["vocab"], d_model=p["d_model"], n_layers=p["n_layers"], n_heads=p["n_heads"],
        n_kv_heads=p["n_kv_heads"], d_ff=p["d_ff"], max_seq_len=p["seq_len"], norm="rmsnorm", norm_eps=1e-5,
        pos_embedding="rope", rope_theta=10000.0, mlp="swiglu", bias=False, qkv_bias=False,
        tie_embeddings=False, dropout=0.0,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_logits(ours: torch.nn.Module, hf: torch.nn.Module, cfg: ModelConfig, device: torch.device) -> float:
    """Max |logit difference| of the fp32 models on one small batch; exits when above 1e-4."""
    shape = (2, min(128, cfg.max_seq_len))
    x = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        a = ours(x)
        b = hf(input_ids=x).logits
    diff = float((a.float() - b.float()).abs().max())
    print(f"logit check (fp32, {shape[0]} x {shape[1]}): max |lmforge - transformers| = {diff:.2e}")
    if not diff <= 1e-4:
        raise SystemExit(f"the two models disagree (max logit diff {diff:.2e} > 1e-4): timing them is moot")
    return diff


def copy_lora_a(ours: torch.nn.Module, peft_model: torch.nn.Module) -> int:
    """PEFT's lora_A := ours (the input side is not permuted by the HF export; B is zero on both)."""
    theirs = dict(peft_model.named_modules())
    n = 0
    with torch.no_grad():
        for name, layer in lora_layers(ours).items():
            hf_name = KEYS.to_hf(name + ".weight").removesuffix(".weight")
            target = theirs[f"base_model.model.{hf_name}"]
            target.lora_A["default"].weight.copy_(layer.lora_A)
            assert not target.lora_B["default"].weight.any() and not layer.lora_B.any()
            n += 1
    return n


def adamw(params: list[torch.nn.Parameter], device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=device.type == "cuda")


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Counted bytes: every parameter, one gradient per trainable parameter, the optimizer's state."""
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    opt_state = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return dict(
        params=sum(p.nbytes for p in params),
        trainable_params=sum(p.numel() for p in trainable),
        grads=sum(p.nbytes for p in trainable),
        optimizer=opt_state,
    )


def build_sides(args, p: dict, cfg: ModelConfig, device: torch.device, batches: list) -> tuple[dict, dict]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    ours = build_model(cfg, device)  # fp32 for the logit check
    with tempfile.TemporaryDirectory() as tmp:
        to_hf(ours, tmp)
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(device)
    hf.train()
    info = dict(hf_attn_implementation=hf.config._attn_implementation)
    info["max_logit_diff"] = check_logits(ours, hf, cfg, device)
    floor = None
    if args.floor:
        floor = build_model(cfg, device)
        floor.load_state_dict(ours.state_dict())
        floor.to(p["dtype"]).train()
        for q in floor.parameters():
            q.requires_grad_(False)
        floor.norm.weight.requires_grad_(True)  # something for the optimizer; its gradient is negligible
        floor.tok_embeddings.register_forward_hook(lambda m, i, out: out.detach().requires_grad_())
    full = None
    if args.method == "full":
        full = build_model(cfg, device)
        full.load_state_dict(ours.state_dict())
        full.to(p["dtype"]).train()
    ours.to(p["dtype"]).train()
    hf.to(p["dtype"])

    torch.manual_seed(0)
    apply_lora(ours, ["all-linear"], r=R, alpha=ALPHA, dropout=0.0)
    peft_model = get_peft_model(hf, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=HF_TARGETS,
                                               lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    peft_model.train()
    info["adapted_layers"] = copy_lora_a(ours, peft_model)

    objective = CausalLM(chunk_tokens=args.loss_chunk_tokens)
    precision = Precision("fp32", device)  # no autocast: the weights themselves are in p["dtype"]

    def engine_side(model: torch.nn.Module, label: str):
        opt = adamw([q for q in model.parameters() if q.requires_grad], device)
        forward = torch.compile(ObjectiveModule(model, objective)) if args.compile else None

        def step(i: int) -> float:
            return train_step(model, [batches[i % len(batches)]], opt, precision, objective=objective,
                              forward=forward).loss

        return dict(label=label, model=model, opt=opt, step=step)

    def peft_side():
        opt = adamw([q for q in peft_model.parameters() if q.requires_grad], device)
        call = torch.compile(peft_model) if args.compile else peft_model

        def step(i: int) -> float:
            x = batches[i % len(batches)].input_ids
            loss = call(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        return dict(label="transformers+peft", model=peft_model, opt=opt, step=step)

    sides = {"lmforge": engine_side(ours, "lmforge LoRA (engine train_step)"), "peft": peft_side()}
    if full is not None:
        sides["full"] = engine_side(full, "lmforge full FT (engine train_step)")
    if floor is not None:
        sides["floor"] = engine_side(floor, "lmforge, no adapters (floor)")
    return sides, info


def run(args) -> dict:
    p = PRESETS[args.preset]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.preset == "gpu" and device.type != "cuda":
        print("note: --preset gpu without CUDA (bf16 weights on CPU): expect it to be very slow", flush=True)
    cfg = model_config(p)
    B, T = p["batch"], p["seq_len"]
    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(4):
        x = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
        y = torch.full_like(x, IGNORE_INDEX)
        y[:, :-1] = x[:, 1:]  # the targets of HF's labels=x: the last position predicts nothing
        batches.append(TokenBatch(x.to(device), y.to(device)))

    sides, info = build_sides(args, p, cfg, device, batches)
    names = list(sides)
    losses: dict[str, list[float]] = {k: [] for k in names}
    compile_s = {}
    for i in range(args.warmup):
        for k in names:
            sync(device)
            t0 = time.perf_counter()
            losses[k].append(sides[k]["step"](i))
            sync(device)
            if i == 0 and args.compile:
                compile_s[k] = time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in names}
    peaks: dict[str, list[int]] = {k: [] for k in names}
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

    tokens = B * T
    trainable = sum(q.numel() for q in sides["lmforge"]["model"].parameters() if q.requires_grad)
    fpt = {"lmforge": adapter_flops_per_token(cfg, T, trainable), "full": flops_per_token(cfg, T)}
    fpt["peft"] = fpt["lmforge"]
    fpt["floor"] = adapter_flops_per_token(cfg, T, cfg.d_model)
    res = dict(
        preset=args.preset, device=str(device), dtype=str(p["dtype"]), batch=B, seq_len=T,
        shape={k: v for k, v in p.items() if k != "dtype"}, r=R, alpha=ALPHA, compile=args.compile,
        warmup=args.warmup, repeats=args.repeats, compile_s=compile_s, **info, sides={},
    )
    for k in names:
        med = statistics.median(times[k])
        mem = state_bytes(sides[k]["model"], sides[k]["opt"])
        res["sides"][k] = dict(
            label=sides[k]["label"], median_ms=1e3 * med, tokens_per_s=tokens / med,
            model_tflops=fpt[k] * tokens / med / 1e12, raw_step_s=times[k], losses=losses[k], **mem,
            cuda_step_peak_median=statistics.median(peaks[k]) if peaks[k] else None,
        )
    res["ratio"] = res["sides"]["peft"]["median_ms"] / res["sides"]["lmforge"]["median_ms"]
    per_round = sorted(h / o for h, o in zip(times["peft"], times["lmforge"]))
    res["ratio_per_round_q25_q75"] = [per_round[len(per_round) // 4], per_round[(3 * len(per_round)) // 4]]
    res["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses["lmforge"], losses["peft"]))
    if "floor" in sides:
        res["ratio_floor"] = res["sides"]["peft"]["median_ms"] / res["sides"]["floor"]["median_ms"]
        # The adapters' own arithmetic (6 FLOPs per adapter weight and token: the forward's two GEMMs,
        # the backward's four) at this machine's GEMM peak: what even perfect adapters add to the floor.
        peak = gemm_peak(device, p["dtype"])
        adapter_ms = 1e3 * 6.0 * trainable * tokens / peak
        res["gemm_peak_tflops"] = peak / 1e12
        res["adapter_ms_at_peak"] = adapter_ms
        res["ratio_adapters_at_peak"] = res["sides"]["peft"]["median_ms"] / (
            res["sides"]["floor"]["median_ms"] + adapter_ms)
    if "full" in sides:
        res["lora_over_full_time"] = res["sides"]["lmforge"]["median_ms"] / res["sides"]["full"]["median_ms"]
        res["lora_over_full_flops"] = fpt["lmforge"] / fpt["full"]
    return res


def gemm_peak(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on `device` (median of `reps`): the machine's GEMM peak."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(reps + 2):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times[2:])


def mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


def print_tables(res: dict) -> None:
    s = res["sides"]
    print(f"\npreset {res['preset']} on {res['device']}: batch {res['batch']} x {res['seq_len']}, "
          f"weights {res['dtype']}, LoRA r {res['r']} alpha {res['alpha']} on {res['adapted_layers']} "
          f"layers, "
          f"{res['repeats']} interleaved rounds after {res['warmup']} warm-up steps"
          + (", torch.compile" if res["compile"] else ""))
    headers = ["side", "ms/step", "tokens/s", "model TFLOP/s", "trainable", "params MiB", "grads MiB",
               "optim MiB", "total MiB"]
    if any(v["cuda_step_peak_median"] is not None for v in s.values()):
        headers.append("CUDA step peak MiB")
    rows = []
    for v in s.values():
        total = v["params"] + v["grads"] + v["optimizer"]
        row = [v["label"], f"{v['median_ms']:.1f}", f"{v['tokens_per_s']:.0f}", f"{v['model_tflops']:.3f}",
               f"{v['trainable_params']:,}", mib(v["params"]), mib(v["grads"]), mib(v["optimizer"]),
               mib(total)]
        if len(headers) > len(row):
            row.append(mib(v["cuda_step_peak_median"]))
        rows.append(row)
    print_markdown_table(headers, rows)
    q1, q3 = res["ratio_per_round_q25_q75"]
    same = s["lmforge"]["trainable_params"] == s["peft"]["trainable_params"]
    print(f"\nspeed-up (PEFT ms / lmforge ms): {res['ratio']:.3f} (per-round IQR {q1:.3f}-{q3:.3f})")
    print(f"trainable parameters: lmforge {s['lmforge']['trainable_params']:,}, PEFT "
          f"{s['peft']['trainable_params']:,} ({'equal' if same else 'DIFFERENT'})")
    print(f"max |loss lmforge - loss PEFT| over all {len(s['peft']['losses'])} steps: "
          f"{res['max_loss_diff']:.2e} "
          f"(first {s['lmforge']['losses'][0]:.5f} / {s['peft']['losses'][0]:.5f}, last "
          f"{s['lmforge']['losses'][-1]:.5f} / {s['peft']['losses'][-1]:.5f})")
    if "ratio_floor" in res:
        print(f"PEFT ms / floor ms: {res['ratio_floor']:.3f} (the speed-up of adapters that cost nothing; "
              f"lmforge's adapters cost {s['lmforge']['median_ms'] - s['floor']['median_ms']:.0f} ms, PEFT's "
              f"{s['peft']['median_ms'] - s['floor']['median_ms']:.0f} ms)")
        print(f"PEFT ms / (floor + adapter GEMMs at the {res['gemm_peak_tflops'] * 1e3:.0f} GFLOP/s peak, "
              f"{res['adapter_ms_at_peak']:.0f} ms): {res['ratio_adapters_at_peak']:.3f} (the most any "
              "LoRA step can reach)")
    if "lora_over_full_time" in res:
        print(f"LoRA / full fine-tuning step time: {res['lora_over_full_time']:.3f} "
              f"(matmul FLOPs ratio {res['lora_over_full_flops']:.3f})")
    if res["compile_s"]:
        print("first (compiling) step: " + ", ".join(f"{k} {v:.1f} s" for k, v in res["compile_s"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--method", choices=["lora", "full"], default="lora",
                    help="full: also time lmforge full fine-tuning of the same model (reference)")
    ap.add_argument("--compile", action="store_true", help="torch.compile both sides")
    ap.add_argument("--floor", action="store_true", help="also time the same model without adapters, with a "
                    "gradient through every block: the bound on the speed-up")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per side")
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds (one step per side each)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU")
    ap.add_argument("--loss-chunk-tokens", type=int, default=0,
                    help="lmforge side: train.loss_chunk_tokens (0: the plain loss over whole logits)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    import peft
    import transformers

    extra = dict(transformers=transformers.__version__, peft=peft.__version__, threads=args.threads)
    if torch.cuda.is_available():
        extra["gpu"] = torch.cuda.get_device_name()
    machine = machine_info(**extra)
    print(f"machine: {machine}", flush=True)
    res = run(args)
    print_tables(res)
    if args.json:
        machine["loadavg_at_end"] = list(os.getloadavg())
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = dict(machine=machine, command=" ".join(sys.argv), results=res)
        args.json.write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
