"""`lmforge constitution`: Constitutional AI data from a model's critiques and revisions."""

from __future__ import annotations

import argparse

from lmforge.cli.numbers import COUNT, SEED, TEMPERATURE, TOKENS, number
from lmforge.cli.verbs.base import Verb, config_args
from lmforge.errors import LmforgeError
from lmforge.utils.io import check_new_file


def _arguments(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("path", nargs="?", help="the model: a run dir, checkpoint dir or Hugging Face dir")
    p.add_argument("--prompts", action="append", default=[], help="JSONL / Parquet prompts (prompt: "
                   "string or messages, or chat messages); repeatable")
    p.add_argument("-o", "--out", help="output dir: sft.jsonl, revisions.jsonl, feedback.jsonl")
    p.add_argument("--constitution", help="YAML / JSON principles (name, critique, revision); "
                   "default: lmforge's (see --write-default)")
    p.add_argument("--write-default", metavar="FILE", help="write the default constitution to FILE "
                   "(to edit) and exit")
    p.add_argument("--max-new-tokens", type=number(TOKENS), default=64, help="longest answer / critique")
    p.add_argument("--temperature", type=number(TEMPERATURE), default=0.7,
                   help="sampling temperature of answers")
    p.add_argument("--seed", type=number(SEED), default=0, help="seed of the principles drawn and the "
                   "samples")
    p.add_argument("--limit", type=number(COUNT), default=None, help="use the first N prompts only")
    p.add_argument("--no-feedback", action="store_true", help="skip the AI-feedback pairs")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir (or the "
                   "existing FILE of --write-default)")


def _run(args: argparse.Namespace) -> int:
    from lmforge.tools.constitution import load_constitution, run_constitution

    if args.write_default:
        from pathlib import Path

        import yaml

        from lmforge.utils.io import atomic_write_text

        check_new_file(args.write_default, args.overwrite)
        principles = [vars(p) for p in load_constitution(None)]
        atomic_write_text(Path(args.write_default), yaml.safe_dump(principles, sort_keys=False, width=100))
        print(f"wrote the default constitution ({len(principles)} principles) to {args.write_default}")
        return 0
    if not args.path or not args.prompts or not args.out:
        raise LmforgeError("give the model (a run, checkpoint or Hugging Face dir), --prompts FILE and "
                           "-o DIR")
    run_constitution(args.path, args.prompts, args.out, constitution=args.constitution, overrides=args.set,
                     max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                     feedback=not args.no_feedback, limit=args.limit, overwrite=args.overwrite)
    return 0


CONSTITUTION = Verb("constitution", "Constitutional AI data: a model critiques and revises its answers "
                    "against principles (SFT data, revision pairs) and judges pairs of them (AI-feedback "
                    "pairs for DPO)", _arguments, _run)
