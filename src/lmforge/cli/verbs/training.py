"""Verbs that train: `train` (the config's objective) and one verb per method that has one
(cli/verbs/method_verbs.py), which is `train` with objective.name fixed."""

from __future__ import annotations

import argparse
import importlib

from lmforge.cli.verbs.base import Verb, config_args, load_config
from lmforge.cli.verbs.method_verbs import METHOD_VERBS, MethodVerb
from lmforge.errors import ConfigError


def _resume_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", action="store_true", help="continue the run in run.dir from its "
                   "latest checkpoint")


def _launcher_args(p: argparse.ArgumentParser) -> None:
    """The launcher's flags (parallel/launch.py): start the job's processes as torchrun would."""
    g = p.add_argument_group("launcher (instead of torchrun: each process runs this command without these)")
    g.add_argument("--nproc", metavar="N", help="processes on this node (torchrun --nproc-per-node): a "
                   "number, or auto = one per GPU, 1 on a CPU; default 1 when --nnodes is given")
    g.add_argument("--nnodes", metavar="M", help="nodes in the job (default 1); each node runs this command")
    g.add_argument("--node-rank", metavar="R", help="this node's rank, 0 to M-1 (default 0)")
    g.add_argument("--master-addr", metavar="ADDR", help="address of node rank 0, where the nodes meet "
                   "(needed with --nnodes > 1)")
    g.add_argument("--master-port", metavar="PORT", help="port on --master-addr (default: a free local port "
                   "on one node, 29500 across nodes as torchrun)")


def _launched(run):
    """`run` as the handler of a verb with the launcher's flags: with them, start the job's processes
    (each running this same command without them) and return the first failed one's exit status."""

    def handler(args: argparse.Namespace) -> int:
        from lmforge.parallel import launch

        if not launch.requested(args):
            return run(args)
        job = launch.resolve(args)
        if job.in_process:
            return run(args)
        if getattr(args, "budget", None) is not None:
            raise ConfigError("--budget plans a run for one process; drop --nproc/--nnodes (or train the "
                              "config --budget --plan-only writes with the launcher)")
        if any(getattr(args, f.lstrip("-").replace("-", "_"), False) for f in _ACTION_FLAGS):
            raise ConfigError(f"{' / '.join(_ACTION_FLAGS)} run in one process; drop --nproc/--nnodes")
        launch.check_layout(_config(args), job)
        worker = launch.worker_argv(args.argv[1:], _takes_value(args.verb))
        return launch.launch(args.verb, job, [args.argv[0], *worker])

    return handler


def _config(args: argparse.Namespace):
    if getattr(args, "deepspeed", None):
        from lmforge.cli.verbs.translation import translated_config

        return translated_config(args, warn=False)[0]  # rank 0 of the job warns
    return load_config(args)


def _takes_value(verb: str) -> dict[str, bool]:
    """Every option of `verb` and whether it takes a value (to strip the launcher's flags exactly)."""
    p = argparse.ArgumentParser(add_help=False)
    (_train_translated_args if verb == "train" else _method(verb, METHOD_VERBS[verb]).arguments)(p)
    return {o: a.nargs != 0 for a in p._actions for o in a.option_strings}


def _train_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    _resume_arg(p)
    _launcher_args(p)
    p.add_argument("--budget", metavar="DURATION", help="wall-clock budget for the whole process (e.g. 5m, "
                   "90s, 1h): measure this machine, choose vocabulary, model shape, batch, lr, schedule and "
                   "precision for it (keys you set are kept), then prepare, train and evaluate within it; "
                   "the plan is printed and saved as plan.json / plan.md in the run dir")
    p.add_argument("--plan-only", action="store_true", help="with --budget: write the planned config.yaml, "
                   "plan.json and plan.md to --plan-dir and stop (train it with lmforge train -c)")
    p.add_argument("--plan-dir", metavar="DIR", help="where --plan-only writes (default: <run.dir>-plan)")
    p.add_argument("--overwrite", action="store_true", help="--plan-only: replace the files in --plan-dir")


def _train(args: argparse.Namespace) -> int:
    if args.budget is not None:
        return _train_budget(args)
    if args.plan_only or args.plan_dir:
        raise ConfigError("--plan-only and --plan-dir plan a --budget; give --budget DURATION (e.g. 5m)")
    from lmforge.train.trainer import train

    train(load_config(args), resume=args.resume)
    return 0


def _train_budget(args: argparse.Namespace) -> int:
    """`lmforge train --budget 5m`: tools/planner_run.py (the clock is the process's, from its start)."""
    from lmforge.config.train import parse_duration
    from lmforge.tools.planner_probe import Deadline
    from lmforge.tools.planner_run import run_budget

    try:
        budget = parse_duration(args.budget)
    except ValueError as e:
        raise ConfigError(f"--budget: {e}") from None
    if args.resume:
        raise ConfigError("--budget plans a new run; --resume continues one: drop one of them")
    if args.plan_dir and not args.plan_only:
        raise ConfigError("--plan-dir is where --plan-only writes; add --plan-only (a planned run writes its "
                          "plan into run.dir)")
    started = getattr(args, "started", None)  # None: a command line, whose whole process counts
    deadline = Deadline.from_process(budget) if started is None else Deadline.since(budget, started)
    run_budget(budget, args.config, args.set, plan_only=args.plan_only, out=args.plan_dir,
               overwrite=args.overwrite, deadline=deadline)
    return 0


def _budget(args: argparse.Namespace, target: str) -> int:
    """`lmforge VERB --budget 2m`: the method's planner (the clock is the process's, from its start)."""
    from lmforge.config.train import parse_duration
    from lmforge.tools.planner_probe import Deadline

    try:
        budget = parse_duration(args.budget)
    except ValueError as e:
        raise ConfigError(f"--budget: {e}") from None
    if args.resume:
        raise ConfigError("--budget plans a new run; --resume continues one: drop one of them")
    started = getattr(args, "started", None)  # None: a command line, whose whole process counts
    deadline = Deadline.from_process(budget) if started is None else Deadline.since(budget, started)
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(budget, args.config, args.set, deadline=deadline)
    return 0


def _same_objective(args: argparse.Namespace, name: str) -> None:
    """Refuse --budget where the verb trains another objective on this model (`lmforge sft` of a T5: seq2seq),
    which the verb's planner does not plan."""
    from lmforge.assembly.methods.seq2seq import objective_for_model

    trained = objective_for_model(load_config(args), name)
    if trained != name:
        raise ConfigError(f"--budget plans objective {name}; on this model lmforge {args.verb} trains "
                          f"objective {trained}, which has no planner yet: drop --budget and set "
                          "train.max_steps")


def _train_objective(args: argparse.Namespace, name: str) -> int:
    """`lmforge train` with objective `name` (what the verb means), refusing a config naming another."""
    from lmforge.assembly.methods.seq2seq import objective_for_model
    from lmforge.train.trainer import train

    cfg = load_config(args)
    name = objective_for_model(cfg, name)  # `lmforge sft` of an encoder-decoder trains objective seq2seq
    if "name" in cfg.objective.model_fields_set and cfg.objective.name != name:
        raise ConfigError(f"lmforge {args.verb} trains objective {name}, but the config sets objective.name="
                          f"{cfg.objective.name}; remove it or use lmforge train")
    train(cfg.model_copy(update={"objective": cfg.objective.model_copy(update={"name": name})}),
          resume=args.resume)
    return 0


BUDGET_HELP = ("wall-clock budget for the whole process (e.g. 2m): measure this machine, choose "
               "method, LoRA rank, context, batch, lr and schedule for the base model (model.init_from) "
               "and the data (keys you set are kept), then fine-tune and evaluate within it; the plan is "
               "printed and saved in the run dir")


def _method(name: str, spec: MethodVerb) -> Verb:
    """The verb that trains objective `name`, with the flags its method declares (method_verbs.py)."""

    def arguments(p: argparse.ArgumentParser) -> None:
        config_args(p)
        for flag, help_text, _ in spec.actions:
            p.add_argument(flag, action="store_true", help=help_text)
        _resume_arg(p)
        _launcher_args(p)
        if spec.budget:
            p.add_argument("--budget", metavar="DURATION", help=BUDGET_HELP)

    def run(args: argparse.Namespace) -> int:
        if getattr(args, "budget", None) is not None:
            _same_objective(args, name)
            return _budget(args, spec.budget)
        for flag, _, target in spec.actions:
            if getattr(args, flag.lstrip("-").replace("-", "_")):
                module, function = target.split(":")
                getattr(importlib.import_module(module), function)(load_config(args))
                return 0
        return _train_objective(args, name)

    return Verb(name, spec.help, arguments, _launched(run))


def _train_translated_args(p: argparse.ArgumentParser) -> None:
    _train_args(p)
    p.add_argument("--deepspeed", metavar="DS_CONFIG", help="train with a DeepSpeed ds_config.json "
                   "translated under the config (lmforge config --from-deepspeed shows it): a warning per "
                   "key that does not map; a key that contradicts -c or --set is an error")


def _train_translated(args: argparse.Namespace) -> int:
    """`lmforge train --deepspeed FILE`: the translation under -c and --set (cli/verbs/translation.py)."""
    if not args.deepspeed:
        return _train(args)
    if getattr(args, "budget", None) is not None:
        raise ConfigError("--budget plans the whole run itself; --deepspeed brings settings of your own: "
                          "drop one of them (or save `lmforge config --from-deepspeed FILE` as -c)")
    from lmforge.cli.verbs.translation import translated_config
    from lmforge.train.trainer import train

    train(translated_config(args, warn=True)[0], resume=args.resume)
    return 0


TRAIN = Verb("train", "pretrain a model (prepares data on first use)", _train_translated_args,
             _launched(_train_translated))
_ACTION_FLAGS = tuple(flag for spec in METHOD_VERBS.values() for flag, _, _ in spec.actions)
METHODS = [_method(name, spec) for name, spec in METHOD_VERBS.items()]  # lmforge dpo, reward, rl, sft, ...
