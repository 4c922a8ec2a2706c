"""Verbs that convert a model between forms: `import` (Hugging Face -> run), `export` (run -> Hugging Face,
PEFT or GGUF), `merge` (a LoRA run's adapters folded into its weights)."""

from __future__ import annotations

import argparse

from lmforge.cli.numbers import SHARD_GB, number
from lmforge.cli.verbs.base import WEIGHTS, WEIGHTS_HELP, Verb
from lmforge.errors import LmforgeError


def _src_out(p: argparse.ArgumentParser, src_help: str, out_help: str) -> None:
    p.add_argument("src", help=src_help)
    p.add_argument("out", help=out_help)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")


_RUN_SRC = "run dir, checkpoint dir or imported model dir"
_OUT_DIR = "output dir (must be empty or missing)"


def _import(args: argparse.Namespace) -> int:
    from lmforge.checkpoint.hf_io import import_hf

    import_hf(args.src, args.out, overwrite=args.overwrite)
    return 0


def _export_args(p: argparse.ArgumentParser) -> None:
    _src_out(p, _RUN_SRC, f"{_OUT_DIR}, or with --format gguf the .gguf file to write")
    p.add_argument("--adapter", action="store_true", help="a LoRA / DoRA / QLoRA run: write its "
                   "adapters in PEFT's format (out/adapter) and the base they need (out/base)")
    p.add_argument("--format", choices=("hf", "gguf"), default="hf",
                   help="hf: a Hugging Face model dir; gguf: one llama.cpp / Ollama file (out ends "
                   "in .gguf; an Ollama Modelfile is written beside it as OUT.Modelfile)")
    p.add_argument("--quant", choices=("f16", "q8_0", "q4_0", "q4_k_m"),
                   help="GGUF weight type (--format gguf only; default f16)")
    p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
    p.add_argument("--max-shard-gb", type=number(SHARD_GB), default=None,
                   help="split the weights into safetensors shards of at most this size (default 5; "
                   "--format hf only)")


def _export(args: argparse.Namespace) -> int:
    from lmforge.export.hf import export_adapter, export_run

    if args.format == "gguf":
        from lmforge.export.gguf import export_gguf

        if args.adapter:
            raise LmforgeError("--adapter writes a PEFT adapter dir; --format gguf writes the merged model "
                               "(give one or the other)")
        if args.max_shard_gb is not None:
            raise LmforgeError("--max-shard-gb applies to --format hf only (a GGUF export is one file)")
        export_gguf(args.src, args.out, quant=args.quant or "f16", overwrite=args.overwrite,
                    weights=args.weights)
        return 0
    if args.quant is not None:
        raise LmforgeError("--quant applies to --format gguf only (a Hugging Face export keeps the run's "
                           "dtype)")
    if args.adapter:
        export_adapter(args.src, args.out, overwrite=args.overwrite, weights=args.weights)
        return 0
    shard_gb = 5.0 if args.max_shard_gb is None else args.max_shard_gb
    export_run(args.src, args.out, overwrite=args.overwrite, max_shard_size=int(shard_gb * 2**30),
               weights=args.weights)
    return 0


def _merge_args(p: argparse.ArgumentParser) -> None:
    _src_out(p, _RUN_SRC, _OUT_DIR)
    p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)


def _merge(args: argparse.Namespace) -> int:
    from lmforge.export.hf import merge_run

    merge_run(args.src, args.out, overwrite=args.overwrite, weights=args.weights)
    return 0


IMPORT = Verb("import", "convert a Hugging Face model dir (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4, "
              "OLMo 2, Granite, SmolLM3, GPT-2, DeepSeek-V3, gpt-oss, mixtures of experts, BERT) to an "
              "lmforge run", lambda p: _src_out(p, "Hugging Face model dir", _OUT_DIR), _import)
EXPORT = Verb("export", "write a run, checkpoint or imported model as a Hugging Face model dir", _export_args,
              _export)
MERGE = Verb("merge", "fold a LoRA / DoRA / QLoRA run's adapters into its weights: a new run dir",
             _merge_args, _merge)
