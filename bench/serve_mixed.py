"""The mixed load test of `lmforge serve` (`bench/serve_load.py --mixed` runs it): one server, 16
concurrent clients, every request one of five kinds at once in the same batches:

    free        /v1/completions on the base model (sampled, seeded)
    json        /v1/chat/completions with response_format json_schema (strict)
    tool        /v1/chat/completions with tools and tool_choice "required" (the call forced by the grammar)
    adapter-a   /v1/chat/completions on LoRA adapter "adapter-a"
    adapter-b   /v1/completions on LoRA adapter "adapter-b"

The server is a child process (this file with --child) serving RUN with two LoRA adapters made for the
bench (seeded nonzero weights over every linear layer, written as PEFT dirs and loaded like a user's),
the prefix cache on, and a ChatML template that renders tools in the Hermes markup (Qwen 2.5's shape,
written here), since lmforge's own ChatML has no tool support. Each round sends the same --requests
requests from --concurrency threads through the official `openai` client.

Checked per request: no error; a json reply parses and validates against its schema (jsonschema); a
tool reply carries a call to a given function whose arguments validate. Reported per round and kind:
p50 / p99 latency, requests/s and generated tokens/s of the round, and the server's resident memory
(VmRSS of the child) after each round: flat across rounds means nothing accumulates per request.
Never asserts; writes bench/results/serve_mixed.json with the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)
from serve_proc import free_port, launch, pct, rss_mib

REPO = Path(__file__).resolve().parents[1]
KINDS = ("free", "json", "tool", "adapter-a", "adapter-b")
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\nCall one as <tool_call>{json}</tool_call>.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role in ['user', 'system'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{%- set call = call.function %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "size": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["list", "dict", "set"]}}, "required": ["name", "size", "kind"],
    "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"module": {"enum": ["os", "sys", "re"]}, "depth": {"type": "integer",
                                                                                      "minimum": 1,
                                                                                      "maximum": 3}},
    "required": ["module", "depth"], "additionalProperties": False}}}
PROMPTS = ["def fibonacci(n):", "The list data type has", "import os\n", "class Stack:", "for i in range(3):",
           "A dictionary maps keys to", "Return a sorted list of", "The with statement"]


# -- the server (child process) -------------------------------------------------------------------
def child(run: str, port: int, key: str, batch: int) -> None:
    import torch

    from lmforge.data.chat_template import ChatTemplate
    from lmforge.eval.open_run import load_run
    from lmforge.finetune.lora import apply_lora
    from lmforge.finetune.peft_io import save_peft_adapter
    from lmforge.serve import Server, bind
    from lmforge.serve.adapters import AdapterSet
    from lmforge.serve.app import create_app
    from lmforge.serve.engine import Engine

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    sock = bind("127.0.0.1", port)
    loaded = load_run(run)
    adapters = AdapterSet(loaded.model, "base", max_adapters=4, max_rank=64)
    with tempfile.TemporaryDirectory() as tmp:
        names = ("adapter-a", "adapter-b")
        for seed, name in enumerate(names, 1):  # copies of the base before the adapter set hooks into it
            m = copy.deepcopy(loaded.model)
            apply_lora(m, "all-linear", r=8, alpha=16, init="seeded", seed=seed)
            save_peft_adapter(m, Path(tmp) / name, None, loaded.model.cfg)
            del m
        for name in names:
            adapters.load(name, Path(tmp) / name, confined=False)
    engine = Engine(loaded.model, loaded.tokenizer.decode, max_batch_size=batch, prefix_cache_bytes=256 << 20,
                    adapters=adapters)
    template = ChatTemplate(TOOLS_TEMPLATE, {}, name="ChatML with Hermes tool markup",
                            end_of_turn="<|im_end|>")
    app = create_app(engine, loaded.tokenizer, template, model_name="base", api_keys=[key])
    engine.start()
    Server(app, sock, engine, "base").run()


def start(run: str, batch: int, key: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, __file__, "--child", "--run", run, "--port", str(port), "--batch", str(batch)]
    env = {**os.environ, "BENCH_KEY": key, "PYTHONPATH": os.pathsep.join([str(REPO / "src"),
                                                                          os.environ.get("PYTHONPATH", "")])}
    return launch(cmd, env, port, REPO, timeout=180)


# -- the clients ------------------------------------------------------------------------------------
def one(client, kind: str, i: int, max_tokens: int) -> dict:
    import jsonschema

    prompt = PROMPTS[i % len(PROMPTS)]
    t0 = time.perf_counter()
    ok, why, tokens = True, "", 0
    try:
        if kind in ("free", "adapter-b"):
            r = client.completions.create(model="base" if kind == "free" else "adapter-b", prompt=prompt,
                                          max_tokens=max_tokens, temperature=0.8, seed=i)
            tokens = r.usage.completion_tokens
        elif kind == "adapter-a":
            r = client.chat.completions.create(model="adapter-a",
                                               messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0.8, seed=i)
            tokens = r.usage.completion_tokens
        elif kind == "json":
            r = client.chat.completions.create(
                model="base", messages=[{"role": "user", "content": f"Describe {prompt!r} as JSON."}],
                max_tokens=96, temperature=0.8, seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                                        "strict": True}})
            tokens = r.usage.completion_tokens
            if r.choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
            else:
                ok, why = False, f"json reply cut ({r.choices[0].finish_reason})"
        else:
            r = client.chat.completions.create(
                model="base", messages=[{"role": "user", "content": "Which module?"}], tools=[TOOL],
                tool_choice="required", max_tokens=64, temperature=0.8, seed=i)
            tokens = r.usage.completion_tokens
            calls = r.choices[0].message.tool_calls or []
            if not calls or calls[0].function.name != "lookup":
                ok, why = False, f"no tool call: {r.choices[0].message.content!r}"
            else:
                jsonschema.validate(json.loads(calls[0].function.arguments), TOOL["function"]["parameters"])
    except Exception as e:  # noqa: BLE001 - every failure is counted and shown, not raised
        ok, why = False, f"{type(e).__name__}: {e}"
    return {"kind": kind, "latency": time.perf_counter() - t0, "tokens": tokens, "ok": ok, "why": why}


def round_of(client, concurrency: int, n: int, max_tokens: int) -> dict:
    jobs = [(KINDS[i % len(KINDS)], i) for i in range(n)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda job: one(client, job[0], job[1], max_tokens), jobs))
    return {"wall": time.perf_counter() - t0, "results": results}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=80, help="requests per round (16 of each kind)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="the server's --max-batch-size")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "serve_mixed.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.run, args.port, os.environ["BENCH_KEY"], args.batch)
    import openai

    began = time.monotonic()
    key = secrets.token_hex(16)
    info = machine_info(run=args.run, requests=args.requests, concurrency=args.concurrency,
                        max_tokens=args.max_tokens, batch=args.batch)
    proc, url = start(args.run, args.batch, key)
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
    rounds, memory = [], [rss_mib(proc.pid)]
    try:
        round_of(client, 4, 10, 8)  # warm-up: first forwards, grammar and template caches, connections
        memory.append(rss_mib(proc.pid))
        for r in range(args.rounds):
            rounds.append(round_of(client, args.concurrency, args.requests, args.max_tokens))
            memory.append(rss_mib(proc.pid))
            bad = [x for x in rounds[-1]["results"] if not x["ok"]]
            print(f"round {r + 1}: {args.requests / rounds[-1]['wall']:.2f} req/s, {len(bad)} failed, "
                  f"server {memory[-1]:.0f} MiB", flush=True)
            for x in bad[:3]:
                print(f"  failed {x['kind']}: {x['why'][:300]}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    rows = []
    for kind in (*KINDS, "all"):
        xs = [x for rd in rounds for x in rd["results"] if kind == "all" or x["kind"] == kind]
        lat = [x["latency"] for x in xs]
        walls = sum(rd["wall"] for rd in rounds)
        rows.append([kind, str(len(xs)), str(sum(not x["ok"] for x in xs)), f"{pct(lat, 0.5) * 1e3:.0f}",
                     f"{pct(lat, 0.99) * 1e3:.0f}", f"{len(xs) / walls:.2f}",
                     f"{sum(x['tokens'] for x in xs) / walls:.0f}"])
    info["loadavg_at_end"] = list(os.getloadavg())
    print(f"\n{info['cpu_model']}, {info['cpu_count']} cores, torch {info['torch']}; {args.run}, "
          f"{args.concurrency} clients, {args.requests} requests x {args.rounds} rounds, batch {args.batch}; "
          f"load {info['loadavg_at_start'][0]:.1f} -> {info['loadavg_at_end'][0]:.1f}")
    print_markdown_table(["kind", "requests", "failed", "p50 ms", "p99 ms", "req/s", "gen tok/s"], rows)
    print("server resident memory (MiB): start " + ", ".join(f"{m:.0f}" for m in memory[:2]) +
          "; after each round " + ", ".join(f"{m:.0f}" for m in memory[2:]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "machine": info, "memory_mib": memory, "table": rows,
        "rounds": [{"wall": rd["wall"], "results": rd["results"]} for rd in rounds]}, indent=1))
    print(f"wrote {args.json} ({time.monotonic() - began:.0f} s)")
    print(f"median of round walls: {statistics.median(rd['wall'] for rd in rounds):.1f} s")


if __name__ == "__main__":
    main()
