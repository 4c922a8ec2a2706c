"""Verbs that make a run smaller: `prune` (sparsity or whole heads / channels, optional recovery) and
`quantize` (weight-only int8 / int4, round to nearest or GPTQ)."""

from __future__ import annotations

import argparse

from lmforge.cli.numbers import COUNT, OPEN_FRACTION, TOKENS, number, whole
from lmforge.cli.verbs.base import WEIGHTS, WEIGHTS_HELP, Verb


def _prune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="run dir or checkpoint dir (a causal_lm run)")
    p.add_argument("out", help="output run dir (must be empty or missing)")
    p.add_argument("--method", required=True, choices=("magnitude", "2:4", "heads", "channels"),
                   help="magnitude: unstructured; 2:4: 2 of every 4 weights along the input dim; heads / "
                   "channels: remove whole attention heads (kv groups) / MLP channels, a smaller dense model")
    p.add_argument("--sparsity", type=number(OPEN_FRACTION),
                   help="magnitude: fraction of the weights zeroed, in [0, 1)")
    p.add_argument("--scope", default="layer", choices=("layer", "global"),
                   help="magnitude: rank the weights per matrix (layer) or all together (global)")
    p.add_argument("--heads", type=number(COUNT),
                   help="heads: query heads removed per layer (a multiple of the GQA "
                   "group size)")
    p.add_argument("--channels", type=number(COUNT), help="channels: MLP hidden channels removed per layer")
    p.add_argument("--ratio", type=number(OPEN_FRACTION),
                   help="heads / channels: the fraction removed instead of a count")
    p.add_argument("--score", default="magnitude", choices=("magnitude", "wanda"),
                   help="importance: weight magnitude, or Wanda's |W| * ||X|| on calibration text")
    p.add_argument("--calib", help="--score wanda: calibration text (.txt/.md/.jsonl/.parquet file or a "
                   "folder; default: the run's train split)")
    p.add_argument("--include-head", action="store_true", help="magnitude / 2:4: prune the output "
                   "projection too (the embedding table when tied)")
    p.add_argument("--recover-steps", type=number(whole(0, 10**9)), default=0,
                   help="steps of causal-LM training on the run's "
                   "data after pruning (sparsity kept)")
    p.add_argument("-c", "--config", help="recovery config: YAML sections (train:, optim:, schedule:...) "
                   "over the source run's config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recovery config key, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")


def _prune(args: argparse.Namespace) -> int:
    from lmforge.compress.prune import PruneSpec, prune_run

    spec = PruneSpec(method=args.method, sparsity=args.sparsity, scope=args.scope, heads=args.heads,
                     channels=args.channels, ratio=args.ratio, score=args.score, calib=args.calib,
                     include_head=args.include_head)
    prune_run(args.src, args.out, spec, recover_steps=args.recover_steps, recovery_config=args.config,
              overrides=args.set, overwrite=args.overwrite, weights=args.weights)
    return 0


def _quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="run dir, checkpoint dir or Hugging Face dir")
    p.add_argument("out", help="output run dir (must be empty or missing)")
    p.add_argument("--bits", type=number(whole(1, 64)), default=4, help="4 or 8 bits per weight (default 4)")
    p.add_argument("--group-size", type=number(whole(0, 1 << 20)), default=None,
                   help="weights per scale along the inputs (default "
                   "128 for int4; int8 is per output channel unless given; 0: per-channel)")
    p.add_argument("--asymmetric", action="store_true", help="a zero point per group as well as a scale")
    p.add_argument("--method", default="rtn", help="rtn (round to nearest) or gptq (calibrated)")
    p.add_argument("--calib", help="calibration text: .txt/.md/.jsonl/.parquet file or folder (default: the "
                   "run's validation shards)")
    p.add_argument("--calib-samples", type=number(whole(1, 100_000)), default=128,
                   help="calibration sequences (default 128)")
    p.add_argument("--calib-seq-len", type=number(TOKENS), default=256,
                   help="tokens per calibration sequence "
                   "(default 256, at most model.max_seq_len)")
    p.add_argument("--act-order", action="store_true", help="gptq: quantize columns by decreasing "
                   "activation energy (group parameters fixed beforehand)")
    p.add_argument("--quantize-head", action="store_true", help="quantize an untied output head too")
    p.add_argument("--quantize-embeddings", action="store_true", help="quantize the token embedding table "
                   "too (round to nearest; a tied output head then reads it)")
    p.add_argument("--keep-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of the weights kept in floating point (embeddings, norms)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")


def _quantize(args: argparse.Namespace) -> int:
    from lmforge.compress.quantize import quantize_run

    group = args.group_size if args.group_size is not None else (None if args.bits == 8 else 128)
    quantize_run(args.src, args.out, bits=args.bits, group_size=group or None, symmetric=not args.asymmetric,
                 method=args.method, calib=args.calib, calib_samples=args.calib_samples,
                 calib_seq_len=args.calib_seq_len, overwrite=args.overwrite, head=args.quantize_head,
                 embeddings=args.quantize_embeddings,
                 act_order=args.act_order, keep_dtype=args.keep_dtype)
    return 0


PRUNE = Verb("prune", "prune a run (magnitude, 2:4, whole heads or MLP channels), optionally with a short "
             "recovery fine-tune: a new run dir and prune_report.json", _prune_args, _prune)
QUANTIZE = Verb("quantize", "weight-only int8 / int4 quantization of a run (round-to-nearest or GPTQ): a "
                "new run dir that eval / generate / export load", _quantize_args, _quantize)
