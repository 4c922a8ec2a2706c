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

    cfg = _config(args)
    if cfg.objective.name in ("sft", "dpo", "reward", "rl"):  # chat data, the fine-tuned model's tokenizer
        from lmforge.checkpoint.runs import resolve_init_from
        from lmforge.data.sft import prepare_sft

        prepare_sft(resolve_init_from(cfg))
        return 0
    prepare(cfg)
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


def _train_objective(args: argparse.Namespace, name: str) -> int:
    """`lmforge train` with objective `name` (what the verb means), refusing a config naming another."""
    from lmforge.train.trainer import train

    cfg = _config(args)
    if "name" in cfg.objective.model_fields_set and cfg.objective.name != name:
        raise ConfigError(f"lmforge {args.verb} trains objective {name}, but the config sets objective.name="
                          f"{cfg.objective.name}; remove it or use lmforge train")
    train(cfg.model_copy(update={"objective": cfg.objective.model_copy(update={"name": name})}),
          resume=args.resume)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    return _train_objective(args, "sft")


def cmd_dpo(args: argparse.Namespace) -> int:
    return _train_objective(args, "dpo")


def cmd_reward(args: argparse.Namespace) -> int:
    return _train_objective(args, "reward")


def cmd_rl(args: argparse.Namespace) -> int:
    return _train_objective(args, "rl")


def cmd_tasks(args: argparse.Namespace) -> int:
    from lmforge.data.instruct_tasks import (
        generate,
        pairs_of,
        split_disjoint,
        task_names,
        unpaired_of,
        write_jsonl,
    )

    if args.list:
        print("\n".join(task_names()))
        return 0
    for path in (args.out, args.test_out):
        if path:
            check_replaceable(path)
    tasks = args.tasks.split(",") if args.tasks else None
    if args.pairs and args.unpaired:
        raise LmforgeError("give --pairs or --unpaired, not both")
    if args.unpaired:
        shape = lambda records: unpaired_of(pairs_of(records, args.seed))  # noqa: E731
    elif args.pairs:
        shape = lambda records: pairs_of(records, args.seed)  # noqa: E731
    else:
        shape = lambda records: records  # noqa: E731
    if args.test_out:
        split = split_disjoint(tasks, args.n, args.n_test, args.seed, args.difficulty, args.system)
        n_train = write_jsonl(shape(split.train), args.out, overwrite=args.overwrite)
        n_test = write_jsonl(shape(split.test), args.test_out, overwrite=args.overwrite)
        print(f"wrote {n_train:,} training records to {args.out} and {n_test:,} held-out records to "
              f"{args.test_out} ({split.n_dropped:,} test prompts also in train were dropped)")
    else:
        n = write_jsonl(shape(generate(tasks, args.n, args.seed, args.difficulty, args.system)), args.out,
                        overwrite=args.overwrite)
        print(f"wrote {n:,} records to {args.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from lmforge.eval.entry import eval_tasks, evaluate

    if args.tasks and not args.tasks.lower().endswith(".jsonl"):
        return _eval_harness(args)  # the one mode that takes several runs
    if len(args.path) > 1:
        raise LmforgeError("several runs are compared with --tasks only; give one run otherwise")
    args.path = args.path[0] if args.path else None
    if args.redteam or args.redteam_prompts:
        from rich.console import Console
        from rich.table import Table

        from lmforge.eval.entry import eval_redteam

        result = eval_redteam(_run_path(args), args.redteam_prompts, args.set, weights=args.weights)
        table = Table(title="red-team attack success (no refusal)", show_header=True)
        table.add_column("category")
        for col in ("prompts", "attack success", "refused", "flagged harmful", "flagged PII"):
            table.add_column(col, justify="right")
        for cat, r in result.items():
            table.add_row(cat, str(r["prompts"]), f"{r['attack_success_rate']:.1%}",
                          f"{r['refusal_rate']:.1%}", str(r["flagged_harmful"]), str(r["flagged_pii"]))
        Console(highlight=False).print(table)
        return 0
    if args.data:
        from lmforge.eval.entry import eval_data

        eval_data(_run_path(args), args.data, args.set, weights=args.weights, max_length=args.max_length,
                  stride=args.stride, batch_size=args.batch_size)
        return 0
    if args.tasks:
        from rich.console import Console
        from rich.table import Table

        acc = eval_tasks(_run_path(args), args.tasks, args.set, weights=args.weights)
        table = Table(title=f"exact match on {args.tasks}", show_header=True)
        table.add_column("task")
        for col in ("correct", "total", "accuracy"):
            table.add_column(col, justify="right")
        for task, (c, n) in acc.items():
            table.add_row(task, str(c), str(n), f"{c / n:.1%}")
        c, n = sum(c for c, _ in acc.values()), sum(n for _, n in acc.values())
        table.add_row("all", str(c), str(n), f"{c / n:.1%}")
        Console(highlight=False).print(table)
        return 0
    evaluate(_run_path(args), args.set, weights=args.weights)
    return 0


def _eval_harness(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lmforge.eval.harness import comparison_rows, eval_harness

    items = [t.strip() for t in args.tasks.split(",") if t.strip()]
    paths = _eval_paths(args)
    outs = eval_harness(paths, items, args.set, weights=args.weights, num_fewshot=args.num_fewshot,
                        limit=args.limit, batch_size=args.batch_size, seed=args.seed, chat=args.chat,
                        multiturn=args.fewshot_as_multiturn, all_checkpoints=args.all_checkpoints,
                        compare_out=args.compare_out, contamination=not args.no_contamination)
    console = Console(highlight=False)
    if len(outs) > 1:
        table = Table(title="runs side by side (eval_compare.md)", show_header=True)
        for col in ["task", "metric", *paths] + (["B - A", "z"] if len(outs) == 2 else []):
            table.add_column(str(col))
        for row in comparison_rows(outs):
            table.add_row(*row)
        console.print(table)
        return 0
    out = outs[0]
    table = Table(title=f"tasks at step {out['step']}", show_header=True)
    table.add_column("task")
    table.add_column("metric")
    for col in ("value", "± stderr", "chance"):
        table.add_column(col, justify="right")
    for name, r in out["tasks"].items():
        for k, v in r["metrics"].items():
            err, chance = r["stderr"].get(k), r["chance"].get(k)
            table.add_row(name, k, f"{v:.4f}", "" if err is None else f"{err:.4f}",
                          "" if chance is None else f"{chance:.4f}")
    console.print(table)
    return 0


def _eval_paths(args: argparse.Namespace) -> list[str]:
    if args.path:
        return list(args.path)
    args.path = None
    return [_run_path(args)]  # -c CONFIG: its run.dir


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lmforge.eval.entry import generate_text

    overrides = list(args.set)
    if args.prompt is not None:
        # Quote through YAML so any prompt text survives as a string.
        import json

        overrides.append(f"generate.prompt={json.dumps(args.prompt, ensure_ascii=False)}")
    console = Console(highlight=False)
    for i, text in enumerate(generate_text(_run_path(args), overrides, weights=args.weights, chat=args.chat)):
        if i:
            console.rule()
        console.print(text, markup=False)
    return 0


def cmd_constitution(args: argparse.Namespace) -> int:
    from lmforge.tools.constitution import load_constitution, run_constitution

    if args.write_default:
        from pathlib import Path

        import yaml

        from lmforge.utils.io import atomic_write_text

        check_replaceable(args.write_default)
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


def cmd_import(args: argparse.Namespace) -> int:
    from lmforge.checkpoint.hf_io import import_hf

    import_hf(args.src, args.out, overwrite=args.overwrite)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from lmforge.finetune.export import export_adapter, export_run

    if args.format != "hf":
        raise LmforgeError(f"--format {args.format!r} is not supported; valid formats: hf")
    if args.adapter:
        export_adapter(args.src, args.out, overwrite=args.overwrite, weights=args.weights)
        return 0
    export_run(args.src, args.out, overwrite=args.overwrite, max_shard_size=int(args.max_shard_gb * 2**30),
               weights=args.weights)
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from lmforge.finetune.export import merge_run

    merge_run(args.src, args.out, overwrite=args.overwrite, weights=args.weights)
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
    "dpo": (cmd_dpo, "preference optimisation on chosen/rejected pairs (objective dpo: DPO, IPO, SimPO, "
                     "ORPO, ... by preference.loss), full or with adapters"),
    "reward": (cmd_reward, "train a reward model on chosen/rejected pairs (objective reward: a scalar score "
                           "head, Bradley-Terry loss), full or with adapters"),
    "rl": (cmd_rl, "reinforcement learning on sampled completions scored by rewards (objective rl: GRPO "
                   "or RLOO by rl.algorithm), full or with adapters"),
    "sft": (cmd_sft, "fine-tune on chat data (objective sft): full, LoRA, DoRA or QLoRA (the finetune "
            "section)"),
    "constitution": (cmd_constitution, "Constitutional AI data: a model critiques and revises its answers "
                     "against principles (SFT data, revision pairs) and judges pairs of them (AI-feedback "
                     "pairs for DPO)"),
    "tasks": (cmd_tasks, "write verifiable instruction tasks (arithmetic, strings, recall...) as chat JSONL"),
    "eval": (cmd_eval, "validation loss, perplexity and bits per byte of a run or checkpoint"),
    "generate": (cmd_generate, "sample text from a run or checkpoint"),
    "import": (cmd_import, "convert a Hugging Face Llama, Mistral, Qwen2 or GPT-2 dir to an lmforge run"),
    "export": (cmd_export, "write a run, checkpoint or imported model as a Hugging Face model dir"),
    "merge": (cmd_merge, "fold a LoRA / DoRA / QLoRA run's adapters into its weights: a new run dir"),
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
        if name in ("import", "export", "merge"):
            p.add_argument("src", help="Hugging Face model dir" if name == "import" else
                           "run dir, checkpoint dir or imported model dir")
            p.add_argument("out", help="output dir (must be empty or missing)")
            p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")
            if name == "merge":
                p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
            if name == "export":
                p.add_argument("--adapter", action="store_true", help="a LoRA / DoRA / QLoRA run: write its "
                               "adapters in PEFT's format (out/adapter) and the base they need (out/base)")
                p.add_argument("--format", default="hf", help="output format (hf)")
                p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
                p.add_argument("--max-shard-gb", type=float, default=5.0,
                               help="split the weights into safetensors shards of at most this size")
            continue
        p.add_argument("-c", "--config", help="YAML config file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.max_steps=100 (repeatable)")
        if name == "tasks":
            p.add_argument("-o", "--out", help="JSONL file to write (training records)")
            p.add_argument("--n", type=int, default=2000, help="records to write")
            p.add_argument("--seed", type=int, default=0, help="seed: the same seed writes the same records")
            p.add_argument("--tasks", help="comma-separated task names (default: all; see --list)")
            p.add_argument("--difficulty", type=int, default=1,
                           help="digits / lengths of the tasks (1: easiest)")
            p.add_argument("--system", help="a system prompt to put in every record")
            p.add_argument("--test-out", help="also write a held-out file whose prompts train never has")
            p.add_argument("--n-test", type=int, default=200, help="held-out records to aim for")
            p.add_argument("--overwrite", action="store_true", help="replace existing output files")
            p.add_argument("--list", action="store_true", help="print the task names and exit")
            p.add_argument("--unpaired", action="store_true", help="write KTO's unpaired records: each "
                           "pair's chosen answer (label true) and rejected answer (label false) apart")
            p.add_argument("--pairs", action="store_true", help="write preference pairs (prompt, chosen: the "
                           "answer, rejected: a wrong answer of the same task) for DPO-style training")
            continue
        if name == "constitution":
            p.add_argument("path", nargs="?", help="the model: a run dir, checkpoint dir or Hugging Face dir")
            p.add_argument("--prompts", action="append", default=[], help="JSONL / Parquet prompts (prompt: "
                           "string or messages, or chat messages); repeatable")
            p.add_argument("-o", "--out", help="output dir: sft.jsonl, revisions.jsonl, feedback.jsonl")
            p.add_argument("--constitution", help="YAML / JSON principles (name, critique, revision); "
                           "default: lmforge's (see --write-default)")
            p.add_argument("--write-default", metavar="FILE", help="write the default constitution to FILE "
                           "(to edit) and exit")
            p.add_argument("--max-new-tokens", type=int, default=64, help="longest answer / critique")
            p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of answers")
            p.add_argument("--seed", type=int, default=0, help="seed of the principles drawn and the samples")
            p.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
            p.add_argument("--no-feedback", action="store_true", help="skip the AI-feedback pairs")
            p.add_argument("--overwrite", action="store_true", help="replace a non-empty output dir")
            continue
        if name in ("train", "sft", "dpo", "reward", "rl"):
            p.add_argument("--resume", action="store_true", help="continue the run in run.dir from its "
                           "latest checkpoint")
        if name == "data":
            p.add_argument("--overwrite", action="store_true", help="replace an output dir that holds a "
                           "run with different settings")
        if name in ("eval", "generate"):
            p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
        if name == "generate":
            p.add_argument("path", nargs="?", help="run dir or checkpoint dir (default: run.dir of -c)")
        if name == "eval":
            p.add_argument("path", nargs="*", help="run dir, checkpoint dir or Hugging Face dir (default: "
                           "run.dir of -c); with --tasks, several are compared side by side")
        if name == "generate":
            p.add_argument("--prompt", help="text to continue (same as --set generate.prompt=...)")
            p.add_argument("--chat", action="store_true", help="the prompt is a user message: render it with "
                           "the run's chat template and print the assistant's reply")
        if name == "eval":
            p.add_argument("--tasks", help="task evaluation instead of the loss: comma-separated task files "
                           "in lm-evaluation-harness's YAML format, dirs of them, or builtin:code (tasks "
                           "lmforge builds from installed packages' code); or one tasks JSONL (lmforge "
                           "tasks) for exact-match accuracy of greedy chat replies")
            p.add_argument("--data", help="perplexity, bits per byte, top-1/top-5 token accuracy and "
                           "calibration on this text (a .txt/.md/.jsonl/.parquet file or a dir of them), in "
                           "sliding windows, instead of the run's validation split")
            p.add_argument("--max-length", type=int, default=None, help="--data: tokens per window "
                           "(default: the model's max_seq_len)")
            p.add_argument("--stride", type=int, default=None, help="--data: tokens the window moves by "
                           "(default: half of --max-length; equal to it: disjoint windows)")
            p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt "
                           "(default: each task file's num_fewshot, else 0)")
            p.add_argument("--limit", type=float, default=None, help="first N documents of each task (a "
                           "number below 1: that fraction)")
            p.add_argument("--batch-size", type=int, default=16, help="sequences per forward")
            p.add_argument("--seed", type=int, default=1234, help="seed of the few-shot draws")
            p.add_argument("--chat", action="store_true", help="--tasks prompts as conversations rendered "
                           "with the run's chat template (a fine-tuned model)")
            p.add_argument("--fewshot-as-multiturn", action="store_true", help="with --chat: each few-shot "
                           "example its own user and assistant turn (default: one user message)")
            p.add_argument("--all-checkpoints", action="store_true", help="--tasks on every kept checkpoint "
                           "of the run: curves in eval_curves.md / eval_curves.png")
            p.add_argument("--no-contamination", action="store_true", help="skip the report of each task's "
                           "13-gram overlap with the run's training data")
            p.add_argument("--compare-out", default=None, help="with several runs: the comparison report "
                           "(default: eval_compare.md in the current dir)")
            p.add_argument("--redteam", action="store_true", help="attack success rate per category of "
                           "greedy replies to lmforge's shipped red-team prompts (refusal, block-list and "
                           "PII detectors), instead of the loss")
            p.add_argument("--redteam-prompts", help="a JSONL of {prompt, category} red-team records instead "
                           "of the shipped ones (implies --redteam)")
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
