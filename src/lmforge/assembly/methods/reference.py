"""The reference model of the methods that compare with the starting model (preference training, RL):
the base with its adapters disabled, or a frozen copy of the starting weights; as a function of token ids
and targets, or summed per completion as preference training takes it."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.assembly.starting import starting_model
from lmforge.config.schema import Config
from lmforge.engine.loss import logits_of
from lmforge.errors import ConfigError
from lmforge.parallel.dims import ParallelDims


def reference(model: nn.Module, cfg: Config, dims: ParallelDims, device: torch.device, data,
              source_vocab: int | None, say, other_ways: str):
    """The reference model of preference training and RL, as a function (ids, targets) -> per-token
    log-probs of the targets (0 where ignored): with adapters, the model itself with its adapters
    disabled (no extra memory: the frozen base is the model the adapters started from); with full
    fine-tuning, a frozen model with the starting weights (model.init_from, loaded again: a resumed
    run's model already moved on; one more model in memory, so one process or DDP). `other_ways`: how the
    method trains without a reference, for the message that refuses a layout."""
    from lmforge.finetune.lora import lora_layers

    if lora_layers(model):
        say("reference model: the base, adapters disabled")
        return adapters_off(model)
    name = cfg.objective.name
    if dims.fsdp or dims.tp > 1 or dims.pp > 1:
        raise ConfigError(f"objective {name} with finetune.method=full keeps a frozen copy of the model as "
                          "its reference, which needs the whole model on each rank (one process or DDP); use "
                          "LoRA (the reference is the base with adapters off) or " + other_ways)
    if not cfg.model.init_from:
        raise ConfigError(f"objective {name} with finetune.method=full compares with the starting model: set "
                          "model.init_from (the SFT run or HF dir the training starts from)")
    with torch.random.fork_rng(devices=[]):  # its random init (overwritten) must not move the run's RNG
        frozen = starting_model(cfg, device, data, source_vocab).requires_grad_(False)
    say(f"reference model: a frozen copy of {cfg.model.init_from}")
    return logps_of(frozen)


def logps_of(model: nn.Module):
    """(ids, targets) -> `model`'s per-token log-probs of the targets."""
    from lmforge.engine.preference_loss import token_logps

    def logps(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        dev = device_of(model)
        return token_logps(logits_of(model(ids.to(dev))), targets.to(dev))

    return logps


def summed(reference):
    """A per-token reference as preference training takes it: batch -> summed completion log-probs."""
    return lambda batch: reference(batch.input_ids, batch.targets).sum(-1)


def adapters_off(model: nn.Module):
    from lmforge.finetune.lora import adapters_disabled

    logps = logps_of(model)

    def reference(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with adapters_disabled(model):
            return logps(ids, targets)

    return reference


def device_of(model: nn.Module) -> torch.device:
    """Where the model computes (a batch handed to the reference may still be on the host)."""
    return next(model.parameters()).device


def eval_reference(model: nn.Module, cfg: Config, device: torch.device, data):
    """The reference model a preference run trained against, to evaluate it: the base with the
    adapters disabled, or (full fine-tuning) the model.init_from weights loaded afresh, as training
    started them (`data`: the run's prepared pairs, for a chat template's new token rows)."""
    from lmforge.checkpoint.runs import source_model_config
    from lmforge.finetune.lora import lora_layers

    if lora_layers(model):
        return adapters_off(model)
    if not cfg.model.init_from:
        raise ConfigError("evaluating a preference run needs its reference model: the run has no "
                          "model.init_from to load it from")
    source_vocab = source_model_config(cfg.model.init_from).vocab_size
    with torch.random.fork_rng(devices=[]):
        reference = starting_model(cfg, device, data, source_vocab).requires_grad_(False).eval()
    return logps_of(reference)
