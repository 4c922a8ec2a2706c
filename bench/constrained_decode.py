"""Constrained decoding: which engine (llguidance, xgrammar, outlines-core), and what a constrained row
costs a batch of lmforge's serving engine.

    .venv/bin/python bench/constrained_decode.py            # both parts, ~3-6 minutes on 2 cores
    .venv/bin/python bench/constrained_decode.py --part engines --vocab 32000
    .venv/bin/python bench/constrained_decode.py --part batch --run runs/demo

Part 1, engines. Two tokenizers: runs/demo's (lmforge's own byte-level BPE, 4k ids; trained on the
shipped corpus when the demo is not there) and a larger one in Hugging Face's format (a byte-level BPE
of --vocab ids trained with `tokenizers` on the Python sources of this interpreter's standard library,
cached in --cache; the shape of an imported model's tokenizer). Every (engine, tokenizer) runs in its
own subprocess, so that its memory is its own: tokenizer adapter build time, grammar compile time of
each schema in SCHEMAS (the first compile, no cache), then per-step mask time (p50 / p99 microseconds)
while it walks a valid instance of each schema token by token (mask, then accept the document's next
token; the instance is tokenized the way the model would write it), and the process's RSS growth over
the import. Every engine writes the same compact JSON (", " and ": " separators).

Part 2, batch: lmforge's Engine decodes a batch of --batch rows for --max-tokens tokens: all free, half
free and half under a JSON schema (SCHEMA_LONG: an array of at least 100 objects, so no constrained
row ends before max_tokens and the batch keeps its size), and all constrained; tokens/s = generated
tokens / wall time, median over --repeats interleaved rounds. ratio = mixed / free (target >= 0.8).
The time spent in the engine's masking seam (Engine._constrain) is also timed: its share of an
all-constrained round, which a loaded machine blurs less than the ratios. Models: --run's (runs/demo)
and a random model over the large tokenizer (d_model 256, 4 layers: a small model, where the mask is
the largest share of a step).

Never asserts; writes bench/results/constrained_decode.json with the machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import psutil
import torch

from machine import machine_info, print_markdown_table  # bench/machine.py (on sys.path)

REPO = Path(__file__).resolve().parents[1]
OBJ = {"type": "object", "additionalProperties": False}
# (schema, a valid instance written compactly)
SCHEMAS = {
    "flat": ({**OBJ, "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}, {"name": "Ada Lovelace", "age": 36}),
    "enum+bounds": ({**OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "x": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
                     "required": ["color", "x"]}, {"color": "green", "x": 1.25}),
    "nested": ({**OBJ, "properties": {"user": {**OBJ, "properties": {
        "name": {"type": "string", "maxLength": 20}, "tags": {"type": "array", "items": {"type": "string"},
                                                              "maxItems": 5}}, "required": ["name", "tags"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
        {"user": {"name": "grace", "tags": ["navy", "cobol"]}, "active": True}),
    "array-of-objects": ({"type": "array", "minItems": 1, "maxItems": 10, "items": {**OBJ, "properties": {
        "k": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "v": {"type": "number"}},
        "required": ["k", "v"]}},
        [{"k": "alpha", "v": 1.5}, {"k": "beta", "v": -2}, {"k": "gamma", "v": 300}]),
    "refs+optional": ({"$defs": {"p": {**OBJ, "properties": {"x": {"type": "integer"},
                                                             "y": {"type": "integer"}}, "required": ["x"]}},
                       **OBJ, "properties": {"a": {"$ref": "#/$defs/p"},
                                             "b": {"type": "array", "items": {"$ref": "#/$defs/p"}},
                                             "note": {"type": ["string", "null"]}}, "required": ["a", "b"]},
                      {"a": {"x": 1, "y": 2}, "b": [{"x": 3}, {"x": 4, "y": 5}], "note": None}),
    "tool-call": ({**OBJ, "properties": {"name": {"const": "get_weather"}, "arguments": {
        **OBJ, "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                              "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "unit", "days"]}}, "required": ["name", "arguments"]},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}),
}
SCHEMA_LONG = {"type": "array", "minItems": 100, "items": {**OBJ, "properties": {
    "name": {"type": "string", "maxLength": 12}, "score": {"type": "number"}}, "required": ["name", "score"]}}


def compact(doc) -> str:
    return json.dumps(doc, separators=(", ", ": "))


# -- tokenizers -----------------------------------------------------------------------------------------
def small_tokenizer_path(cache: Path, demo: Path) -> Path:
    if demo.is_file():
        return demo
    out = cache / "shipped-4096.json"
    if not out.is_file():  # the shipped corpus the tests train on
        from lmforge.data.tokenizer import Tokenizer

        lines = (REPO / "tests/data/pydoc_topics.jsonl").read_text().splitlines()
        Tokenizer.train((json.loads(line)["text"] for line in lines), 4096).save(out)
    return out


def large_tokenizer_path(cache: Path, vocab: int) -> Path:
    out = cache / f"stdlib-bpe-{vocab}.json"
    if not out.is_file():
        from lmforge.data.tokenizer import Tokenizer

        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**/*.py"), recursive=True))
        texts = (Path(f).read_text(errors="replace") for f in files)
        t0 = time.perf_counter()
        Tokenizer.train(texts, vocab).save(out)
        print(f"trained a {vocab}-id BPE on the stdlib sources in {time.perf_counter() - t0:.0f} s",
              flush=True)
    return out


def hf_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


# -- part 1: one engine on one tokenizer, in its own process --------------------------------------------
class LLGuidance:
    def __init__(self, path: Path):
        from lmforge.data.tokenizer import Tokenizer
        from lmforge.serve import grammar

        self.tok = Tokenizer.load(path)
        self.g = grammar
        grammar.token_table(self.tok)

    def compile(self, schema):
        return self.g.json_grammar(self.tok, schema)

    def walk(self, compiled, ids):
        m = compiled.matcher()
        bits = torch.zeros(1, (compiled.vocab_size + 31) // 32, dtype=torch.int32)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            m._fill(bits[0])
            out.append(time.perf_counter() - t0)
            assert bits[0, t // 32] >> (t % 32) & 1, "the instance's token is masked"
            m.accept(t)
        return out


class XGrammar:
    def __init__(self, path: Path):
        import xgrammar as xgr

        self.x = xgr
        self.hf = hf_tokenizer(path)
        info = xgr.TokenizerInfo.from_huggingface(self.hf, vocab_size=len(self.hf))
        self.vocab = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(", ", ": "))

    def walk(self, compiled, ids):
        m = self.x.GrammarMatcher(compiled)
        bits = self.x.allocate_token_bitmask(1, self.vocab)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bits)
            out.append(time.perf_counter() - t0)
            assert bits[0, t // 32] >> (t % 32) & 1, "the instance's token is masked"
            assert m.accept_token(t)
        return out


class OutlinesCore:
    def __init__(self, path: Path):
        import outlines_core as oc

        from lmforge.data.tokenizer import Tokenizer, byte_level_decoder_map

        self.oc = oc
        tok = Tokenizer.load(path)
        self.vocab = tok.vocab_size
        bmap = byte_level_decoder_map()
        tokens: dict[bytes, list[int]] = {}
        for s, i in tok.hf.get_vocab(with_added_tokens=False).items():
            if i != tok.eos_id:
                tokens.setdefault(bytes(bmap[c] for c in s), []).append(i)
        self.vocabulary = oc.Vocabulary(tok.eos_id, tokens)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?")
        return self.oc.Index(regex, self.vocabulary)

    def walk(self, compiled, ids):
        g = self.oc.Guide(compiled)
        bits = torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32)
        out = []
        for t in ids:
            t0 = time.perf_counter()
            g.write_mask_into(bits.data_ptr(), bits.numel(), 4)
            out.append(time.perf_counter() - t0)
            assert bits[0, t // 32] >> (t % 32) & 1, "the instance's token is masked"
            g.advance(t)
        return out


ENGINES = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def one(engine: str, path: Path) -> dict:
    from lmforge.data.tokenizer import Tokenizer

    torch.set_num_threads(1)
    ids_of = Tokenizer.load(path).encode
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    eng = ENGINES[engine](path)
    setup_s = time.perf_counter() - t0
    compile_ms, steps = {}, []
    for name, (schema, doc) in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = eng.compile(schema)
        compile_ms[name] = round((time.perf_counter() - t0) * 1e3, 2)
        ids = ids_of(compact(doc))
        for _ in range(3):
            steps += eng.walk(compiled, ids)
    steps_us = sorted(s * 1e6 for s in steps)
    return dict(engine=engine, tokenizer=path.name, setup_s=round(setup_s, 3), compile_ms=compile_ms,
                compile_ms_median=round(statistics.median(compile_ms.values()), 2),
                mask_us_p50=round(steps_us[len(steps_us) // 2], 1),
                mask_us_p99=round(steps_us[int(len(steps_us) * 0.99)], 1), mask_steps=len(steps_us),
                rss_growth_mib=round((proc.memory_info().rss - rss0) / 2**20, 1))


def part_engines(args) -> list[dict]:
    paths = [small_tokenizer_path(args.cache, args.small), large_tokenizer_path(args.cache, args.vocab)]
    rows = []
    for path in paths:
        for engine in ENGINES:
            cmd = [sys.executable, __file__, "--one", engine, str(path)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            if p.returncode != 0:
                rows.append(dict(engine=engine, tokenizer=path.name, error=p.stderr.strip().splitlines()[-1]))
            else:
                rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# -- part 2: the serving engine, free and constrained rows in one batch --------------------------------
def part_batch(args) -> list[dict]:
    from lmforge.config import ModelConfig
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.eval.open_run import load_run
    from lmforge.models import Transformer
    from lmforge.serve.engine import Engine, SamplingParams
    from lmforge.serve.grammar import json_grammar

    torch.set_num_threads(args.threads)
    models = []
    if Path(args.run).is_dir():
        run = load_run(args.run)
        models.append((f"{args.run} ({run.tokenizer.vocab_size} ids)", run.model, run.tokenizer))
    big = Tokenizer.load(large_tokenizer_path(args.cache, args.vocab))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=big.vocab_size, d_model=256, n_layers=4, n_heads=4,
                                    n_kv_heads=4, max_seq_len=512, tie_embeddings=False)).eval()
    models.append((f"random d256 L4 ({big.vocab_size} ids)", model, big))
    out = []
    for name, model, tok in models:
        prompt = tok.encode("Write the scores as JSON: ")
        B, half = args.batch, args.batch // 2
        grammar = json_grammar(tok, SCHEMA_LONG)
        free = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0)
        con = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, grammar=grammar)
        mask_s: list[float] = []
        mixes = {"free": [free] * B, "mixed": [free] * (B - half) + [con] * half, "constrained": [con] * B}
        times: dict[str, list[float]] = {k: [] for k in mixes}
        eng = Engine(model, tok.decode, max_batch_size=B)
        masking = [0.0]  # seconds spent in the engine's masking seam
        constrain = eng._constrain

        def timed(rows, logits, constrain=constrain, masking=masking):
            t0 = time.perf_counter()
            constrain(rows, logits)
            masking[0] += time.perf_counter() - t0

        eng._constrain = timed
        with eng:
            eng.generate([prompt], SamplingParams(max_tokens=4))  # warm up
            for _ in range(args.repeats):
                for kind, params in mixes.items():
                    reqs, done = [], []
                    t0 = time.perf_counter()
                    for p in params:
                        ev = threading.Event()
                        reqs.append(eng.submit([prompt], p, lambda e, ev=ev: e.finish_reason and ev.set()))
                        done.append(ev)
                    for ev in done:
                        ev.wait()
                    times[kind].append(time.perf_counter() - t0)
                    if kind == "constrained":
                        mask_s.append(masking[0])
                    masking[0] = 0.0
        tps = {k: B * args.max_tokens / statistics.median(v) for k, v in times.items()}
        row = dict(model=name, batch=B, max_tokens=args.max_tokens, repeats=args.repeats,
                   tokens_per_s={k: round(v, 1) for k, v in tps.items()},
                   ratio_mixed_over_free=round(tps["mixed"] / tps["free"], 3),
                   ratio_constrained_over_free=round(tps["constrained"] / tps["free"], 3),
                   # the share of an all-constrained round's wall time spent masking (less noisy than
                   # the ratios on a shared machine), and per step (one step decodes B rows)
                   mask_share_constrained=round(statistics.median(mask_s) / statistics.median(
                       times["constrained"]), 4),
                   mask_ms_per_step_constrained=round(statistics.median(mask_s) / args.max_tokens * 1e3, 3))
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["engines", "batch", "all"], default="all")
    ap.add_argument("--vocab", type=int, default=65536, help="ids of the large tokenizer")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/lmforge-bench-constrained"))
    ap.add_argument("--run", default=str(REPO / "runs/demo"))
    ap.add_argument("--small", type=Path, default=REPO / "data/cache/demo/tokenizer.json",
                    help="lmforge's own tokenizer (else one is trained on the shipped corpus)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/constrained_decode.json")
    ap.add_argument("--one", nargs=2, metavar=("ENGINE", "TOKENIZER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], Path(args.one[1]))))
        return
    args.cache.mkdir(parents=True, exist_ok=True)
    result = dict(machine=machine_info(threads=args.threads),
                  args={k: str(v) for k, v in vars(args).items() if k != "one"})
    if args.part in ("engines", "all"):
        result["engines"] = part_engines(args)
        print_markdown_table(
            ["engine", "tokenizer", "adapter s", "compile ms (median)", "mask p50 us", "mask p99 us",
             "RSS MiB"],
            [[r["engine"], r["tokenizer"], *([str(r.get(k, "-")) for k in (
                "setup_s", "compile_ms_median", "mask_us_p50", "mask_us_p99", "rss_growth_mib")]
                if "error" not in r else ["error: " + r["error"][:60], "", "", "", ""])]
             for r in result["engines"]])
    if args.part in ("batch", "all"):
        result["batch"] = part_batch(args)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
