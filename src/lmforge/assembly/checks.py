"""Refusals made before any work: what a parallel layout, a user's optimizer, a fine-tuning config's stated
keys or a model object of the user's own cannot run. Used by assembly/build.py."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from lmforge.config.methods import method_facts
from lmforge.config.schema import Config
from lmforge.data import Tokenizer
from lmforge.engine.loss import logits_of
from lmforge.engine.objectives import Objective, TokenObjective
from lmforge.errors import ConfigError, LmforgeError
from lmforge.optim.builder import SPECS, UserOptimizer
from lmforge.parallel.dims import ParallelDims


def check_layout(cfg: Config, dims: ParallelDims, objective: Objective, custom_model: bool) -> None:
    """Refuse, before any work, what a parallel layout cannot run as configured: the optimizer's and
    the objective's declared capabilities, and the features whose maths a layout would change."""
    caps = SPECS[cfg.optim.name].capabilities(cfg.optim)
    sharded = dims.fsdp or dims.tp > 1
    checks = [
        (sharded, caps.sharded),
        (dims.pp > 1, caps.pipeline),
        (dims.dp_size > 1, caps.data_parallel),
        (dims.zero1, caps.zero1),
        (not isinstance(objective, TokenObjective), caps.non_token_objective),
        (
            bool(cfg.train.batch_warmup_tokens) and dims.pp > 1,
            "train.batch_warmup_tokens varies the micro-batches per step, but a pipeline schedule "
            "(parallel.pp > 1) has a fixed number",
        ),
        (
            dims.pp > 1 and not objective.supports_pipeline,
            f"objective {objective.name} has no per-stage loss, so it cannot run in a pipeline "
            "(parallel.pp > 1)",
        ),
        (
            bool(cfg.train.loss_chunk_tokens) and (dims.tp > 1 or dims.pp > 1),
            "train.loss_chunk_tokens needs the whole output projection on one rank, which tensor and "
            "pipeline parallelism split; set train.loss_chunk_tokens=0",
        ),
        (
            custom_model and (sharded or dims.pp > 1),
            "a model object of your own trains on one process or with DDP (parallel.dp_replicate); FSDP, TP "
            "and pipeline layouts need lmforge's Transformer (build it from the config's model section)",
        ),
        (
            custom_model and cfg.train.activation_checkpointing != "none",
            "train.activation_checkpointing wraps the blocks of lmforge's Transformer (model.layers); with a "
            "model object of your own, set it to none and checkpoint inside your module",
        ),
    ]
    problems = [reason for applies, reason in checks if applies and reason]
    if problems:
        raise ConfigError(
            "this parallel layout cannot run the run as configured:\n  " + "\n  ".join(problems)
        )


def check_user_optimizer(user: UserOptimizer | None, dims: ParallelDims, custom: bool,
                          masters: str = "off") -> None:
    """Refuse, before any work, a user's optimizer or param groups where lmforge must build them."""
    if user is None:
        return
    if masters != "off":
        raise ConfigError(f"train.master_weights={masters} keeps its fp32 masters in lmforge's own "
                          "optimizer: pass no optimizer= / param_groups=, or set train.master_weights=off")
    if user.param_groups is not None and not custom:
        raise ConfigError("Trainer(param_groups=...) holds parameters of a model you pass as model=; for "
                          "lmforge's own model give optimizer=<factory> (it gets the param groups) or set "
                          "optim.param_groups")
    if user.optimizer is not None and dims.zero1:
        raise ConfigError("Trainer(optimizer=...) with parallel.zero=1: the sharded optimizer is rebuilt by "
                          "lmforge from its class on each rank's share of the parameters; set the optimizer "
                          "in the config (optim.*), or use DDP without zero (parallel.zero=0)")
    if isinstance(user.optimizer, torch.optim.Optimizer) and not custom:
        raise ConfigError("Trainer(optimizer=<an optimizer>) must be built over the parameters of the model "
                          "you pass as model=; for lmforge's own model (built, and sharded, inside) give a "
                          "factory: optimizer=lambda groups: torch.optim.SGD(groups, lr=0.1)")


def check_stated_heads(cfg: Config, stated: dict) -> None:
    """model.score_head / value_head stated in a fine-tuning config (its own config.yaml, resumed) must be
    the head its objective adds: the objective decides them, the source's weights have none."""
    head = method_facts(cfg).scalar_head
    for key in ("score_head", "value_head"):
        name = key.removesuffix("_head")
        if key in stated and stated[key] != (head == name):
            does = "adds a" if stated[key] is False else "has no"
            raise ConfigError(f"model.{key}={str(stated[key]).lower()}: objective {cfg.objective.name} "
                              f"{does} {name} head (the objective decides it); remove model.{key}")


def check_stated_vocab(stated: int | None, derived: int, source: int | None) -> None:
    """model.vocab_size stated in a fine-tuning config (its own config.yaml, resumed) must be the one this
    run derives: the source's, grown when the chat template adds tokens."""
    if stated is not None and stated != derived:
        grown = f", the source's {source} grown for the chat template's tokens" if derived != source else ""
        raise ConfigError(f"model.vocab_size={stated}: this run's vocabulary is {derived}{grown}; remove "
                          "model.vocab_size (it comes from model.init_from and the template)")


def check_custom_model(model: nn.Module, tokenizer: Tokenizer | None, train_src: list[np.ndarray],
                        device: torch.device) -> int:
    """A model object must map (B, T) token ids to (B, T, V) logits with V covering every id. Returns V."""

    was = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            logits = logits_of(model(torch.zeros(2, 3, dtype=torch.long, device=device)))
    except Exception as e:
        raise LmforgeError(
            f"the model object failed on a (2, 3) batch of token ids: {type(e).__name__}: {e}; "
            "it must take input ids (B, T) and return logits (B, T, vocab)"
        ) from None
    finally:
        model.train(was)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (2, 3):
        raise LmforgeError(
            f"the model object returned logits of shape {tuple(logits.shape)} for input (2, 3); "
            "expected (2, 3, vocab)"
        )
    needed = tokenizer.vocab_size if tokenizer is not None else int(max(s.max() for s in train_src)) + 1
    if logits.shape[-1] < needed:
        raise LmforgeError(f"the model object predicts {logits.shape[-1]} token ids but the data uses "
                           f"{needed}; give it an output layer of at least {needed}")
    return int(logits.shape[-1])
