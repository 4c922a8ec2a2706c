"""The one interface between `build_run` and a training method's own setup. The assembly builds what
every run has (run dir, data, model, adapters, optimizer, parallel layout) and asks the run's method for
the rest: the extra models its objective needs (a reference, a teacher, a rollout, a reward model), its
chat data loaders, and what evaluating one of its runs needs. Which method a run has is
`objective.name`; what it reads and needs is the config's facts (config/methods.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from lmforge.config.schema import Config
from lmforge.parallel.dims import ParallelDims


@dataclass
class SetupContext:
    """What a method's training setup is given: the run's parts as the assembly has built them so far."""

    cfg: Config  # resolved (the vocabulary, a scalar head, the trained token rows set)
    model: nn.Module  # the trained model (adapters applied), not yet parallelised
    dims: ParallelDims
    device: torch.device
    data: Any  # the prepared data (PreparedSFT for chat data; None for documents handed over in Python)
    tokenizer: Any
    source_vocab: int | None  # model.init_from's vocabulary, before a chat template grew it
    say: Callable[[str], object]


class MethodSetup:
    """One method family's setup. The base is a method over token data that needs nothing beyond its
    objective (causal_lm); a family overrides what it adds."""

    names: ClassVar[tuple[str, ...]] = ()  # the objective.name values it sets up

    def check_inputs(self, cfg: Config) -> None:
        """Refuse, before the run dir is opened (and run.overwrite deletes an old run), inputs of the
        method's own that cannot work."""

    def attach(self, objective, ctx: SetupContext) -> dict[str, np.ndarray] | None:
        """Give a training run's objective what it needs beside the model. Returns extra columns for the
        chat loaders, per split (precomputed reference log-probs), or None."""
        return None

    def attach_eval(self, run, data) -> None:
        """Give an evaluated run's objective (run.objective) what its validation loss needs. `data`: the
        run's prepared chat data (None for token data)."""

    def loader(self, cfg: Config, data, split: str, batch_size: int, **kw):
        """The loader of one split of the prepared chat data (methods over token data have none)."""
        raise TypeError(f"objective {cfg.objective.name} trains on token data, which TokenLoader reads")
