"""Verbs that train: `train` (the config's objective) and one verb per chat method, which is `train` with
objective.name fixed (sft, dpo, reward, rl, distill)."""

from __future__ import annotations

import argparse

from lmforge.cli.verbs.base import Verb, config_args, load_config
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


def _method(name: str, help_text: str) -> Verb:
    """The verb that trains objective `name`."""
    return Verb(name, help_text, _train_args, lambda args: _train_objective(args, name))


def _distill_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("--precompute-topk", action="store_true", help="write distill.teacher's top-k "
                   "logits of every training and validation window to distill.topk_cache, and exit")
    _resume_arg(p)


def _distill(args: argparse.Namespace) -> int:
    if args.precompute_topk:
        from lmforge.finetune.topk_cache import precompute_topk

        precompute_topk(load_config(args))
        return 0
    return _train_objective(args, "distill")


TRAIN = Verb("train", "pretrain a model (prepares data on first use)", _train_args, _train)
DPO = _method("dpo", "preference optimisation on chosen/rejected pairs (objective dpo: DPO, IPO, SimPO, "
              "ORPO, ... by preference.loss), full or with adapters")
REWARD = _method("reward", "train a reward model on chosen/rejected pairs (objective reward: a scalar score "
                 "head, Bradley-Terry loss), full or with adapters")
RL = _method("rl", "reinforcement learning on sampled completions scored by rewards (objective rl: GRPO "
             "or RLOO by rl.algorithm), full or with adapters")
SFT = _method("sft", "fine-tune on chat data (objective sft): full, LoRA, DoRA or QLoRA (the finetune "
              "section)")
DISTILL = Verb("distill", "knowledge distillation (objective distill): a student learns a teacher's "
               "next-token distributions (forward / reverse KL, generalised JSD) mixed with the data loss",
               _distill_args, _distill)
