"""`lmforge <verb>`: a table from verb to entry function, and the one place user errors are printed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from lmforge.errors import LmforgeError


def _config(args: argparse.Namespace):
    from lmforge.config.load import load_config

    return load_config(args.config, args.set)


def cmd_prepare(args: argparse.Namespace) -> int:
    from lmforge.data import prepare

    prepare(_config(args))
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lmforge.data.curate import curate

    console = Console(highlight=False)
    say = lambda m: console.print(m, markup=False)
    summary = curate(_config(args), overwrite=args.overwrite, console=say)
    table = Table(title="lmforge data", show_header=True)
    table.add_column("step")
    table.add_column("removed", justify="right")
    for name, n in summary["removed"].items():
        table.add_row(name, f"{n:,}")
    table.add_row("documents in -> out", f"{summary['docs_in']:,} -> {summary['docs_out']:,}")
    if summary["bad_input"]:
        table.add_row("bad input skipped", f"{summary['bad_input']:,}")
    console.print(table)
    console.print(f"{len(summary['shards'])} shards in {summary['output_dir']}/data, "
                  f"{summary['docs_per_s']:,.0f} docs/s; report: {summary['report']}", markup=False)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from lmforge.train.trainer import train

    train(_config(args), resume=args.resume)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from lmforge.eval.entry import evaluate

    evaluate(_run_path(args), args.set)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lmforge.eval.entry import generate_text

    overrides = list(args.set)
    if args.prompt is not None:
        # Quote through YAML so any prompt text survives as a string.
        import json

        overrides.append(f"generate.prompt={json.dumps(args.prompt)}")
    console = Console(highlight=False)
    for i, text in enumerate(generate_text(_run_path(args), overrides)):
        if i:
            console.rule()
        console.print(text, markup=False)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from lmforge.checkpoint.hf_io import import_hf

    import_hf(args.src, args.out, overwrite=args.overwrite)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from lmforge.checkpoint.hf_io import export_hf

    if args.format != "hf":
        raise LmforgeError(f"--format {args.format!r} is not supported; valid formats: hf")
    export_hf(args.src, args.out, overwrite=args.overwrite, max_shard_size=int(args.max_shard_gb * 2**30))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from lmforge.config.load import dump_config

    sys.stdout.write(dump_config(_config(args)))
    return 0


def _run_path(args: argparse.Namespace) -> str:
    if args.path:
        return args.path
    if args.config:
        return _config(args).run.dir
    raise LmforgeError("give a run dir or checkpoint dir (e.g. runs/demo), or -c CONFIG to use its run.dir")


VERBS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "prepare": (cmd_prepare, "read sources, train the tokenizer, write token shards"),
    "data": (cmd_data, "clean, filter, redact and deduplicate a corpus (the curate section)"),
    "train": (cmd_train, "pretrain a model (prepares data on first use)"),
    "eval": (cmd_eval, "validation loss, perplexity and bits per byte of a run or checkpoint"),
    "generate": (cmd_generate, "sample text from a run or checkpoint"),
    "import": (cmd_import, "convert a Hugging Face Llama, Mistral, Qwen2 or GPT-2 dir to an lmforge run"),
    "export": (cmd_export, "write a run, checkpoint or imported model as a Hugging Face model dir"),
    "config": (cmd_config, "print the resolved config (defaults + file + --set)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmforge", description="From raw text to a trained language model.")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, (_, help_text) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in ("import", "export"):
            p.add_argument("src", help="Hugging Face model dir" if name == "import" else
                           "run dir, checkpoint dir or imported model dir")
            p.add_argument("out", help="output dir (must be empty or missing)")
            p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")
            if name == "export":
                p.add_argument("--format", default="hf", help="output format (hf)")
                p.add_argument("--max-shard-gb", type=float, default=5.0,
                               help="split the weights into safetensors shards of at most this size")
            continue
        p.add_argument("-c", "--config", help="YAML config file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.max_steps=100 (repeatable)")
        if name == "train":
            p.add_argument("--resume", action="store_true", help="continue the run in run.dir from its "
                           "latest checkpoint")
        if name == "data":
            p.add_argument("--overwrite", action="store_true", help="replace an output dir that holds a "
                           "run with different settings")
        if name in ("eval", "generate"):
            p.add_argument("path", nargs="?", help="run dir or checkpoint dir (default: run.dir of -c)")
        if name == "generate":
            p.add_argument("--prompt", help="text to continue (same as --set generate.prompt=...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = VERBS[args.verb][0]
    try:
        return handler(args)
    except LmforgeError as e:
        code = getattr(e, "exit_code", 2)
        print(f"lmforge {args.verb}: error: {e}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"lmforge {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
