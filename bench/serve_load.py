"""Load test of `lmforge serve` on localhost: continuous batching against the same server decoding one
sequence at a time (--max-batch-size 1, the unbatched baseline), same model, same requests.

    .venv/bin/python bench/serve_load.py                       # runs/demo, 1-4 minutes on 2 cores
    .venv/bin/python bench/serve_load.py --quick               # fewer requests, one round (~1 minute)
    .venv/bin/python bench/serve_load.py --run runs/demo --concurrency 1 8 --requests 32 --max-tokens 48
    .venv/bin/python bench/serve_load.py --mixed               # free / JSON / tools / two adapters at 16
                                                               # clients, 3 rounds (bench/serve_mixed.py)

Two servers are started as subprocesses (`python -m lmforge serve RUN --max-batch-size B`, each on a
free 127.0.0.1 port with a random API key; nothing leaves the machine): "batched" (B = --batch, 16)
and "unbatched" (B = 1). For every concurrency level C, each round sends the same --requests
completions (greedy, max_tokens --max-tokens, prompts from a fixed list of Python-docs openings,
streamed with usage) through the official `openai` client from C threads, first to one server then to
the other, alternating which goes first every round (the machine is shared and noisy: only the
interleaved ratio is meant to be compared across runs). Only one server works at a time.

Reported per level and side (medians over rounds): requests/s and generated tokens/s (all requests /
wall time of the round), p50 / p99 latency of a request (send -> last chunk) and p50 time to first
token (send -> first text). ratio = batched / unbatched requests/s. Greedy outputs of both servers
are compared (they must be the same text: batching is exact). The run stops starting new rounds
after --budget seconds (default 200) so the whole script stays under 5 minutes on a loaded 2-core
machine (a quiet one finishes well before); what ran is reported.
Never asserts; writes bench/results/serve_load.json with the raw numbers and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)
from serve_proc import free_port, launch, pct

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The list data type has some more methods.", "def fibonacci(n):", "import os\nimport sys\n\n",
    "Exceptions are raised when", "class Stack:\n    def __init__(self):", "The with statement is used",
    "A dictionary maps keys to", "Return a new sorted list from", "for i in range(10):",
    "The module os.path implements", "Generators are functions that", "To open a file for reading,",
    "Unicode strings in Python 3", "The asyncio event loop runs", "Lambda expressions create",
    "The default argument values are",
]


def start(run: str, batch: int, key: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "lmforge", "serve", run, "--port", str(port), "--max-batch-size", str(batch),
           "--model-name", "demo"]
    if threads:
        cmd += ["--threads", str(threads)]
    return launch(cmd, {**os.environ, "LMFORGE_API_KEY": key}, port, REPO)


def one(client, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, text, tokens = None, [], 0
    for chunk in client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"latency": end - t0, "ttft": (first or end) - t0, "tokens": tokens, "text": "".join(text)}


def round_of(client, concurrency: int, n: int, max_tokens: int) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one(client, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    lat = sorted(r["latency"] for r in results)
    return {"wall": wall, "rps": n / wall, "tok_s": sum(r["tokens"] for r in results) / wall,
            "p50": statistics.median(lat), "p99": pct(lat, 0.99),
            "ttft_p50": statistics.median(r["ttft"] for r in results),
            "texts": [r["text"] for r in results]}


def main() -> None:
    if "--mixed" in sys.argv[1:]:  # the mixed workload: bench/serve_mixed.py
        from serve_mixed import main as mixed

        return mixed([a for a in sys.argv[1:] if a != "--mixed"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=48, help="requests per round and level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="--max-batch-size of the batched server")
    ap.add_argument("--threads", type=int, default=None, help="--threads of both servers")
    ap.add_argument("--budget", type=float, default=200.0, help="start no level's round after this many "
                    "seconds")
    ap.add_argument("--quick", action="store_true", help="32 requests, concurrency 1 and 8, one round")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "serve_load.json"))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.concurrency, args.rounds = 32, [1, 8], 1
    import openai

    began = time.monotonic()
    key = secrets.token_hex(16)
    info = machine_info(run=args.run, requests=args.requests, max_tokens=args.max_tokens, batch=args.batch)
    servers = {}
    try:
        for side, batch in (("batched", args.batch), ("unbatched", 1)):
            proc, url = start(args.run, batch, key, args.threads)
            servers[side] = (proc, openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600))
        for side in servers:  # warm-up: first forwards, thread pools, connections
            round_of(servers[side][1], 2, 4, 8)
        results: dict[int, dict[str, list[dict]]] = {c: {"batched": [], "unbatched": []}
                                                     for c in args.concurrency}
        mismatches = 0
        for r in range(args.rounds):  # rounds outside: a cut budget drops a late round, not a level
            for c in args.concurrency:
                if time.monotonic() - began > args.budget:
                    break
                order = ["batched", "unbatched"] if r % 2 == 0 else ["unbatched", "batched"]
                for side in order:
                    results[c][side].append(round_of(servers[side][1], c, args.requests, args.max_tokens))
                a, b = results[c]["batched"][-1]["texts"], results[c]["unbatched"][-1]["texts"]
                mismatches += sum(x != y for x, y in zip(a, b))
                print(f"concurrency {c} round {r + 1}: batched {results[c]['batched'][-1]['rps']:.2f} req/s, "
                      f"unbatched {results[c]['unbatched'][-1]['rps']:.2f} req/s", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def med(rounds: list[dict], k: str) -> float:
        return statistics.median(x[k] for x in rounds)

    rows, out = [], {}
    for c, sides in results.items():
        if not sides["batched"] or not sides["unbatched"]:
            continue
        for side in ("batched", "unbatched"):
            s = sides[side]
            rows.append([str(c), side, f"{med(s, 'rps'):.2f}", f"{med(s, 'tok_s'):.0f}",
                         f"{med(s, 'p50') * 1e3:.0f}", f"{med(s, 'p99') * 1e3:.0f}",
                         f"{med(s, 'ttft_p50') * 1e3:.0f}",
                         f"{med(s, 'rps') / med(sides['unbatched'], 'rps'):.2f}x" if side == "batched"
                         else ""])
        out[c] = {side: [{k: v for k, v in x.items() if k != "texts"} for x in s]
                  for side, s in sides.items()}
    info["loadavg_at_end"] = list(os.getloadavg())
    print(f"\n{info['cpu_model']}, {info['cpu_count']} cores, torch {info['torch']}; {args.run}, "
          f"{args.requests} requests per round, max_tokens {args.max_tokens}, greedy, streamed; "
          f"batched = --max-batch-size {args.batch}; load {info['loadavg_at_start'][0]:.1f} -> "
          f"{info['loadavg_at_end'][0]:.1f}")
    print_markdown_table(["concurrency", "server", "req/s", "gen tok/s", "p50 ms", "p99 ms", "TTFT p50 ms",
                          "ratio"], rows)
    print(f"greedy outputs of the two servers that differ: {mismatches}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": info, "mismatches": mismatches, "results": out},
                                          indent=1))
    print(f"wrote {args.json} ({time.monotonic() - began:.0f} s)")


if __name__ == "__main__":
    main()
