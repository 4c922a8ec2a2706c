"""The table of `lmforge` verbs: one module per verb group, each verb its help, arguments and handler.

    data.py          prepare, data, tasks
    tokenizer.py     tokenizer and its modes (compare)
    training.py      train, dpo, reward, rl, sft, distill
    constitution.py  constitution
    evaluate.py      eval and its modes (eval_run.py: what each mode runs and prints)
    generate.py      generate
    serve.py         serve, jobs
    convert.py       import, export, merge
    compress.py      prune, quantize
    plan.py          config, plot-schedule, estimate, lr-find, scaling, sweep

A new verb is a `Verb` in one of these modules (or a new one) and a row of VERBS; `lmforge --help` lists the
verbs in VERBS' order."""

from __future__ import annotations

import argparse
from typing import NamedTuple

from lmforge.cli.verbs import (
    compress,
    constitution,
    convert,
    data,
    evaluate,
    generate,
    plan,
    serve,
    tokenizer,
    training,
)
from lmforge.cli.verbs.base import Verb

VERBS: tuple[Verb, ...] = (
    data.PREPARE, tokenizer.TOKENIZER,
    data.DATA, training.TRAIN, *training.METHODS, constitution.CONSTITUTION, data.TASKS,
    evaluate.EVAL, generate.GENERATE, serve.SERVE,
    serve.JOBS, convert.IMPORT, convert.EXPORT, convert.MERGE, compress.PRUNE, compress.QUANTIZE,
    plan.CONFIG, plan.PLOT_SCHEDULE, plan.ESTIMATE, plan.LR_FIND, plan.SCALING, plan.SWEEP,
)
BY_NAME: dict[str, Verb] = {v.name: v for v in VERBS}
assert len(BY_NAME) == len(VERBS), "two verbs share a name"
# A renamed verb's old name -> its name: the old one still runs for one release, with one warning line
# (`server` was one letter from `serve`, a different server).
RENAMED: dict[str, str] = {"server": "jobs"}
assert set(RENAMED.values()) <= set(BY_NAME) and not set(RENAMED) & set(BY_NAME)

DESCRIPTION = "From raw text to a trained language model."


def build_parser() -> argparse.ArgumentParser:
    """`lmforge`'s parser: one subparser per verb of VERBS."""
    renamed = ", ".join(f"{old} is now {new}" for old, new in RENAMED.items())
    parser = argparse.ArgumentParser(
        prog="lmforge", description=DESCRIPTION,
        epilog=f"renamed verbs (the old name works until the next release): {renamed}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb in VERBS:
        # a verb with modes lists them one a line in its epilog (argparse would run them together)
        fmt = argparse.RawDescriptionHelpFormatter if verb.epilog else argparse.HelpFormatter
        verb.arguments(sub.add_parser(verb.name, help=verb.help, description=verb.help, epilog=verb.epilog,
                                      formatter_class=fmt))
    return parser


def mode_parser(verb: Verb, mode: Verb) -> argparse.ArgumentParser:
    """The parser of `lmforge <verb> <mode>` (e.g. `lmforge eval tasks`)."""
    p = argparse.ArgumentParser(prog=f"lmforge {verb.name} {mode.name}", description=mode.help)
    mode.arguments(p)
    return p


class VerbInfo(NamedTuple):
    """One row of `table()`: a verb's name, its one-line help, its parser and its modes (rows too)."""

    name: str
    help: str
    parser: argparse.ArgumentParser
    modes: tuple[VerbInfo, ...]


def table() -> list[VerbInfo]:
    """Every verb of `lmforge`, in `lmforge --help`'s order, with the parser `main` uses for it: what the docs
    list (a docs test compares the two)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [VerbInfo(v.name, v.help, sub.choices[v.name],
                     tuple(VerbInfo(f"{v.name} {m.name}", m.help, mode_parser(v, m), ()) for m in v.modes))
            for v in VERBS]
