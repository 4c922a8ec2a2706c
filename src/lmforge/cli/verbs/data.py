"""Verbs that make training data: `prepare` (tokenizer and token shards), `data` (curation), `tasks`
(verifiable instruction tasks as chat JSONL)."""

from __future__ import annotations

import argparse

from lmforge.cli.numbers import RECORDS, SEED, number, whole
from lmforge.cli.verbs.base import Verb, config_args, load_config
from lmforge.errors import LmforgeError
from lmforge.utils.io import check_new_file


def _prepare(args: argparse.Namespace) -> int:
    from lmforge.config.methods import method_facts
    from lmforge.data import prepare

    cfg = load_config(args)
    if method_facts(cfg).chat:  # chat data, the fine-tuned model's tokenizer
        from lmforge.checkpoint.runs import resolve_init_from
        from lmforge.data.sft import prepare_sft

        prepare_sft(resolve_init_from(cfg, derived=True))  # a run's own config.yaml states what it derived
        return 0
    prepare(cfg)
    return 0


PREPARE = Verb("prepare", "read sources, train the tokenizer, write token shards", config_args, _prepare)


def _data_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace an output dir that holds a "
                   "run with different settings")


def _data(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lmforge.data.curate import curate

    console = Console(highlight=False)
    say = lambda m: console.print(m, markup=False)  # noqa: E731
    summary = curate(load_config(args), overwrite=args.overwrite, console=say)
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


DATA = Verb("data", "clean, filter, redact and deduplicate a corpus (the curate section)", _data_args, _data)


def _tasks_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("-o", "--out", help="JSONL file to write (training records)")
    p.add_argument("--n", type=number(RECORDS), default=2000, help="records to write")
    p.add_argument("--seed", type=number(SEED), default=0, help="seed: the same seed writes the same "
                   "records")
    p.add_argument("--tasks", help="comma-separated task names (default: all but the safety data "
                   "refuse,benign, which come only when named; see --list)")
    p.add_argument("--difficulty", type=number(whole(1, 100)), default=1,
                   help="digits / lengths of the tasks (1: easiest; refuse / benign: framing 1-3)")
    p.add_argument("--system", help="a system prompt to put in every record")
    p.add_argument("--test-out", help="also write a held-out file whose prompts train never has")
    p.add_argument("--n-test", type=number(RECORDS), default=200, help="held-out records to aim for")
    p.add_argument("--unique", action="store_true", help="each prompt at most once (small task spaces: "
                   "fewer than --n records when the prompts run out)")
    p.add_argument("--exclude-prompts", action="append", default=[], metavar="FILE",
                   help="leave out every prompt of these records (JSONL / Parquet; repeatable): "
                   "prompt-disjoint SFT / RL / test sets of one small task space")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--list", action="store_true", help="print the task names and exit")
    p.add_argument("--unpaired", action="store_true", help="write KTO's unpaired records: each "
                   "pair's chosen answer (label true) and rejected answer (label false) apart")
    p.add_argument("--pairs", action="store_true", help="write preference pairs (prompt, chosen: the "
                   "answer, rejected: a wrong answer of the same task) for DPO-style training")
    p.add_argument("--labelled", action="store_true", help="write the shipped labelled set "
                   "instead (sentiment-like reviews {sentence, label} for objective classify; --test-out: "
                   "validation)")
    p.add_argument("--tagged", action="store_true", help="write the shipped tagged set instead (code lines "
                   "{tokens, tags} with BIO tags for objective tag; --test-out: validation)")
    p.add_argument("--qa", action="store_true", dest="squad", help="write the shipped question-answering "
                   "set instead (SQuAD-like {context, question, answers} over code snippets for objective "
                   "qa; --test-out: validation)")


def _tasks(args: argparse.Namespace) -> int:
    from lmforge.data.instruct_tasks import (
        generate,
        pairs_of,
        prompts_in,
        select,
        split_disjoint,
        task_names,
        unpaired_of,
        write_jsonl,
    )

    if args.list:
        named_only = set(task_names(everything=True)) - set(task_names())
        print("\n".join(name + ("  (safety data; only when named)" if name in named_only else "")
                        for name in task_names(everything=True)))
        return 0
    for path in (args.out, args.test_out):
        if path:
            check_new_file(path, args.overwrite)  # both, before any record is made or written
    flags = {"labelled": "--labelled", "tagged": "--tagged", "squad": "--qa"}  # argparse dest -> flag
    shipped = [k for k in flags if getattr(args, k)]
    if len(shipped) > 1:
        raise LmforgeError(f"give one of {' / '.join(flags[k] for k in shipped)}")
    if shipped:
        from lmforge.data.labelled_tasks import labelled_split
        from lmforge.data.qa_tasks import qa_split
        from lmforge.data.tagged_tasks import tagged_split

        if not args.out:
            raise LmforgeError(f"{flags[shipped[0]]} writes its training records to -o/--out: give a .jsonl "
                               "path")
        split = {"labelled": labelled_split, "tagged": tagged_split, "squad": qa_split}[shipped[0]]
        train, val = split(args.n, args.n_test if args.test_out else 0, args.seed)
        n = write_jsonl(train, args.out, overwrite=args.overwrite)
        n_val = write_jsonl(val, args.test_out, overwrite=args.overwrite) if args.test_out else 0
        also = f" and {n_val:,} validation records to {args.test_out}" if args.test_out else ""
        print(f"wrote {n:,} {flags[shipped[0]][2:]} records to {args.out}{also}")
        return 0
    tasks = args.tasks.split(",") if args.tasks else None
    if args.pairs and args.unpaired:
        raise LmforgeError("give --pairs or --unpaired, not both")
    if args.unpaired:
        shape = lambda records: unpaired_of(pairs_of(records, args.seed))  # noqa: E731
    elif args.pairs:
        shape = lambda records: pairs_of(records, args.seed)  # noqa: E731
    else:
        shape = lambda records: records  # noqa: E731
    if args.test_out and (args.unique or args.exclude_prompts):
        raise LmforgeError("--test-out splits one stream; --unique / --exclude-prompts build prompt-disjoint "
                           "files one call at a time: give one or the other")
    if args.test_out:
        split = split_disjoint(tasks, args.n, args.n_test, args.seed, args.difficulty, args.system)
        n_train = write_jsonl(shape(split.train), args.out, overwrite=args.overwrite)
        n_test = write_jsonl(shape(split.test), args.test_out, overwrite=args.overwrite)
        print(f"wrote {n_train:,} training records to {args.out} and {n_test:,} held-out records to "
              f"{args.test_out} ({split.n_dropped:,} test prompts also in train were dropped)")
    elif args.unique or args.exclude_prompts:
        excluded = prompts_in(args.exclude_prompts)
        records = select(tasks, args.n, args.seed, args.difficulty, args.system, unique=args.unique,
                         exclude=excluded)
        n = write_jsonl(shape(records), args.out, overwrite=args.overwrite)
        note = f"; the task space had no more {'new ' if args.unique else ''}prompts" if n < args.n else ""
        print(f"wrote {n:,} records to {args.out} ({len(excluded):,} prompts excluded{note})")
    else:
        n = write_jsonl(shape(generate(tasks, args.n, args.seed, args.difficulty, args.system)), args.out,
                        overwrite=args.overwrite)
        print(f"wrote {n:,} records to {args.out}")
    return 0


TASKS = Verb("tasks", "write verifiable instruction tasks (arithmetic, strings, recall...) as chat JSONL",
             _tasks_args, _tasks)
