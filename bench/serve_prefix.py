"""Prefix caching in the serving engine: time to first token and throughput on a chat workload whose
requests share a ~1k-token system prompt, cache on vs off, same model, same requests.

    .venv/bin/python bench/serve_prefix.py            # 2-4 minutes on 2 shared cores
    .venv/bin/python bench/serve_prefix.py --quick    # one round, fewer requests (~1 minute)

The model is built here (random weights; the cache's effect does not depend on them): a Llama-shaped
Transformer, d_model 256, 4 layers, 8 heads (2 kv heads), vocabulary 8192, max_seq_len 2048, fp32,
one torch thread (what `lmforge serve` takes on a 2-core machine). The workload: a system prompt of
--system tokens, then --requests user turns of 16-64 tokens each (fixed seed), greedy, --max-tokens
new tokens each. The engine is driven in-process (no HTTP: the bench measures the engine, not the
network stack); each round builds fresh engines, so every "on" round starts with an empty cache:

  ttft      requests one after another; time from submit to the first token of each, median over the
            requests after the first (the first is the cold miss, reported on its own as ttft_cold)
  tput      all requests submitted at once (batch 8): generated tokens / wall time of the round

Sides "off" (--prefix-cache-mb 0, today's one-pass prefill) and "on" (the cache, blocks of
--block tokens) alternate which goes first every round; medians over rounds. The greedy replies of
both sides are compared (they must be equal). A second table gives the cost of the chunked prefill on
a miss: one prompt of --system tokens prefilled in one pass vs in blocks of 16 to 128 tokens (fresh
cache each time), median over repeats; that cost decides the default block size. Last: whether the
chunked prefill changes the logits of the workload's prompts against the one-pass prefill (bits).
Never asserts; writes bench/results/serve_prefix.json with the numbers and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from lmforge.config import ModelConfig
from lmforge.models import Transformer
from lmforge.models.common.attention import KVCache
from lmforge.serve.engine import Engine, SamplingParams
from lmforge.serve.prefix_cache import BLOCK_TOKENS, PrefixCache
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

REPO = Path(__file__).resolve().parents[1]
V = 8192


def model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, max_seq_len=2048,
                      tie_embeddings=False, init_std=0.05)
    return Transformer(cfg).eval()


def workload(system: int, requests: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    sys_ids = torch.randint(0, V, (system,), generator=g).tolist()
    turns = torch.randint(16, 65, (requests,), generator=g).tolist()
    return [sys_ids + torch.randint(0, V, (n,), generator=g).tolist() for n in turns]


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def ttft_round(m, prompts, params, mb: int, block: int) -> tuple[list[float], list[str], dict]:
    """Requests one after another: seconds to the first token of each, the replies, cache stats."""
    times, texts = [], []
    with Engine(m, decode, max_batch_size=8, prefix_cache_bytes=mb << 20, prefix_block_tokens=block) as eng:
        for p in prompts:
            first, done, out = threading.Event(), threading.Event(), []
            t0 = time.perf_counter()
            stamp = []

            def on_event(ev, first=first, done=done, out=out, stamp=stamp):
                if not first.is_set():
                    stamp.append(time.perf_counter())
                    first.set()
                out.append(ev.text)
                if ev.finish_reason is not None or ev.error is not None:
                    done.set()

            eng.submit([p], params, on_event)
            done.wait(600)
            times.append(stamp[0] - t0)
            texts.append("".join(out))
        stats = eng.prefix_cache.stats.as_dict() if eng.prefix_cache else {}
    return times, texts, stats


def tput_round(m, prompts, params, mb: int, block: int) -> tuple[float, list[str]]:
    """All requests at once: generated tokens per second of wall time, the replies."""
    with Engine(m, decode, max_batch_size=8, prefix_cache_bytes=mb << 20, prefix_block_tokens=block) as eng:
        t0 = time.perf_counter()
        out = eng.generate(prompts, params, timeout=1200)
        wall = time.perf_counter() - t0
    return sum(n for _, n, _ in out) / wall, [t for t, _, _ in out]


@torch.inference_mode()
def chunk_cost(m, prompt: list[int], blocks: list[int], repeats: int) -> dict[str, float]:
    """Median seconds of one cold prefill of `prompt`: one pass, and in blocks of each size."""
    out: dict[str, list[float]] = {"one pass": []}
    for b in blocks:
        out[f"blocks of {b}"] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m(torch.tensor([prompt]), cache=KVCache(m, 1, len(prompt)))
        out["one pass"].append(time.perf_counter() - t0)
        for b in blocks:
            cache = PrefixCache(1 << 30, b)
            t0 = time.perf_counter()
            cache.prefill(prompt, lambda ids, c, **kw: m(ids, cache=c, **kw), KVCache(m, 1, len(prompt)),
                          skip_head=True)
            out[f"blocks of {b}"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


@torch.inference_mode()
def chunked_vs_one_pass(m, prompts: list[list[int]], block: int) -> dict:
    """Last-position logits of each prompt prefilled in one pass (the cache off) and in blocks (the
    cache on, cold): how many are the same bits, and the largest difference."""
    equal, diff = 0, 0.0
    for p in prompts:
        one = m(torch.tensor([p]), cache=KVCache(m, 1, len(p)))[:, -1]
        chunked = PrefixCache(1 << 30, block).prefill(p, lambda ids, c, **kw: m(ids, cache=c, **kw),
                                                       KVCache(m, 1, len(p)), skip_head=True)
        equal += torch.equal(one, chunked)
        diff = max(diff, (one - chunked).abs().max().item())
    return {"prompts": len(prompts), "bit_equal": equal, "max_abs_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block", type=int, default=BLOCK_TOKENS, help="the cache's block tokens")
    ap.add_argument("--mb", type=int, default=256, help="the cache's budget (MiB)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one round, 6 requests")
    ap.add_argument("--out", default=str(REPO / "bench/results/serve_prefix.json"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.requests = 1, 6
    torch.set_num_threads(args.threads)
    info = machine_info(system_tokens=args.system, requests=args.requests, max_tokens=args.max_tokens,
                        block_tokens=args.block, budget_mb=args.mb, threads=args.threads,
                        model="d_model 256, 4 layers, 8/2 heads, vocab 8192, fp32")
    m = model()
    prompts = workload(args.system, args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    sides = {"off": 0, "on": args.mb}
    ttft = {s: [] for s in sides}
    cold = {s: [] for s in sides}
    tput = {s: [] for s in sides}
    replies: dict[str, list[str]] = {}
    stats = {}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for s in order:
            times, texts, st = ttft_round(m, prompts, params, sides[s], args.block)
            cold[s].append(times[0])
            ttft[s].append(statistics.median(times[1:]))
            tps, texts2 = tput_round(m, prompts, params, sides[s], args.block)
            tput[s].append(tps)
            replies.setdefault(s, texts)
            replies.setdefault(s + " batched", texts2)
            stats[s] = st or stats.get(s)
            print(f"round {r} {s}: ttft {ttft[s][-1] * 1e3:.1f} ms (cold {times[0] * 1e3:.1f} ms), "
                  f"{tps:.1f} tok/s", flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    mismatches = sum(a != b for a, b in zip(replies["off"], replies["on"]))
    mismatches += sum(a != b for a, b in zip(replies["off batched"], replies["on batched"]))
    cost = chunk_cost(m, prompts[0][: args.system], [16, 32, 64, 128], 3 if args.quick else 5)
    bits = chunked_vs_one_pass(m, prompts, args.block)
    results = {
        "ttft_ms": {s: med(ttft[s]) * 1e3 for s in sides},
        "ttft_cold_ms": {s: med(cold[s]) * 1e3 for s in sides},
        "throughput_tok_s": {s: med(tput[s]) for s in sides},
        "ttft_speedup": med(ttft["off"]) / med(ttft["on"]),
        "throughput_ratio": med(tput["on"]) / med(tput["off"]),
        "raw": {"ttft_s": ttft, "ttft_cold_s": cold, "tput": tput},
        "cache_stats_on": stats.get("on"),
        "reply_mismatches": mismatches,
        "miss_prefill_ms": {k: v * 1e3 for k, v in cost.items()},
        "chunked_vs_one_pass_logits": bits,
    }
    info["loadavg_at_end"] = list(__import__("os").getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": info, "results": results}, indent=1) + "\n")
    print_markdown_table(
        ["cache", "TTFT p50 (ms)", "TTFT cold (ms)", "throughput (tok/s)"],
        [[s, f"{results['ttft_ms'][s]:.1f}", f"{results['ttft_cold_ms'][s]:.1f}",
          f"{results['throughput_tok_s'][s]:.1f}"] for s in sides])
    print(f"TTFT off/on {results['ttft_speedup']:.2f}x, "
          f"throughput on/off {results['throughput_ratio']:.2f}x, reply mismatches {mismatches}, "
          f"hit rate {(stats.get('on') or {}).get('hit_rate')}")
    print_markdown_table(["prefill of a miss", "ms"],
                         [[k, f"{v:.1f}"] for k, v in results["miss_prefill_ms"].items()])
    print(f"last-position logits, blocks of {args.block} vs one pass: {bits['bit_equal']}/{bits['prompts']} "
          f"prompts the same bits, max |diff| {bits['max_abs_diff']:.2e}")


if __name__ == "__main__":
    main()
