"""`lmforge <verb>`: a table from verb to entry function, and the one place user errors are printed."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator

from lmforge.errors import ConfigError, LmforgeDeprecationWarning, LmforgeError
from lmforge.utils.io import check_replaceable


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

    evaluate(_run_path(args), args.set, weights=args.weights)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lmforge.eval.entry import generate_text

    overrides = list(args.set)
    if args.prompt is not None:
        # Quote through YAML so any prompt text survives as a string.
        import json

        overrides.append(f"generate.prompt={json.dumps(args.prompt, ensure_ascii=False)}")
    console = Console(highlight=False)
    for i, text in enumerate(generate_text(_run_path(args), overrides, weights=args.weights)):
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
    export_hf(args.src, args.out, overwrite=args.overwrite, max_shard_size=int(args.max_shard_gb * 2**30),
              weights=args.weights)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from lmforge.config.load import dump_config

    sys.stdout.write(dump_config(_config(args)))
    return 0


def cmd_plot_schedule(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lmforge.tools.plots import plot_schedule, schedule_curve

    cfg = _config(args)
    check_replaceable(args.out)  # before any work
    curve = schedule_curve(cfg, world_size=args.world_size)
    out = plot_schedule(curve, args.out, title=f"{cfg.run.name}: {cfg.schedule.name} schedule")
    console = Console(highlight=False)
    last = len(curve.lrs) - 1
    end = curve.warmup_end
    console.print(f"schedule {cfg.schedule.name} in {cfg.schedule.unit}: {len(curve.lrs):,} steps, "
                  f"{curve.max_tokens:,} tokens", markup=False)
    console.print(f"peak lr      {max(curve.lrs):.4e} at step {curve.peak_step}", markup=False)
    console.print("warm-up end  " + (f"step {end} ({curve.tokens[end]:,} tokens seen)" if end is not None
                                     else "not reached within the run"), markup=False)
    console.print(f"final lr     {curve.lrs[last]:.4e} at step {last}", markup=False)
    console.print(f"wrote {out}", markup=False)
    return 0


def cmd_lr_find(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lmforge.tools.lr_finder import lr_find

    console = Console(highlight=False)
    if args.out:
        check_replaceable(args.out)  # before a sweep of minutes
    result = lr_find(_config(args), args.min_lr, args.max_lr, args.steps, args.out,
                     say=lambda m: console.print(m, markup=False))
    table = Table(title="lmforge lr-find", show_header=True)
    table.add_column("suggestion")
    table.add_column("lr", justify="right")
    table.add_row("steepest descent", f"{result.steepest_lr:.2e}")
    table.add_row("minimum / 10", f"{result.min_lr_div10:.2e}")
    table.add_row("(loss minimum at)", f"{result.min_loss_lr:.2e}")
    console.print(table)
    stop = "diverged" if result.diverged else "ran to the end"
    console.print(f"{len(result.lrs)} of {args.steps} steps ({stop}); smoothed loss "
                  f"{result.smoothed[0]:.4f} -> {min(result.smoothed):.4f}; plot: {result.png}", markup=False)
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
    "plot-schedule": (cmd_plot_schedule, "draw the learning rate a run will use, step by step, to a PNG"),
    "lr-find": (cmd_lr_find, "learning-rate range test on a fresh model: loss against an exponential lr "
                "sweep, with suggested peak lrs"),
}


WEIGHTS = ("model", "ema", "swa")
WEIGHTS_HELP = "the trained weights (model) or their average kept during training (averaging.ema / .swa)"


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
                p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
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
            p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
            p.add_argument("path", nargs="?", help="run dir or checkpoint dir (default: run.dir of -c)")
        if name == "generate":
            p.add_argument("--prompt", help="text to continue (same as --set generate.prompt=...)")
        if name == "plot-schedule":
            p.add_argument("-o", "--out", default="schedule.png",
                           help="PNG to write (default: schedule.png in the current dir; the run dir is "
                           "never created)")
            p.add_argument("--world-size", type=int, default=1,
                           help="data-parallel ranks the run will use: they set the tokens per step")
        if name == "lr-find":
            p.add_argument("--min-lr", type=float, default=1e-7, help="first lr of the sweep")
            p.add_argument("--max-lr", type=float, default=1.0, help="last lr of the sweep")
            p.add_argument("--steps", type=int, default=100, help="optimizer steps of the sweep")
            p.add_argument("-o", "--out", default="lr_find.png",
                           help="PNG to write (default: lr_find.png in the current dir; the run dir is "
                           "never created)")
    return parser


@contextlib.contextmanager
def _plain_warnings(verb: str, rank: int) -> Iterator[None]:
    """lmforge's own warnings (deprecated config keys) as one plain line each, from rank 0."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, LmforgeDeprecationWarning):
            return shown(message, category, filename, lineno, file, line)
        if rank == 0:
            print(f"lmforge {verb}: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = VERBS[args.verb][0]
    rank = int(os.environ.get("RANK", "0"))
    try:
        with _plain_warnings(args.verb, rank):
            return handler(args)
    except LmforgeError as e:
        code = getattr(e, "exit_code", 2)
        # Under torchrun a config error is raised identically on every rank: rank 0 says it once.
        if rank == 0 or not isinstance(e, ConfigError):
            where = f"[rank {rank}] " if rank else ""
            print(f"{where}lmforge {args.verb}: error: {e}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"lmforge {args.verb}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the file system said no (read-only, permissions, full disk): not a bug
        where = f" {e.filename}" if e.filename else ""
        print(f"lmforge {args.verb}: error: cannot use{where}: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
