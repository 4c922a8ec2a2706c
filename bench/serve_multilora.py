"""Multi-LoRA decoding on the CPU (serve/adapters.py): what adapters cost in the serving engine, and
grouping the rows of a batch by adapter (a pair of small matmuls per adapter) against gathering each
row's A and B from a stack into one batched matmul (punica / S-LoRA's way), same model, same requests;
serve/adapters.py's GATHER_FROM (from how many adapters in a batch it gathers) comes from this table.

    .venv/bin/python bench/serve_multilora.py            # ~1-2 minutes on 2 cores
    .venv/bin/python bench/serve_multilora.py --quick    # one repeat

The engine (no HTTP) decodes --batch greedy requests of --max-tokens tokens each over a random
Transformer (d_model --dim, --layers layers, vocab 4096) with LoRA adapters of rank --rank on every
linear layer of the blocks. Cases: "no adapters" (an Engine without an AdapterSet: the baseline),
"loaded, base rows" (adapters loaded, every request for the base), then the batch's rows spread over
1, 2, 4 and 8 adapters, once grouped and once gathered (GATHER_FROM set to force each). Each case is
timed --repeats times, interleaved; reported: median generated tokens/s and the ratio to the baseline.
Never asserts; writes bench/results/serve_multilora.json with the raw numbers and the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lmforge.serve.adapters as adapters_module  # noqa: E402
from lmforge.config import ModelConfig  # noqa: E402
from lmforge.finetune.lora import apply_lora  # noqa: E402
from lmforge.finetune.peft_io import save_peft_adapter  # noqa: E402
from lmforge.models import Transformer  # noqa: E402
from lmforge.serve.adapters import AdapterSet  # noqa: E402
from lmforge.serve.engine import Engine, SamplingParams  # noqa: E402
from machine import machine_info, print_markdown_table  # noqa: E402


def run_case(engine: Engine, adapters: list, batch: int, max_tokens: int, gather_from: int) -> float:
    adapters_module.GATHER_FROM = gather_from
    rows = [adapters[i % len(adapters)] if adapters else None for i in range(batch)]
    done = [0]

    def on_event(ev):
        if ev.finish_reason is not None:
            done[0] += 1

    for i, a in enumerate(rows):
        engine.submit([[1 + i, 2, 3, 4]], SamplingParams(max_tokens=max_tokens, temperature=0, adapter=a),
                      on_event)
    t0 = time.perf_counter()
    while engine.step():
        pass
    dt = time.perf_counter() - t0
    assert done[0] == batch, "a request failed"
    return batch * max_tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                      n_kv_heads=max(1, args.dim // 128), max_seq_len=args.max_tokens + 16,
                      tie_embeddings=False)
    base = Transformer(cfg).eval()
    root = Path(tempfile.mkdtemp())
    for k in range(8):
        m = copy.deepcopy(base)
        apply_lora(m, "all-linear", r=args.rank, alpha=2.0 * args.rank, init="seeded", seed=k)
        save_peft_adapter(m, root / f"a{k}", None, cfg)
    plain = Engine(base, lambda ids: "", max_batch_size=args.batch)
    adapter_set = AdapterSet(base, "base", max_adapters=8, max_rank=args.rank)
    order = [adapter_set.load(f"a{k}", root / f"a{k}", confined=False) for k in range(8)]
    engine = Engine(base, lambda ids: "", max_batch_size=args.batch, adapters=adapter_set)
    cases = [("no adapters", plain, [], 2), ("loaded, base rows", engine, [], 2)]
    for n in (1, 2, 4, 8):
        cases.append((f"{n} adapter(s), grouped", engine, order[:n], 10**9))
        cases.append((f"{n} adapter(s), gathered", engine, order[:n], 1))
    results: dict[str, list[float]] = {name: [] for name, *_ in cases}
    for _name, eng, ads, g in cases:  # warm-up: first calls of each path (allocator, kernels)
        run_case(eng, ads, args.batch, 4, g)
    for _ in range(args.repeats):
        for name, eng, ads, g in cases:
            results[name].append(run_case(eng, ads, args.batch, args.max_tokens, g))
    base_tps = statistics.median(results["no adapters"])
    rows = [[name, f"{statistics.median(v):.0f}", f"{statistics.median(v) / base_tps:.2f}"]
            for name, v in results.items()]
    print(f"decode, batch {args.batch}, d_model {args.dim}, {args.layers} layers, rank {args.rank}, "
          f"{args.threads} thread(s), median of {args.repeats}")
    print_markdown_table(["case", "tokens/s", "vs no adapters"], rows)
    out = Path(__file__).parent / "results" / "serve_multilora.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "tokens_per_s": results, "machine": machine_info()},
                              indent=1))


if __name__ == "__main__":
    main()
