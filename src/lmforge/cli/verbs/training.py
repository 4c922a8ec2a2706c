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


def _train_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    _resume_arg(p)


def _train(args: argparse.Namespace) -> int:
    from lmforge.train.trainer import train

    train(load_config(args), resume=args.resume)
    return 0


def _train_objective(args: argparse.Namespace, name: str) -> int:
    """`lmforge train` with objective `name` (what the verb means), refusing a config naming another."""
    from lmforge.train.trainer import train

    cfg = load_config(args)
    if "name" in cfg.objective.model_fields_set and cfg.objective.name != name:
        raise ConfigError(f"lmforge {args.verb} trains objective {name}, but the config sets objective.name="
                          f"{cfg.objective.name}; remove it or use lmforge train")
    train(cfg.model_copy(update={"objective": cfg.objective.model_copy(update={"name": name})}),
          resume=args.resume)
    return 0


def _method(name: str, spec: MethodVerb) -> Verb:
    """The verb that trains objective `name`, with the flags its method declares (method_verbs.py)."""

    def arguments(p: argparse.ArgumentParser) -> None:
        config_args(p)
        for flag, help_text, _ in spec.actions:
            p.add_argument(flag, action="store_true", help=help_text)
        _resume_arg(p)

    def run(args: argparse.Namespace) -> int:
        for flag, _, target in spec.actions:
            if getattr(args, flag.lstrip("-").replace("-", "_")):
                module, function = target.split(":")
                getattr(importlib.import_module(module), function)(load_config(args))
                return 0
        return _train_objective(args, name)

    return Verb(name, spec.help, arguments, run)


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
             _train_translated)
METHODS = [_method(name, spec) for name, spec in METHOD_VERBS.items()]  # lmforge dpo, reward, rl, sft, ...
