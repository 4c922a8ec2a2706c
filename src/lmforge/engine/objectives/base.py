"""What an objective is: (model, batch) -> summed loss, the number of targets it sums over, and
summed metrics, for a batch type it declares.

The step divides the summed loss by the target count of the whole step (all micro-batches of all
data-parallel ranks), so every objective gets exact gradient accumulation and data parallelism for
free; metrics are sums too and are reported as means per target the same way. An objective runs
inside the compiled region with the model (`ObjectiveModule`), so its loss is part of the graph.

A new training method (masked SFT, pairwise preference, per-token weighted RL, teacher/student,
masked LM) is its objective here (one file, listed in OBJECTIVES), its section and facts in
config/methods.py and its setup in assembly/methods/ (extra models, loaders); the step, the Trainer,
`parallel/` and `build_run` stay. A variant of an existing method (a preference loss) stays inside it.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.loss import logits_of
from lmforge.models.moe import clear_records, moe_layers, router_losses


class ObjectiveOutput(NamedTuple):
    """loss: fp32 scalar, summed over the batch's targets. metrics: name -> fp32 scalar, summed over
    the same targets (the step reports each as a mean per target), or over what `counts` gives for
    that name (an RL objective's loss counts tokens, its rewards are means per sequence): the step
    then reports the metric summed over the step divided by its count summed over the step."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    counts: dict[str, torch.Tensor] | None = None


class Replay(Protocol):
    """Batches an objective trains on for more than one step (rl.iterations). Before each step the
    Trainer asks `take()`: the batches to train on again, or None to draw new ones from the loader;
    it checkpoints the replay with the run's other Stateful parts."""

    def take(self) -> list[Any] | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Objective(abc.ABC):
    """Base of every objective. Stateless apart from its settings (and a `replay`, whose state the
    Trainer checkpoints): safe to share between steps."""

    name: ClassVar[str]
    batch_type: ClassVar[type]
    supports_pipeline: ClassVar[bool] = False  # splits into a last-stage loss (see TokenObjective)
    # The metric that holds the summed cross-entropy when the loss is not (only) that: evaluation's
    # perplexity and bits per byte come from it. None: the loss is the cross-entropy.
    cross_entropy_metric: ClassVar[str | None] = None
    replay: Replay | None = None  # None: every step's batches come from the loader

    @classmethod
    def from_config(cls, cfg: Any) -> Objective:
        """The objective with its settings from the config tree (lmforge.config.Config)."""
        return cls()

    def batch_of(self, raw: Any) -> Any:
        """Check (and where unambiguous convert) one batch into `batch_type`."""
        if not isinstance(raw, self.batch_type):
            raise TypeError(f"objective {self.name} takes {self.batch_type.__name__} batches, "
                            f"got {type(raw).__name__}")
        return raw

    @abc.abstractmethod
    def num_targets(self, batch: Any) -> int:
        """How many targets the summed loss of `batch` covers (tokens, pairs, ...): the normaliser."""

    @abc.abstractmethod
    def __call__(self, model: nn.Module, batch: Any) -> ObjectiveOutput:
        """The summed loss (and summed metrics) of `model` on `batch`."""

    def target_ids(self, batch: Any) -> torch.Tensor | None:
        """Token ids the loss predicts (1-D), for bits per byte; None where that has no meaning."""
        return None

    def check_model(self, model: nn.Module) -> None:  # noqa: B027 - optional hook, nothing to check by default
        """Refuse a model this objective cannot train (a clear error before the first step)."""


class ObjectiveModule(nn.Module):
    """A model and its objective as one module: `torch.compile` of this compiles the loss into the
    model's graph. Used for the forward only; the optimizer and checkpoints take `model` itself."""

    def __init__(self, model: nn.Module, objective: Objective) -> None:
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: Any) -> ObjectiveOutput:
        return objective_forward(self.model, self.objective, batch)


def objective_forward(model: nn.Module, objective: Objective, batch: Any) -> ObjectiveOutput:
    """`objective(model, batch)` plus, for a mixture-of-experts model in training, the router's
    auxiliary losses (load balance, z-loss) and statistics: every training step's forward.

    The aux loss is a mean per token; adding it times the batch's target count to the summed loss
    makes it, after the step's division by the job's target count, the target-weighted mean over
    micro-batches and ranks, exactly once per micro-batch whatever the objective. Its metrics
    (moe_aux_loss, moe_z_loss, moe_load_max/min, moe_drop_frac, moe_router_entropy) are reported
    the same way."""
    layers = moe_layers(model)
    if not layers:
        return objective(model, batch)
    clear_records(layers)  # drop what evaluation or an activation-checkpoint recompute recorded
    out = objective(model, batch)
    aux = router_losses(layers)
    if aux is None:
        return out
    n = objective.num_targets(batch)
    metrics = {**out.metrics, **{k: v * n for k, v in aux.metrics.items()}}
    return ObjectiveOutput(out.loss + aux.loss * n, metrics, out.counts)


class TokenObjective(Objective):
    """An objective over `TokenBatch` whose loss is a function of the logits and the targets. Such a
    loss also runs on a pipeline's last stage (`stage_loss`), and gives per-token estimates (Sophia's
    Hessian) the logits they need."""

    batch_type = TokenBatch
    supports_pipeline = True

    def batch_of(self, raw: Any) -> TokenBatch:
        return TokenBatch.of(raw)

    def num_targets(self, batch: TokenBatch) -> int:
        return batch.target_count()  # counted on the host before the batch moved

    def target_ids(self, batch: TokenBatch) -> torch.Tensor:
        return batch.targets[batch.targets != IGNORE_INDEX]

    def logits(self, model: nn.Module, batch: TokenBatch) -> torch.Tensor:
        return logits_of(model(batch.input_ids))

    @abc.abstractmethod
    def stage_loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss from the model's output (a pipeline's last stage) and the targets."""
