"""What a verb is (its name, help, arguments and handler side by side) and the pieces several verbs share.

A verb module imports only argparse-level things at the top: `lmforge --help` builds every verb's parser, so
torch, pydantic and the rest are imported inside the handlers, when a verb runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from lmforge.cli.numbers import number, real
from lmforge.errors import LmforgeError


@dataclass(frozen=True)
class Verb:
    """One `lmforge <name>`: `arguments` declares its flags on its parser, `run` handles the parsed ones and
    returns the exit status. `modes` are explicit sub-verbs (`lmforge eval tasks ...`), each a Verb too."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    epilog: str | None = None
    modes: tuple[Verb, ...] = field(default=())


WEIGHTS = ("model", "ema", "swa")
WEIGHTS_HELP = "the trained weights (model) or their average kept during training (averaging.ema / .swa)"
GIGABYTES = real(0.0, float(1 << 20), lo_open=True)  # memory in GiB: above 0, at most a petabyte


def config_args(p: argparse.ArgumentParser) -> None:
    """-c CONFIG and --set KEY=VALUE: how a verb that reads the config tree is given it."""
    p.add_argument("-c", "--config", help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.max_steps=100 (repeatable)")


def weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)


def load_config(args: argparse.Namespace):
    """The resolved config of -c and --set."""
    from lmforge.config.load import load_config

    return load_config(args.config, args.set)


def run_path(args: argparse.Namespace) -> str:
    """The run a verb reads: its positional path, else run.dir of -c."""
    if args.path:
        return args.path
    if args.config:
        return load_config(args).run.dir
    raise LmforgeError("give a run dir or checkpoint dir (e.g. runs/demo), or -c CONFIG to use its run.dir")


def quantized_args(p: argparse.ArgumentParser) -> None:
    """serve's and generate's --quantized (the same CPU path gives the same tokens in both)."""
    p.add_argument("--quantized", choices=("int8", "int4", "auto"), default=None,
                   help="run weight-only quantized linear layers on the fastest CPU path that fits "
                   "--memory-budget-mb: a run from `lmforge quantize` keeps its integers (auto); a "
                   "full-precision run is quantized in memory (round to nearest; auto: int8)")
    p.add_argument("--quant-path", choices=("auto", "kernel-bf16", "kernel-fp32", "dequant-fp32",
                                            "dequant-bf16"), default="auto",
                   help="how --quantized layers run (default auto: a start-up probe of a few seconds "
                   "picks the fastest): torch's int kernels fed bf16 or fp32 activations, or the "
                   "weights dequantized once to fp32 or bf16 (fast, 4 or 2 bytes a weight)")
    p.add_argument("--memory-budget-mb", type=number(real(0.0, float(1 << 30), lo_open=True)),
                   default=None, metavar="MIB",
                   help="--quantized: the most MiB the weights may take (default: no limit)")
