"""`lmforge serve` under concurrent load (HTTP, continuous batching) against transformers' `generate` run
batched on the same model: the serve tokens/s row of the GPU suite.

    .venv/bin/python bench/gpu_serve.py --preset tiny --device cpu     # seconds; what the tests run
    .venv/bin/python bench/gpu_serve.py --preset gpu                   # Llama 1.1B shape, CUDA

The model: bench/engine_decode.py's Llama-layout lmforge Transformer (TinyLlama 1.1B's shape on the gpu
preset), its output row of the end-of-text id zeroed (a random model would otherwise stop some replies
early at random: every reply is then exactly max_tokens long on both sides), written with `to_hf` in
bf16 beside a word-level tokenizer.json of the model's vocabulary ("w1" ... "wN", id 0 the end of text),
so `lmforge serve DIR` loads it as a Hugging Face dir, as a user's model is loaded. `lmforge serve` holds
an HF dir's weights in fp32 (it has no bf16 option), so transformers loads the same dir in fp32 too:
same weights, same precision; TF32 off on both sides (torch's default).

The load: for each concurrency C (--levels, default 1, 8, 32) the same 2C requests (at least 4), each a
prompt of --prompt words (= tokens) and max_tokens --new, greedy:
  lmforge       a `python -m lmforge serve DIR --max-batch-size max(C)` child process on 127.0.0.1 with
                a random API key; C client threads POST /v1/completions (non-streamed, stdlib urllib:
                no client library needed), each sending its next request when its last one returned.
  transformers  in this process, the requests in arrival order in batches of C through
                `generate(min_new_tokens=max_new_tokens=new)` (static batching, as a simple server
                would); a request's latency is the time from the level's start to the end of its batch.
Reported per level and side: output tokens/s (all the level's tokens / its wall time), p50 / p95 request
latency, and how many replies are the same text on both sides (greedy fp32 on the same weights: they
should be; reported, not asserted). Sides alternate order round by round; medians over --rounds. Neither
side is compiled. Writes --json with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from engine_decode import PRESETS as DECODE_PRESETS  # noqa: E402  (bench/engine_decode.py)
from engine_decode import model_config, sync  # noqa: E402
from machine import machine_info, print_markdown_table  # noqa: E402  (bench/machine.py)
from serve_proc import free_port, launch, pct  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PRESETS = {
    "tiny": dict(DECODE_PRESETS["tiny"], prompt=8, new=8, levels=[1, 4]),
    "gpu": dict(DECODE_PRESETS["gpu"], prompt=32, new=64, levels=[1, 8, 32]),
}


def write_model(p: dict, out: Path, device: torch.device) -> None:
    """The model as a Hugging Face dir with a word-level tokenizer of its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lmforge.models import build_model
    from lmforge.models.hf import to_hf

    torch.manual_seed(0)
    model = build_model(model_config(p), device).eval()
    with torch.no_grad():
        model.output.weight[0].zero_()  # id 0 is the end of text: greedy never picks a zero logit here
    to_hf(model, out, dtype=torch.bfloat16)
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, p["vocab"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    del model


def requests_for(level: int, p: dict, gen: torch.Generator) -> list[list[int]]:
    n = max(2 * level, 4)
    return torch.randint(1, p["vocab"], (n, p["prompt"]), generator=gen).tolist()


def as_text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def post(url: str, key: str, prompt: str, new: int) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {key}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.loads(r.read())
    return {"latency": time.perf_counter() - t0, "tokens": reply["usage"]["completion_tokens"],
            "text": reply["choices"][0]["text"]}


def level_ours(url: str, key: str, prompts: list[list[int]], level: int, new: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(level) as pool:
        done = list(pool.map(lambda ids: post(url, key, as_text(ids), new), prompts))
    wall = time.perf_counter() - t0
    return summary(wall, [d["latency"] for d in done], sum(d["tokens"] for d in done),
                   [d["text"].strip() for d in done])


@torch.no_grad()
def level_hf(hf, prompts: list[list[int]], level: int, new: int, device) -> dict:
    lat, texts = [], []
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), level):
        ids = torch.tensor(prompts[i:i + level], device=device)
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        sync(device)
        end = time.perf_counter() - t0
        lat += [end] * ids.shape[0]
        texts += [as_text(row) for row in out[:, ids.shape[1]:].tolist()]
    return summary(time.perf_counter() - t0, lat, len(prompts) * new, texts)


def summary(wall: float, lat: list[float], tokens: int, texts: list[str]) -> dict:
    return {"wall": wall, "tok_s": tokens / wall, "tokens": tokens, "p50": statistics.median(lat),
            "p95": pct(lat, 0.95), "texts": texts}


def medians(rounds: list[dict], requests: int) -> dict:
    out = {k: statistics.median(x[k] for x in rounds) for k in ("tok_s", "p50", "p95", "wall")}
    return dict(out, requests=requests, rounds=[{k: v for k, v in x.items() if k != "texts"} for x in rounds])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--levels", default=None, help="comma-separated concurrencies (default: the preset's)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    levels = [int(c) for c in args.levels.split(",")] if args.levels else p["levels"]
    device = torch.device(args.device)
    key = secrets.token_hex(16)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp, "model")
        write_model(p, model_dir, device)
        port = free_port()
        cmd = [sys.executable, "-m", "lmforge", "serve", str(model_dir), "--port", str(port),
               "--max-batch-size", str(max(levels)), "--model-name", "m", "--set", f"train.device={device}"]
        path = os.pathsep.join(x for x in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if x)
        env = {**os.environ, "LMFORGE_API_KEY": key, "PYTHONPATH": path}
        proc, url = launch(cmd, env, port, REPO, timeout=300)
        try:
            from transformers import LlamaForCausalLM

            hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
            print(f"server up and transformers loaded in {time.monotonic() - began:.0f} s", flush=True)
            warm = requests_for(1, p, torch.Generator().manual_seed(0))[:2]
            level_ours(url, key, warm, 2, 4)  # warm-up: first forwards, connections, allocator
            level_hf(hf, warm, 2, 4, device)
            gen = torch.Generator().manual_seed(1)
            results, agree = {}, {}
            for c in levels:
                prompts = requests_for(c, p, gen)
                runs = {"lmforge": [], "transformers": []}
                for r in range(args.rounds):
                    for side in ("lmforge", "transformers") if r % 2 == 0 else ("transformers", "lmforge"):
                        runs[side].append(level_ours(url, key, prompts, c, p["new"]) if side == "lmforge"
                                          else level_hf(hf, prompts, c, p["new"], device))
                last = [runs[side][-1]["texts"] for side in runs]
                agree[c] = sum(a == b for a, b in zip(*last))
                results[c] = {side: medians(rs, len(prompts)) for side, rs in runs.items()}
                ours, theirs = results[c]["lmforge"], results[c]["transformers"]
                print(f"concurrency {c}: lmforge serve {ours['tok_s']:.0f} tok/s (p50 {ours['p50']:.2f} s), "
                      f"transformers batched {theirs['tok_s']:.0f} tok/s (p50 {theirs['p50']:.2f} s), "
                      f"same text {agree[c]}/{len(prompts)}", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    info = machine_info(preset=args.preset, device=str(device), prompt=p["prompt"], new=p["new"],
                        rounds=args.rounds, dtype="float32 (both sides)")
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    rows = []
    for c, sides in results.items():
        for side, r in sides.items():
            rows.append([str(c), side, f"{r['tok_s']:.0f}", f"{r['p50'] * 1e3:.0f}", f"{r['p95'] * 1e3:.0f}",
                         f"{r['tok_s'] / sides['transformers']['tok_s']:.2f}x",
                         f"{agree[c]}/{r['requests']}"])
    print_markdown_table(["concurrency", "side", "output tok/s", "p50 ms", "p95 ms", "vs transformers",
                          "same text"], rows)
    print(f"prompt {p['prompt']} tokens, {p['new']} new, greedy, fp32 weights on both sides; "
          f"{time.monotonic() - began:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "agree": agree, "results": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
