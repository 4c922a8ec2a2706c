"""What `lmforge eval` runs in each mode and the tables it prints (evaluate.py holds its arguments)."""

from __future__ import annotations

import argparse

from lmforge.cli.verbs.base import run_path
from lmforge.errors import LmforgeError
from lmforge.utils.io import check_new_file


def run_mode(args: argparse.Namespace, mode: str) -> int:
    """Run `lmforge eval` in `mode` (a key of evaluate.EVAL_MODES) on parsed arguments of any of its forms."""
    from lmforge.eval.open_run import eval_tasks, evaluate
    from lmforge.eval.tasks import check_limit

    check_limit(args.limit)
    if mode == "harness":
        return _eval_harness(args)  # the one mode that takes several runs
    if args.unsafe_code_exec:
        raise LmforgeError("--unsafe-code-exec applies to --tasks with task files (pass@k runs code); "
                           "this mode runs no model-written code")
    if len(args.path) > 1:
        raise LmforgeError("several runs are compared with --tasks only; give one run otherwise")
    args.path = args.path[0] if args.path else None
    if args.redteam or args.redteam_prompts:
        from rich.console import Console
        from rich.table import Table

        from lmforge.eval.open_run import eval_redteam

        result = eval_redteam(run_path(args), args.redteam_prompts, args.set, weights=args.weights,
                              limit=args.limit, batch_size=args.batch_size or 32)
        table = Table(title="red-team attack success (complied: answered, no refusal)", show_header=True)
        table.add_column("category", no_wrap=True)
        for col in ("prompts", "attack success", "refused", "no answer", "flagged harmful / PII",
                    "benign refused / no answer"):
            table.add_column(col, justify="right")
        benign = result["benign"]
        for cat, r in result["categories"].items():
            b = benign if cat == "all" else benign["categories"].get(cat)
            table.add_row(cat, str(r["prompts"]), f"{r['attack_success_rate']:.1%}",
                          f"{r['refusal_rate']:.1%}", f"{r['non_answer_rate']:.1%}",
                          f"{r['flagged_harmful']}/{r['flagged_pii']}",
                          f"{b['refused']}/{b['non_answers']} of {b['prompts']}" if b else "-")
        Console(highlight=False).print(table)
        print(f"benign refusal rate (over-refusal): {benign['refusal_rate']:.1%} of {benign['prompts']} "
              f"harmless look-alike prompts refused; {benign['non_answers']} got no answer at all")
        return 0
    if args.data:
        from lmforge.eval.open_run import eval_data

        eval_data(run_path(args), args.data, args.set, weights=args.weights, max_length=args.max_length,
                  stride=args.stride, batch_size=args.batch_size or 16, limit=args.limit)
        return 0
    if args.tasks:
        from rich.console import Console
        from rich.table import Table

        acc = eval_tasks(run_path(args), args.tasks, args.set, weights=args.weights, limit=args.limit,
                         batch_size=args.batch_size or 32)
        first = "" if args.limit is None else f" (first {args.limit:g} records of each task)"
        table = Table(title=f"exact match on {args.tasks}{first}", show_header=True)
        table.add_column("task")
        for col in ("correct", "total", "accuracy"):
            table.add_column(col, justify="right")
        for task, (c, n) in acc.items():
            table.add_row(task, str(c), str(n), f"{c / n:.1%}")
        c, n = sum(c for c, _ in acc.values()), sum(n for _, n in acc.values())
        table.add_row("all", str(c), str(n), f"{c / n:.1%}")
        Console(highlight=False).print(table)
        return 0
    evaluate(run_path(args), args.set, weights=args.weights)
    return 0


def _eval_harness(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lmforge.eval.harness import comparison_rows, eval_harness

    items = [t.strip() for t in args.tasks.split(",") if t.strip()]
    paths = _eval_paths(args)
    if len(paths) > 1:  # the comparison report: refused now rather than after every evaluation
        args.compare_out = str(check_new_file(args.compare_out or "eval_compare.md", args.overwrite))
    outs = eval_harness(paths, items, args.set, weights=args.weights, num_fewshot=args.num_fewshot,
                        limit=args.limit, batch_size=args.batch_size or 16,
                        seed=1234 if args.seed is None else args.seed, chat=args.chat,
                        multiturn=args.fewshot_as_multiturn, all_checkpoints=args.all_checkpoints,
                        compare_out=args.compare_out, contamination=not args.no_contamination,
                        code_isolation="hook" if args.unsafe_code_exec else "os")
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
    return [run_path(args)]  # -c CONFIG: its run.dir
