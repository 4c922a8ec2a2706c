"""`lmforge eval MODE`: the evaluations of a run, one explicit mode each.

    lmforge eval loss    [RUN]                        validation loss, perplexity, bits per byte
    lmforge eval data    [RUN] --data TEXT            the same on any text, in sliding windows
    lmforge eval tasks   [RUN] --tasks FILES          lm-evaluation-harness YAML tasks, builtin:code
    lmforge eval compare RUN RUN... --tasks FILES     the same tasks on several runs, side by side
    lmforge eval exact   [RUN] --tasks FILE.jsonl     exact match of greedy chat replies (lmforge tasks)
    lmforge eval redteam [RUN] [--redteam-prompts F]  attack success and over-refusal rates

Each mode takes the flags it uses and no other, under the names they had. Until this release `lmforge eval`
chose the mode from which flags were given and from the suffix of --tasks; that form still works for one
release, prints one line naming the new form on stderr, and then goes."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from lmforge.cli.numbers import BATCH, FEWSHOT, POSITIVE, SEED, TOKENS, number
from lmforge.cli.verbs.base import Verb, config_args, weights_arg
from lmforge.errors import LmforgeError

# Every flag of eval, declared once, in the order the one eval parser has always listed them.
_FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "tasks": (("--tasks",), dict(help="task evaluation instead of the loss: comma-separated task files in "
              "lm-evaluation-harness's YAML format, dirs of them, or builtin:code (tasks lmforge builds from "
              "installed packages' code); or one tasks JSONL (lmforge tasks) for exact-match accuracy of "
              "greedy chat replies")),
    "data": (("--data",), dict(help="perplexity, bits per byte, top-1/top-5 token accuracy and calibration "
             "on this text (a .txt/.md/.jsonl/.parquet file or a dir of them), in sliding windows, instead "
             "of the run's validation split")),
    "max_length": (("--max-length",), dict(type=number(TOKENS), default=None, help="--data: tokens per "
                   "window (default: the model's max_seq_len)")),
    "stride": (("--stride",), dict(type=number(TOKENS), default=None, help="--data: tokens the window moves "
               "by (default: half of --max-length; equal to it: disjoint windows)")),
    "num_fewshot": (("--num-fewshot",), dict(type=number(FEWSHOT), default=None, help="few-shot examples "
                    "per prompt (default: each task file's num_fewshot, else 0)")),
    "limit": (("--limit",), dict(type=number(POSITIVE), default=None, help="first N documents of each task "
              "(a number below 1: that fraction): task files, a tasks JSONL (per task), --redteam (prompts "
              "per category) and --data (documents)")),
    "batch_size": (("--batch-size",), dict(type=number(BATCH), default=None, help="sequences per forward "
                   "(default 16; 32 for a tasks JSONL and --redteam)")),
    "seed": (("--seed",), dict(type=number(SEED), default=None, help="seed of the few-shot draws "
             "(default 1234)")),
    "chat": (("--chat",), dict(action="store_true", help="--tasks prompts as conversations rendered with the "
             "run's chat template (a fine-tuned model)")),
    "fewshot_as_multiturn": (("--fewshot-as-multiturn",), dict(action="store_true", help="with --chat: each "
                             "few-shot example its own user and assistant turn (default: one user message)")),
    "unsafe_code_exec": (("--unsafe-code-exec",), dict(action="store_true", help="--tasks: run the "
                         "model-written code of pass@k tasks without the operating-system sandbox "
                         "(bubblewrap), under the in-process audit hook only, which is not a security "
                         "boundary: only for code you trust, on a machine without the sandbox")),
    "all_checkpoints": (("--all-checkpoints",), dict(action="store_true", help="--tasks on every kept "
                        "checkpoint of the run: curves in eval_curves.md / eval_curves.png")),
    "no_contamination": (("--no-contamination",), dict(action="store_true", help="skip the report of each "
                         "task's 13-gram overlap with the run's training data")),
    "compare_out": (("--compare-out",), dict(default=None, help="with several runs: the comparison report "
                    "(default: eval_compare.md in the current dir)")),
    "overwrite": (("--overwrite",), dict(action="store_true", help="replace an existing --compare-out file")),
    "redteam": (("--redteam",), dict(action="store_true", help="attack success rate per category of greedy "
                "replies to lmforge's shipped red-team prompts (refusal, block-list and PII detectors) and "
                "the refusal rate on harmless look-alikes, instead of the loss")),
    "redteam_prompts": (("--redteam-prompts",), dict(help="a JSONL of {prompt, category} red-team records "
                        "instead of the shipped ones (implies --redteam); records with \"benign\": true are "
                        "the look-alikes (default: the shipped ones)")),
}

_HARNESS = ("tasks", "num_fewshot", "limit", "batch_size", "seed", "chat", "fewshot_as_multiturn",
            "unsafe_code_exec", "all_checkpoints", "no_contamination")
# mode -> (what runs it (eval_mode's names), its one-line help, its flags, the flag it needs)
MODES: dict[str, tuple[str, str, tuple[str, ...], str | None]] = {
    "loss": ("loss", "validation loss, perplexity and bits per byte of a run or checkpoint", (), None),
    "data": ("data", "perplexity, bits per byte, token accuracy and calibration on any text, in sliding "
             "windows", ("data", "max_length", "stride", "limit", "batch_size"), "data"),
    "tasks": ("harness", "task files (lm-evaluation-harness YAML, dirs of them, builtin:code) on one run",
              _HARNESS, "tasks"),
    "compare": ("harness", "the same task files on several runs, side by side (eval_compare.md)",
                (*_HARNESS, "compare_out", "overwrite"), "tasks"),
    "exact": ("jsonl", "exact-match accuracy of greedy chat replies on a tasks JSONL (lmforge tasks)",
              ("tasks", "limit", "batch_size", "chat"), "tasks"),
    "redteam": ("redteam", "attack success per category on red-team prompts, and the refusal rate on "
                "harmless look-alikes", ("redteam_prompts", "limit", "batch_size", "chat"), None),
}

# -- the old form: the mode chosen from the flags given ------------------------------------------------
EVAL_MODES = {
    "harness": "--tasks with task files",
    "jsonl": "--tasks with a tasks JSONL",
    "redteam": "--redteam",
    "data": "--data",
    "loss": "the validation loss (no --tasks, --data or --redteam)",
}
# dest -> (option, the modes that use it). An option given to a mode that does not use it is refused, so
# no one reads a number believing it was limited, seeded or batched as asked when it was not.
EVAL_OPTIONS = {
    "limit": ("--limit", ("harness", "jsonl", "redteam", "data")),
    "batch_size": ("--batch-size", ("harness", "jsonl", "redteam", "data")),
    "num_fewshot": ("--num-fewshot", ("harness",)),
    "seed": ("--seed", ("harness",)),
    "chat": ("--chat", ("harness", "jsonl", "redteam")),  # a tasks JSONL and the red team always chat
    "fewshot_as_multiturn": ("--fewshot-as-multiturn", ("harness",)),
    "all_checkpoints": ("--all-checkpoints", ("harness",)),
    "no_contamination": ("--no-contamination", ("harness",)),
    "compare_out": ("--compare-out", ("harness",)),
    "max_length": ("--max-length", ("data",)),
    "stride": ("--stride", ("data",)),
}
_LOSS_HINTS = {"limit": "; the validation loss reads eval.max_batches batches (--set eval.max_batches=N)",
               "batch_size": "; the validation loss batches by eval.batch_size (--set eval.batch_size=N)"}


def eval_mode(args: argparse.Namespace) -> str:
    """The mode of `lmforge eval` its arguments ask for (a key of EVAL_MODES), refusing a mix of modes
    and an option the mode does not use (LmforgeError naming the option and the modes that take it)."""
    asked = [m for m, on in (("redteam", args.redteam or args.redteam_prompts), ("data", args.data),
                             ("tasks", args.tasks)) if on]
    if len(asked) > 1:
        raise LmforgeError(f"{' and '.join('--' + m for m in asked)} are different evaluations; give one "
                           "of them per call")
    mode = asked[0] if asked else "loss"
    if mode == "tasks":
        mode = "jsonl" if args.tasks.lower().endswith(".jsonl") else "harness"
    for dest, (flag, modes) in EVAL_OPTIONS.items():
        value = getattr(args, dest)
        if value is not None and value is not False and mode not in modes:
            raise LmforgeError(f"{flag} does not apply to {EVAL_MODES[mode]}; it goes with "
                               f"{', '.join(EVAL_MODES[m] for m in modes)}"
                               + (_LOSS_HINTS.get(dest, "") if mode == "loss" else ""))
    return mode


def _add(p: argparse.ArgumentParser, dest: str, **changes) -> None:
    names, kwargs = _FLAGS[dest]
    p.add_argument(*names, **{**kwargs, **changes})


def _legacy_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    weights_arg(p)
    p.add_argument("path", nargs="*", help="run dir, checkpoint dir or Hugging Face dir (default: "
                   "run.dir of -c); with --tasks, several are compared side by side")
    for dest in _FLAGS:
        _add(p, dest)


def _mode_args(name: str):
    _, _, dests, needed = MODES[name]

    def arguments(p: argparse.ArgumentParser) -> None:
        config_args(p)
        weights_arg(p)
        if name == "compare":
            p.add_argument("path", nargs="*", help="two or more run dirs, checkpoint dirs or Hugging Face "
                           "dirs")
        elif name == "tasks":  # several runs parse, to be pointed at compare (not 'unrecognized')
            p.add_argument("path", nargs="*", help="run dir, checkpoint dir or Hugging Face dir (default: "
                           "run.dir of -c; several: lmforge eval compare)")
        else:
            p.add_argument("path", nargs="?", help="run dir, checkpoint dir or Hugging Face dir (default: "
                           "run.dir of -c)")
        for dest in dests:
            _add(p, dest, **({"required": True} if dest == needed else {}))
        # the flags of other modes read as unset, so the one code path below serves every mode
        p.set_defaults(**{d: False if _FLAGS[d][1].get("action") == "store_true" else None
                          for d in _FLAGS if d not in dests})

    return arguments


def _mode_run(name: str):
    internal = MODES[name][0]

    def run(args: argparse.Namespace) -> int:
        args.path = [args.path] if isinstance(args.path, str) else list(args.path or [])
        jsonl = bool(args.tasks) and args.tasks.lower().endswith(".jsonl")
        if name in ("tasks", "compare") and jsonl:
            raise LmforgeError(f"--tasks {args.tasks} is a tasks JSONL: lmforge eval exact scores it; "
                               f"lmforge eval {name} takes task files (YAML, dirs of them, builtin:code)")
        if name == "exact" and not jsonl:
            raise LmforgeError("lmforge eval exact scores one tasks JSONL (a .jsonl file from lmforge "
                               f"tasks), got --tasks {args.tasks}; task files go to lmforge eval tasks")
        if name == "tasks" and len(args.path) > 1:
            raise LmforgeError(f"{len(args.path)} runs given: lmforge eval compare evaluates several side by "
                               "side; lmforge eval tasks takes one")
        if name == "compare" and len(args.path) < 2:
            raise LmforgeError("lmforge eval compare takes two or more runs; one run: lmforge eval tasks")
        if name == "redteam":
            args.redteam = True
        eval_mode(args)  # the same refusals as the old form (the parser already keeps other modes' flags out)
        from lmforge.cli.verbs.eval_run import run_mode

        return run_mode(args, internal)

    return run


def _legacy_run(args: argparse.Namespace) -> int:
    internal = eval_mode(args)  # refuses an option the mode would not use
    name = {"harness": "compare" if len(args.path) > 1 else "tasks", "jsonl": "exact"}.get(internal, internal)
    rest = [a for a in (getattr(args, "argv", None) or [])[1:] if a != "--redteam"]
    if int(os.environ.get("RANK", "0")) == 0:
        print("lmforge eval: warning: choosing the evaluation by its flags is deprecated and goes after "
              f"this release; name the mode: {shlex.join(['lmforge', 'eval', name, *rest])}", file=sys.stderr)
    from lmforge.cli.verbs.eval_run import run_mode

    return run_mode(args, internal)


EVAL = Verb(
    "eval", "validation loss, perplexity and bits per byte of a run or checkpoint", _legacy_args, _legacy_run,
    epilog="modes (lmforge eval MODE --help: its flags):\n" + "".join(f"  {m:<8} {h}\n" for m, (_, h, _, _)
                                                                    in MODES.items())
    + "without a mode (deprecated; goes after this release) the flags choose: --tasks, --data, --redteam",
    modes=tuple(Verb(m, h, _mode_args(m), _mode_run(m)) for m, (_, h, _, _) in MODES.items()))
