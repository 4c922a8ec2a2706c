"""`lmforge tokenizer MODE`: tokenizers side by side. One mode today, `compare`: tokenizer files and/or
kinds to train on data.sources, measured on held-out text (data/tokenizer_compare.py), and with
--train-budget the bits per byte of a short training per tokenizer (tools/tokenizer_bpb.py)."""

from __future__ import annotations

import argparse

from lmforge.cli.numbers import number, whole
from lmforge.cli.verbs.base import Verb, config_args
from lmforge.errors import LmforgeError

# (key, column heading, format) of the report's table, in order
COLUMNS = (
    ("vocab_size", "vocab", "{:,}"), ("tokens_per_word", "tokens/word", "{:.3f}"),
    ("bytes_per_token", "bytes/token", "{:.3f}"), ("vocab_used", "vocab used", "{:.1%}"),
    ("unknown_rate", "unknown", "{:.2%}"), ("round_trip", "round trip", "{:.1%}"),
    ("encode_mb_per_s", "encode MB/s", "{:.2f}"), ("bpb", "bpb", "{:.4f}"),
)


def _compare_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("--tokenizer", action="append", default=[], metavar="PATH",
                   help="a tokenizer.json (or a folder holding one) to compare (repeatable)")
    p.add_argument("--train", action="append", default=[], metavar="KIND[:VOCAB]",
                   help="a tokenizer to train on the train split of data.sources: bpe, wordpiece or unigram, "
                   "with its vocabulary size (default data.tokenizer.vocab_size), e.g. unigram:8192 "
                   "(repeatable)")
    p.add_argument("--held-out", action="append", default=[], metavar="PATH",
                   help="held-out text (files or folders, read as data.sources; repeatable); default: the "
                   "validation split of data.sources (data.val_fraction / data.val_sources), which trained "
                   "tokenizers never see")
    p.add_argument("--held-out-chars", type=number(whole(1, 100_000_000)), default=1_000_000,
                   help="characters of held-out text measured (default 1,000,000)")
    p.add_argument("--train-budget", metavar="DURATION",
                   help="also train the config's model for this long per tokenizer (e.g. 60s, 5m; same seed) "
                   "and report its bits per byte of the held-out text")
    p.add_argument("--eval-chars", type=number(whole(1, 100_000_000)), default=200_000,
                   help="--train-budget: characters of the held-out text each model scores (default 200,000)")
    p.add_argument("--work-dir", help="--train-budget: where the runs go (kept; must be new or empty); "
                   "default: a temporary folder removed at the end")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--out", help="also write the report as JSON to this file")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def _compare(args: argparse.Namespace) -> int:
    import json
    import sys
    from pathlib import Path

    from lmforge.cli.verbs.base import load_config
    from lmforge.config.train import parse_duration
    from lmforge.data.tokenizer_compare import (
        Spec,
        check_specs,
        load_or_train,
        measure,
        parse_train,
        read_texts,
    )
    from lmforge.utils.io import atomic_write_text, check_new_file

    cfg = load_config(args)
    d = cfg.data
    specs = [Spec(p, path=p) for p in args.tokenizer]
    specs += [parse_train(t, d.tokenizer.vocab_size) for t in args.train]
    check_specs(specs)
    budget = None
    if args.train_budget is not None:
        try:
            budget = parse_duration(args.train_budget)
        except ValueError as e:
            raise LmforgeError(f"--train-budget: {e}") from None
        if budget <= 0:
            raise LmforgeError(f"--train-budget {args.train_budget}: give a positive duration")
    elif args.work_dir:
        raise LmforgeError("--work-dir holds the --train-budget runs; give --train-budget too, or drop it")
    work = Path(args.work_dir) if args.work_dir else None
    if work is not None and work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise LmforgeError(f"--work-dir {work} exists and is not an empty folder; give a new path")
    if args.out:
        check_new_file(args.out, args.overwrite)
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print  # stdout: the JSON alone
    train_chars = d.tokenizer.train_chars if any(s.path is None for s in specs) else 0
    train_docs, held = read_texts(d, cfg.run.seed, train_chars, args.held_out_chars, args.held_out or None)
    say(f"held-out text: {len(held):,} documents, {sum(map(len, held)):,} chars"
        + (f"; training text: {sum(map(len, train_docs)):,} chars" if train_chars else ""))
    rows: dict[str, dict] = {}
    toks = {}
    for spec in specs:
        if spec.path is None:
            say(f"training {spec.label}")
        toks[spec.label] = tok = load_or_train(spec, train_docs, d.tokenizer.min_frequency)
        rows[spec.label] = {"source": spec.path or "trained", "model": tok.model_type, **measure(tok, held)}
    if budget is not None:
        rows = _with_bpb(args, budget, work, toks, held, rows, say)
    report = {"held_out": {"documents": len(held), "chars": sum(map(len, held)),
                           "sources": args.held_out or "validation split of data.sources"},
              "train_budget_s": budget, "tokenizers": rows}
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        atomic_write_text(check_new_file(args.out, args.overwrite), text)
    if args.json:
        print(text, end="")
    else:
        _print_table(rows)
    return 0


def _with_bpb(args, budget, work, toks, held, rows, say) -> dict[str, dict]:
    import shutil
    import tempfile
    from pathlib import Path

    from lmforge.tools.tokenizer_bpb import budget_bpb

    scratch = Path(tempfile.mkdtemp(prefix="lmforge-tokenizer-compare-")) if work is None else work
    try:
        # run dir names: the labels made file-name safe, numbered so that two never meet
        names = {label: f"{i}-{_safe(label)}" for i, label in enumerate(toks)}
        files = {}
        (scratch / "tokenizers").mkdir(parents=True, exist_ok=True)
        for label, tok in toks.items():
            files[names[label]] = scratch / "tokenizers" / f"{names[label]}.json"
            tok.save(files[names[label]])
        budget_held, room = [], args.eval_chars
        for doc in held:
            if room <= 0:
                break
            budget_held.append(doc[:room])
            room -= len(budget_held[-1])
        got = budget_bpb(args.config, args.set, files, budget_held, budget, scratch / "runs", say)
    finally:
        if work is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return {label: {**row, **got[names[label]], "run": names[label]} for label, row in rows.items()}


def _safe(label: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)[-64:] or "tokenizer"


def _print_table(rows: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = [c for c in COLUMNS if any(c[0] in r for r in rows.values())]
    table = Table(title="lmforge tokenizer compare", show_header=True)
    table.add_column("tokenizer")
    table.add_column("model")
    for _, head, _ in cols:
        table.add_column(head, justify="right")
    for label, r in rows.items():
        cells = ("-" if r.get(k) is None else fmt.format(r[k]) for k, _, fmt in cols)
        table.add_row(label, r["model"], *cells)
    Console(highlight=False, width=200).print(table)


def _no_mode_args(p: argparse.ArgumentParser) -> None:
    pass


def _no_mode(args: argparse.Namespace) -> int:
    raise LmforgeError("lmforge tokenizer takes a mode: compare (see lmforge tokenizer compare --help)")


MODES = {"compare": ("fertility, vocabulary use, unknown rate, round trip, encode speed (and bits per byte "
                     "after a short training) of tokenizers on held-out text", _compare_args, _compare)}

TOKENIZER = Verb(
    "tokenizer", "compare tokenizers (files, or kinds trained on data.sources) on held-out text",
    _no_mode_args, _no_mode,
    epilog="modes (lmforge tokenizer MODE --help: its flags):\n"
    + "".join(f"  {m:<8} {h}\n" for m, (h, _, _) in MODES.items()),
    modes=tuple(Verb(m, h, a, r) for m, (h, a, r) in MODES.items()))
