"""Speculative decoding on the CPU: acceptance rate and tokens/s against plain decoding of the same target.

    .venv/bin/python bench/speculative.py             # runs/demo + runs/speculative-draft, and a d512 case
    .venv/bin/python bench/speculative.py --draft runs/speculative-draft --draft runs/demo-int8 --json OUT

Needs runs/demo (scripts/demo.sh) and a draft trained on the demo's data (800 steps, ~8 min on 2 idle cores):
    .venv/bin/python -m lmforge train -c configs/speculative/draft.yaml
and, for "the same model quantized" as the draft:
    .venv/bin/python -m lmforge quantize runs/demo runs/demo-int8 --bits 8 --keep-dtype float32

Cases:
  demo   target runs/demo (d256, 4 layers, vocab 4096), each --draft (default runs/speculative-draft:
         d128, 2 layers, same tokenizer). A draft forward costs a good fraction of a target forward here
         (both are small, a CPU forward of one token is mostly fixed overhead), so expect little gain.
  large  (--no-large skips it) a random-init d512, 8-layer target (vocab 4096, ~30M parameters) and, as
         its draft, its own first 2 layers with the same embeddings and head (a layer-skip draft,
         4x fewer layers). Random weights say nothing about text, and their greedy agreement is not
         representative (with tied embeddings both mostly predict a token of the context); the case
         measures what a cheap draft buys when a target forward costs several draft forwards.
         Each case also prints the forward costs and Leviathan et al.'s predicted speed-up at the
         measured acceptance rate: E[tokens per round] / (k c_draft + c_verify(k + 1)) against 1 / c_1.

Prompts: the first --prompt-tokens tokens of paragraphs of tests/data/pydoc_topics.jsonl (the shipped
corpus, Python docs), encoded with the target's tokenizer. No stop tokens: every run emits
--max-new-tokens tokens.

Identity: --identity-prompts (50) prompts decoded greedily with plain `lmforge.eval.generate.generate`
and with speculative_generate (k 4) must give identical tokens (float32, as `lmforge generate` runs);
the count is printed and a mismatch is shown with the target's top-2 logit gap where the outputs part.

Timing: for k in --ks and for greedy and temperature --temperature sampling, --repeats rounds over
--timed-prompts prompts, each round timing plain and speculative decoding of every prompt back to back,
order alternating per round (the machine is shared). Reported: median tokens/s of each over the rounds,
the median of the per-round ratios (speculative / plain, > 1: faster), acceptance rate (kept / drafted)
and tokens per target forward. Never asserts; prints machine info and a markdown table (--json too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from lmforge.config.schema import ModelConfig
from lmforge.eval.generate import generate
from lmforge.eval.open_run import load_run
from lmforge.models import Transformer
from lmforge.models.common.attention import KVCache
from lmforge.models.speculative import SpeculativeStats, speculative_generate
from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"


def corpus_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    out = []
    for line in CORPUS.read_text().splitlines():
        for para in json.loads(line)["text"].split("\n\n"):
            ids = tokenizer.encode(para.strip())
            if len(ids) >= length + 8:
                out.append(ids[:length])
            if len(out) == n:
                return out
    raise SystemExit(f"{CORPUS} has fewer than {n} paragraphs of {length + 8}+ tokens")


def layer_skip_draft(target: Transformer, n_layers: int) -> Transformer:
    """The target's first n_layers blocks with its embeddings, final norm and head (shared tensors)."""
    draft = Transformer(target.cfg.model_copy(update={"n_layers": n_layers}))
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in draft.state_dict()})
    return draft.eval()


def check_identity(target, draft, prompts, max_new: int) -> dict:
    same, report = 0, []
    for i, p in enumerate(prompts):
        plain = generate(target, p, max_new, temperature=0.0)[0]
        out, _ = speculative_generate(target, draft, p, max_new, k=4)
        if out == plain:
            same += 1
            continue
        at = next(j for j, (a, b) in enumerate(zip(out, plain)) if a != b)
        with torch.no_grad():
            top2 = target(torch.tensor([p + plain[:at]]))[0, -1].topk(2).values
        report.append(f"prompt {i}: first difference at token {at} (target top-2 logit gap "
                      f"{float(top2[0] - top2[1]):.3g})")
    return {"prompts": len(prompts), "identical": same, "mismatches": report}


def forward_ms(model, n_tokens: int, context: int, repeats: int = 20) -> float:
    """Median ms of one cached forward of n_tokens after `context` cached positions."""
    cache = KVCache(model, 1, context + n_tokens)
    ids = torch.randint(0, model.cfg.vocab_size, (1, context + n_tokens))
    times = []
    with torch.no_grad():
        model(ids[:, :context], cache=cache)
        for _ in range(repeats):
            cache.pos = context
            t0 = time.perf_counter()
            model(ids[:, context:], cache=cache)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def predicted_speedup(alpha: float, k: int, c_draft: float, c_verify: float, c_one: float) -> float:
    """Leviathan et al. 2023: expected tokens per round over the round's cost, against plain decoding."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c_draft + c_verify) * c_one


def time_case(target, draft, prompts, max_new: int, k: int, temperature: float, repeats: int) -> dict:
    plain_tps, spec_tps, ratios = [], [], []
    stats = SpeculativeStats()
    for r in range(repeats):
        times = {}
        for side in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                if side == "plain":
                    generate(target, p, max_new, temperature=temperature, seed=1000 * r + i)
                else:
                    gen = torch.Generator().manual_seed(1000 * r + i)
                    _, s = speculative_generate(target, draft, p, max_new, k=k, temperature=temperature,
                                                generator=gen)
                    stats.add(s)
            times[side] = time.perf_counter() - t0
        tokens = max_new * len(prompts)
        plain_tps.append(tokens / times["plain"])
        spec_tps.append(tokens / times["spec"])
        ratios.append(times["plain"] / times["spec"])
    return {"k": k, "temperature": temperature, "plain_tok_s": statistics.median(plain_tps),
            "spec_tok_s": statistics.median(spec_tps), "ratio": statistics.median(ratios),
            "acceptance": stats.acceptance_rate, "tokens_per_round": stats.tokens_per_round}


def run_case(name: str, target, draft, prompts, args) -> dict:
    print(f"\n## {name}", flush=True)
    ctx = len(prompts[0]) + args.max_new_tokens // 2
    c_one = forward_ms(target, 1, ctx)
    c_draft = forward_ms(draft, 1, ctx)
    costs = {"target_1": c_one, "draft_1": c_draft}
    for k in args.ks:
        costs[f"target_{k + 1}"] = forward_ms(target, k + 1, ctx)
    over = ", ".join(f"{k + 1}: {costs[f'target_{k + 1}']:.2f}" for k in args.ks)
    print(f"forward ms (one token after {ctx} cached): target {c_one:.2f}, draft {c_draft:.2f} (ratio "
          f"{c_draft / c_one:.2f}); target over k+1 tokens: {over}", flush=True)
    identity = None
    if args.identity_prompts:
        identity = check_identity(target, draft, prompts[: args.identity_prompts], args.max_new_tokens)
        print(f"greedy identity: {identity['identical']}/{identity['prompts']} prompts identical to plain "
              "greedy decoding", flush=True)
        for line in identity["mismatches"]:
            print("  " + line)
    rows = []
    for temperature in (0.0, args.temperature):
        for k in args.ks:
            row = time_case(target, draft, prompts[: args.timed_prompts], args.max_new_tokens, k, temperature,
                            args.repeats)
            c_verify = costs[f"target_{k + 1}"]
            row["predicted"] = predicted_speedup(row["acceptance"], k, c_draft, c_verify, c_one)
            rows.append(row)
            print(json.dumps({kk: round(v, 3) if isinstance(v, float) else v for kk, v in row.items()}),
                  flush=True)
    print_markdown_table(
        ["mode", "k", "acceptance", "tokens/forward", "plain tok/s", "spec tok/s", "ratio", "predicted"],
        [["greedy" if r["temperature"] == 0 else f"T={r['temperature']}", str(r["k"]),
          f"{r['acceptance']:.1%}", f"{r['tokens_per_round']:.2f}", f"{r['plain_tok_s']:.1f}",
          f"{r['spec_tok_s']:.1f}",
          f"{r['ratio']:.2f}x", f"{r['predicted']:.2f}x"] for r in rows])
    return {"case": name, "forward_ms": costs, "identity": identity, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(REPO / "runs" / "demo"))
    ap.add_argument("--draft", action="append", default=None,
                    help="draft run / checkpoint / HF dir (repeatable; default runs/speculative-draft)")
    ap.add_argument("--no-large", action="store_true", help="skip the d512 / 8-layer case")
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 6])
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--identity-prompts", type=int, default=50)
    ap.add_argument("--timed-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info(threads=args.threads)
    print(json.dumps(info))
    results = {"machine": info, "args": vars(args), "cases": []}

    target = load_run(args.target)
    n_prompts = max(args.identity_prompts, args.timed_prompts)
    prompts = corpus_prompts(target.tokenizer, n_prompts, args.prompt_tokens)
    for path in args.draft or [str(REPO / "runs" / "speculative-draft")]:
        if not Path(path).exists():
            print(f"\n## demo: no draft at {path} (`lmforge train -c configs/speculative/draft.yaml`)")
            continue
        draft = load_run(path)
        if draft.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
            sys.exit(f"{path}: its tokenizer differs from {args.target}'s")
        name = f"demo: target {args.target} ({target.step} steps), draft {path} ({draft.step} steps)"
        results["cases"].append(run_case(name, target.model.eval(), draft.model.eval(), prompts, args))

    if not args.no_large:
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=4096, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, max_seq_len=256)
        big = Transformer(cfg).eval()
        name = "large: random-init d512 / 8-layer target, draft = its first 2 layers (layer-skip)"
        results["cases"].append(run_case(name, big, layer_skip_draft(big, 2), prompts, args))

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
