"""Held-out loss, perplexity and bits per byte of an objective over a stream of batches: the one
evaluation the Trainer's validation and `lmforge eval` both run."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lmforge.engine.comm import LOCAL, Comm
from lmforge.engine.objectives import CausalLM, Objective, ObjectiveOutput
from lmforge.engine.precision import Precision
from lmforge.engine.step import MetricSums
from lmforge.errors import DataError


@runtime_checkable
class Evaluator(Protocol):
    """What evaluates a batch when a plain module cannot (a pipeline: its forward spans ranks).
    Returns this rank's share of the summed loss; the caller sums the shares over the job."""

    def eval_loss(self, objective: Objective, batch: Any) -> ObjectiveOutput: ...


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def evaluate_loss(
    model: nn.Module | Evaluator,
    batches: Iterable[Any],
    objective: Objective | None = None,
    comm: Comm = LOCAL,
    *,
    precision: Precision,
    token_bytes: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Mean loss per target, perplexity, the objective's metrics (means per target) and, with
    `token_bytes` (UTF-8 bytes of every token id), bits per byte.

    In a distributed job every data-parallel rank passes its own batches (the same number on every
    rank: forwards are collective) and `comm`; the sums are over the whole job. Bits per byte divides
    the summed loss (in bits) by the bytes the target tokens decode to, which makes models with
    different tokenizers comparable.
    """
    objective = objective or CausalLM()
    evaluator = model if isinstance(model, Evaluator) and not isinstance(model, nn.Module) else None
    mode = _eval_mode(model) if evaluator is None else contextlib.nullcontext()
    loss_sum, ce_sum, n_targets, n_bytes = 0.0, 0.0, 0, 0
    ce_key = objective.cross_entropy_metric
    metrics = MetricSums()
    with mode:
        for raw in batches:
            batch = objective.batch_of(raw)
            if device is not None:
                batch = batch.to(device)
            with precision.autocast():
                out = evaluator.eval_loss(objective, batch) if evaluator else objective(model, batch)
            loss_sum += float(comm.mean_loss(out.loss))
            if ce_key is not None:
                ce_sum += float(comm.mean_loss(out.metrics[ce_key]))
            metrics.add(out)
            n_targets += comm.sum_count(objective.num_targets(batch))
            ids = objective.target_ids(batch) if token_bytes is not None else None
            if ids is not None:
                n_bytes += comm.sum_count(int(token_bytes.to(ids.device)[ids].sum()))
    if n_targets == 0:
        raise DataError("evaluation saw no target tokens: the evaluation data is empty or all ignored")
    loss = loss_sum / n_targets
    # Perplexity and bits per byte are of the cross-entropy: the loss itself, or the part an objective
    # that mixes in another term (distillation's divergence) reports as a metric.
    ce = loss_sum if ce_key is None else ce_sum
    out = {"loss": loss, "ppl": math.exp(min(ce / n_targets, 700.0)), "tokens": n_targets}
    if n_bytes > 0:
        out["bpb"] = ce / math.log(2) / n_bytes
    out.update(metrics.means(comm, n_targets))
    return out
