"""Verbs that look before (or around) a run: `config` (the resolved config), `plot-schedule`, `estimate`
(memory), `lr-find`, `scaling` (plan and fit laws), `sweep` (many runs over a grid)."""

from __future__ import annotations

import argparse
import sys

from lmforge.cli.numbers import COUNT, LR, POSITIVE, SEED, WORLD, number, whole
from lmforge.cli.verbs.base import GIGABYTES, Verb, config_args, load_config
from lmforge.errors import LmforgeError
from lmforge.utils.io import check_new_file


def _config_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("--from-deepspeed", metavar="DS_CONFIG", help="translate a DeepSpeed ds_config.json: "
                   "print the lmforge config it maps to (under -c and --set) and, on stderr, a table of the "
                   "keys that do not map and why")
    p.add_argument("--from-hf-args", metavar="ARGS", help="the same for Hugging Face TrainingArguments (a "
                   "JSON as TrainingArguments.to_json_string() writes it, or a YAML of its fields)")


def _config(args: argparse.Namespace) -> int:
    from lmforge.cli.verbs.translation import print_unmapped, translated_config
    from lmforge.config.load import dump_config

    cfg, translation = translated_config(args, warn=False)
    sys.stdout.write(dump_config(cfg))
    if translation is not None:
        print_unmapped(translation)
    return 0


CONFIG = Verb("config", "print the resolved config (defaults + file + --set, or a translated DeepSpeed / "
              "TrainingArguments file)", _config_args, _config)


def _plot_schedule_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("-o", "--out", default="schedule.png",
                   help="PNG to write (default: schedule.png in the current dir; the run dir is "
                   "never created)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing PNG")
    p.add_argument("--world-size", type=number(WORLD), default=1,
                   help="data-parallel ranks the run will use: they set the tokens per step")


def _plot_schedule(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lmforge.tools.plots import plot_schedule, schedule_curve

    cfg = load_config(args)
    check_new_file(args.out, args.overwrite)  # before any work
    curve = schedule_curve(cfg, world_size=args.world_size)
    out = plot_schedule(curve, args.out, title=f"{cfg.run.name}: {cfg.schedule.name} schedule")
    console = Console(highlight=False)
    last = len(curve.lrs) - 1
    end = curve.warmup_end
    if curve.seconds is not None:  # unit time: the steps depend on the machine's speed
        at = curve.seconds
        console.print(f"schedule {cfg.schedule.name} over train.max_time={cfg.train.max_time:g}s of training",
                      markup=False)
        console.print(f"peak lr      {max(curve.lrs):.4e} at {at[curve.peak_step]:.1f}s", markup=False)
        warm = f"{at[end]:.1f}s" if end is not None else "not reached"
        console.print(f"warm-up end  {warm}", markup=False)
        console.print(f"final lr     {curve.lrs[last]:.4e} at {at[last]:.1f}s", markup=False)
        console.print(f"wrote {out}", markup=False)
        return 0
    console.print(f"schedule {cfg.schedule.name} in {cfg.schedule.unit}: {len(curve.lrs):,} steps, "
                  f"{curve.max_tokens:,} tokens", markup=False)
    console.print(f"peak lr      {max(curve.lrs):.4e} at step {curve.peak_step}", markup=False)
    console.print("warm-up end  " + (f"step {end} ({curve.tokens[end]:,} tokens seen)" if end is not None
                                     else "not reached within the run"), markup=False)
    console.print(f"final lr     {curve.lrs[last]:.4e} at step {last}", markup=False)
    console.print(f"wrote {out}", markup=False)
    return 0


PLOT_SCHEDULE = Verb("plot-schedule", "draw the learning rate a run will use, step by step, to a PNG",
                     _plot_schedule_args, _plot_schedule)


def _estimate_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("--world-size", type=number(whole(1, 2**20)), default=1, help="processes the run "
                   "will use (parallel.* lays them out as at a real start)")
    p.add_argument("--device", default=None, help="judge against this device: cpu (available RAM) or "
                   "cuda / cuda:N (its total memory); default cpu")
    p.add_argument("--device-memory", type=number(GIGABYTES), default=None, metavar="GiB",
                   help="judge against this many GiB per rank instead of a device here")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")


def _estimate(args: argparse.Namespace) -> int:
    from lmforge.tools.estimate_report import run_estimate

    return run_estimate(load_config(args), args.world_size, args.device, args.device_memory, args.json)


ESTIMATE = Verb("estimate", "memory a training run needs per rank (model states, activations, "
                "temporaries, by layout and method: pretraining, SFT, LoRA / QLoRA, DPO, reward models), a "
                "verdict against the device and settings that fit", _estimate_args, _estimate)


def _lr_find_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("--min-lr", type=number(LR), default=1e-7, help="first lr of the sweep")
    p.add_argument("--max-lr", type=number(LR), default=1.0, help="last lr of the sweep")
    p.add_argument("--steps", type=number(whole(5, 100_000)), default=100,
                   help="optimizer steps of the sweep")
    p.add_argument("-o", "--out", default="lr_find.png",
                   help="PNG to write (default: lr_find.png in the current dir; the run dir is "
                   "never created)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing PNG")


def _lr_find(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lmforge.tools.lr_finder import lr_find

    console = Console(highlight=False)
    if args.out:
        check_new_file(args.out, args.overwrite)  # before a sweep of minutes
    result = lr_find(load_config(args), args.min_lr, args.max_lr, args.steps, args.out,
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


LR_FIND = Verb("lr-find", "learning-rate range test on a fresh model: loss against an exponential lr "
               "sweep, with suggested peak lrs", _lr_find_args, _lr_find)


def _scaling_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    plan = sub.add_parser("plan", help="compute-optimal N, D, predicted loss and a config realising them")
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--compute", type=number(POSITIVE), help="training FLOPs (C = 6ND)")
    what.add_argument("--params", type=number(POSITIVE),
                      help="model size N: the tokens and compute it is optimal for")
    what.add_argument("--tokens", type=number(POSITIVE),
                      help="tokens D: the model size and compute they are optimal "
                      "for")
    plan.add_argument("--law", default="epoch", help="hoffmann (Hoffmann et al. 2022, approach 3), epoch "
                      "(Besiroglu et al. 2024's refit; default) or a fit file from `scaling fit --out`")
    plan.add_argument("-c", "--config", help="base config the planned one starts from (vocabulary, MLP, GQA, "
                      "context, data...)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a base "
                      "config key (repeatable)")
    plan.add_argument("--out", help="write the planned config (YAML) here")
    plan.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    fit = sub.add_parser("fit", help="fit L(N, D) = E + A/N^alpha + B/D^beta to trained runs")
    fit.add_argument("runs", nargs="+", help="run dirs (trained to the end, with validation), sweep dirs "
                     "(lmforge sweep --out) or globs of them; what is not a run (logs, sweep.json) is "
                     "skipped and named, and so is a sweep's run that did not finish")
    fit.add_argument("--out", help="write the fit (JSON; `scaling plan --law FILE` reads it)")
    fit.add_argument("--plot", metavar="DIR", help="draw iso-loss contours and iso-FLOP curves into DIR")
    fit.add_argument("--overwrite", action="store_true", help="replace an existing --out file and the "
                     "plots in --plot DIR")
    fit.add_argument("--predict", action="append", default=[], metavar="N=..,D=..", help="predicted loss "
                     "at N parameters and D tokens (repeatable)")
    fit.add_argument("--predict-config", action="append", default=[], metavar="FILE", help="predicted loss "
                     "of the run a config describes (its N and train.max_steps' tokens; repeatable)")
    fit.add_argument("--check", action="append", default=[], metavar="RUN", help="a trained run left out "
                     "of the fit: its predicted and measured loss (repeatable)")
    fit.add_argument("--all-evals", action="store_true", help="every evaluation along each run as a point, "
                     "not only the final one (biased: the lr had not decayed yet)")
    fit.add_argument("--count", default="total", choices=("total", "non-embedding"), help="N with the "
                     "embedding table (Chinchilla's convention; default) or without (Kaplan's)")
    fit.add_argument("--bootstrap", type=number(whole(0, 1000)), default=50, metavar="K",
                     help="95%% confidence intervals "
                     "from K refits on resampled points (0: none)")
    fit.add_argument("--seed", type=number(SEED), default=0, help="seed of the bootstrap")


def _scaling(args: argparse.Namespace) -> int:
    from lmforge.tools.scaling import run_fit, run_plan

    if args.action == "plan":
        run_plan(args.law, compute=args.compute, params=args.params, tokens=args.tokens, config=args.config,
                 overrides=args.set, out=args.out, overwrite=args.overwrite)
        return 0
    run_fit(args.runs, out=args.out, plot=args.plot, predict=args.predict,
            predict_config=args.predict_config, check=args.check, all_evals=args.all_evals, count=args.count,
            samples=args.bootstrap, seed=args.seed, overwrite=args.overwrite)
    return 0


SCALING = Verb("scaling", "scaling laws: `plan` a compute-optimal model, tokens and config from a "
               "Chinchilla-form law; `fit` that law to trained runs, plot it and predict losses",
               _scaling_args, _scaling)


def _sweep_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="a config key and "
                   "its values (repeatable; the grid is every combination); KEY=LOW..HIGH is a range "
                   "for --random (log-uniform for lr keys)")
    p.add_argument("--random", type=number(COUNT), default=None, metavar="K",
                   help="random search: K points "
                   "drawn from the --grid values and ranges instead of the full grid")
    p.add_argument("--seed", type=number(SEED), default=0, help="seed of the random search")
    p.add_argument("--parallel", type=number(whole(1, 1024)), default=1,
                   help="runs at a time (CPU threads are shared out)")
    p.add_argument("--backend", default="local", choices=("local", "ray"), help="subprocesses here, "
                   "or Ray tasks (pip install 'lmforge[ray]')")
    p.add_argument("--out", help="the sweep dir: one run dir per point, their logs and sweep.json; "
                   "run the same command again to resume (finished points are skipped)")


def _sweep(args: argparse.Namespace) -> int:
    from lmforge.tools.sweep import sweep

    if not args.out:
        raise LmforgeError("give --out DIR: the sweep's runs and sweep.json go there")
    summary = sweep(args.config, args.set, args.grid, args.out, random_k=args.random, seed=args.seed,
                    parallel=args.parallel, backend=args.backend)
    failed = [r["name"] for r in summary["runs"] if r["status"] != "done"]
    print(f"{len(summary['runs']) - len(failed)} of {len(summary['runs'])} runs done; summary in "
          f"{args.out}/sweep.json" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


SWEEP = Verb("sweep", "one `lmforge train` per point of a grid or random search, each in its own run dir, "
             "with a resumable sweep.json", _sweep_args, _sweep)
