"""Weight averages kept beside training: an exponential moving average (EMA) and a stochastic
weight average (SWA, the equal-weight mean of snapshots; Izmailov et al. 2018).

Both follow `torch.optim.swa_utils.AveragedModel` exactly: the first update copies the weights,
later ones blend them in (EMA: avg += (1 - decay) * (w - avg); SWA: avg += (w - avg) / (n + 1)).
The averages are FQN-keyed like the model's own state dict, so they are saved and loaded by
`torch.distributed.checkpoint` next to the model (sharded with it) and can be loaded straight
into a model for evaluation or export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lmforge.config.schema import AveragingConfig

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter's FQN without the prefixes wrappers add (activation checkpointing, compile, DDP),
    so averages load into a plain model for evaluation and export."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name.removeprefix("module.")


def named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {clean_name(n): p for n, p in model.named_parameters() if p.requires_grad}


class WeightAverage:
    """One running average of a model's parameters (kind 'ema' or 'swa')."""

    def __init__(self, model: nn.Module, kind: str, decay: float = 0.999, every: int = 1, start: int = 0):
        assert kind in ("ema", "swa")
        self.kind, self.decay, self.every, self.start = kind, decay, every, start
        self.reset(model)

    def reset(self, model: nn.Module) -> None:
        """An empty average (the next update copies the weights)."""
        # The average lives where the weights live, in their dtype (fp32 master weights).
        self.params = {n: p.detach().clone() for n, p in named_params(model).items()}
        self.names = list(self.params)
        self.n_averaged = 0

    def due(self, step: int) -> bool:
        """Whether the weights after optimizer step `step` (1-based count) enter the average."""
        return step >= self.start and step % self.every == 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        current = named_params(model)
        avg = [self.params[n] for n in self.names]
        new = [current[n].detach() for n in self.names]
        if self.n_averaged == 0:
            for a, w in zip(avg, new):  # per tensor: DTensor (FSDP/TP) has no foreach_copy_ rule
                a.copy_(w)
        elif self.kind == "ema":
            torch._foreach_lerp_(avg, new, 1.0 - self.decay)
        else:
            torch._foreach_lerp_(avg, new, 1.0 / (self.n_averaged + 1))
        self.n_averaged += 1

    # -- Stateful: the tensors go through DCP, the counter through the train state -------------
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.params

    def state_dict(self) -> dict:
        return {"n_averaged": self.n_averaged}

    def load_state_dict(self, sd: dict) -> None:
        self.n_averaged = int(sd["n_averaged"])

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[None]:
        """Run the model with the averaged weights, then put the trained ones back."""
        current = named_params(model)
        saved = {n: current[n].detach().clone() for n in self.names}
        with torch.no_grad():
            for n in self.names:
                current[n].copy_(self.params[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n in self.names:
                    current[n].copy_(saved[n])


class Averages(dict[str, WeightAverage]):
    """The run's weight averages by kind ('ema', 'swa'), as one Stateful part of the run: the counters
    go into the run state, the tensors (`tensors()`) through torch.distributed.checkpoint."""

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: a.tensors() for k, a in self.items()}

    def state_dict(self) -> dict:
        return {k: a.state_dict() for k, a in self.items()}

    def load_state_dict(self, sd: dict) -> None:
        for k, a in self.items():
            if k in sd:
                a.load_state_dict(sd[k])


def build_averages(model: nn.Module, cfg: AveragingConfig) -> Averages:
    """The averages the config asks for, keyed 'ema' / 'swa'."""
    out = Averages()
    if cfg.ema:
        out["ema"] = WeightAverage(model, "ema", decay=cfg.ema_decay, every=cfg.ema_every)
    if cfg.swa:
        out["swa"] = WeightAverage(model, "swa", every=cfg.swa_every, start=cfg.swa_start)
    return out
