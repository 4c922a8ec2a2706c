"""Pipeline parallelism with `torch.distributed.pipelining`: stages cut from the model by layer
ranges, GPipe / 1F1B / interleaved 1F1B schedules, and the pipeline's optimizer step.

A stage is the Transformer itself with the parts of other stages removed (torchtitan's manual
split): its blocks in a ModuleDict keyed by global layer index, the embeddings only on the first
stage, final norm and head only on the last. Parameter names therefore stay those of the whole
model, which is what lets a pipeline checkpoint load into any other layout.

With `pp_stages_per_rank` = v > 1 (interleaved), rank r holds stages r, r + pp, ..., r + (v-1)pp.

Tied embeddings: the first stage owns the table (the optimizer updates it there); the last stage
holds a gradient-carrying copy in a non-persistent buffer. Each step the copy is refreshed from
the owner before the pipeline runs, and afterwards its gradient, summed over data-parallel
ranks, is added to the owner's: the same gradient as the unsplit model (Megatron does the same
with an all-reduce and duplicated updates).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Replicate

from lmforge.engine.comm import Comm
from lmforge.engine.objectives import Objective, ObjectiveOutput
from lmforge.engine.precision import Precision
from lmforge.engine.step import StepResult, Verdict, apply_update, withheld

_SPLIT_PARTS = ("tok_embeddings", "pos_embeddings", "layers", "norm", "output")


class TiedHead(nn.Module):
    """The last stage's copy of a tied embedding table: read by the head, never optimized."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        # A buffer, not a parameter: the optimizer, the gradient norm and checkpoints must see
        # the table once, where the first stage owns it.
        self.register_buffer("weight", weight.detach().clone().requires_grad_(True), persistent=False)


def stage_ids(pp: int, v: int, pp_rank: int) -> list[int]:
    """Stages on `pp_rank` with `v` stages per rank, looped placement."""
    return [pp_rank + k * pp for k in range(v)]


def carve(model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """A Transformer holding only `layer_ids` (and the embeddings / head when first / last).

    The submodules are `model`'s own (no copy of weights); everything else (config, RoPE buffers,
    hooks) is copied, so each stage is an independent module FSDP and TP can wrap.
    """
    parts = {n: model._modules[n] for n in _SPLIT_PARTS if n in model._modules}
    for n in parts:
        model._modules[n] = None
    try:
        stage = copy.deepcopy(model)
    finally:
        model._modules.update(parts)
    stage.layers = nn.ModuleDict({str(i): parts["layers"][i] for i in layer_ids})
    for n in ("tok_embeddings", "pos_embeddings"):
        if n in parts:
            setattr(stage, n, parts[n] if first else None)
    for n in ("norm", "output"):
        if n in parts:
            setattr(stage, n, parts[n] if last else None)
    if last and not first and model.cfg.tie_embeddings:
        stage.tok_embeddings = TiedHead(parts["tok_embeddings"].weight)
    return stage


def split_model(model: nn.Module, pp: int, v: int,
                pp_rank: int) -> tuple[list[int], list[nn.Module], nn.Module]:
    """(stage indices, stage modules, one module over all of this rank's parts).

    The last is what the optimizer and checkpoints take: for v == 1 the stage itself; for v > 1
    a container sharing the stages' submodules under the whole model's names.
    """
    n_stages = pp * v
    per = model.cfg.n_layers // n_stages
    ids = stage_ids(pp, v, pp_rank)
    stages = [carve(model, list(range(s * per, (s + 1) * per)), s == 0, s == n_stages - 1) for s in ids]
    if v == 1:
        return ids, stages, stages[0]
    local_layers = [i for s in ids for i in range(s * per, (s + 1) * per)]
    holder = carve(model, local_layers, 0 in ids, n_stages - 1 in ids)
    if isinstance(getattr(holder, "tok_embeddings", None), TiedHead):
        holder.tok_embeddings = stages[-1].tok_embeddings  # the same copy the last stage reads
    return ids, stages, holder


def gather_parts(holder: nn.Module, stages: list[nn.Module]) -> None:
    """Point a v > 1 holder at the stages' blocks as they are after TP / checkpointing / FSDP
    (wrappers included), so its module tree, and the state dict hooks in it, match what runs."""
    holder.layers = nn.ModuleDict({n: m for stage in stages for n, m in stage.layers.named_children()})


def build_schedule(kind: str, stages: list[nn.Module], ids: list[int], n_stages: int, n_micro: int,
                   device: torch.device, group: ProcessGroup, loss_fn: Callable):
    """The torch.distributed.pipelining schedule for this rank's stages.

    scale_grads=False: `loss_fn` already divides by the step's global target count, as the
    non-pipelined step does, so gradients must not be divided again by the micro-batch count.
    """
    pstages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(stages, ids)]
    if kind == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(pstages, n_micro, loss_fn=loss_fn, scale_grads=False)
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return cls(pstages[0], n_micro, loss_fn=loss_fn, scale_grads=False)


class Pipeline:
    """This rank's share of a pipelined model and the optimizer step over it."""

    def __init__(self, stages: list[nn.Module], ids: list[int], n_stages: int, schedule_kind: str,
                 n_micro: int, device: torch.device, pp_group: ProcessGroup,
                 dp_group: ProcessGroup | None, objective: Objective) -> None:
        if not objective.supports_pipeline:
            raise ValueError(f"objective {objective.name} has no per-stage loss; it cannot run in a pipeline")
        self.stages, self.ids, self.n_stages = stages, ids, n_stages
        self.objective = objective
        self.has_first, self.has_last = 0 in ids, n_stages - 1 in ids
        self.pp_group, self.dp_group = pp_group, dp_group
        self.pp = dist.get_world_size(pp_group)
        self._denom = 1
        self.schedule = build_schedule(schedule_kind, stages, ids, n_stages, n_micro, device, pp_group,
                                       self._loss)
        tied = stages[0].cfg.tie_embeddings
        self._owner = stages[0].tok_embeddings if tied and self.has_first else None
        head = stages[-1].tok_embeddings if self.has_last else None
        self._copy = head if isinstance(head, TiedHead) else None
        self._tied = tied

    def _loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.objective.stage_loss(output, targets) / self._denom

    # -- tied embeddings across the first and last stage ----------------------------------------
    def _push_table(self) -> None:
        if not self._tied or self.has_first == self.has_last:
            return  # untied, or a middle rank (pp > 1 never puts the first and last stage together)
        if self._owner is not None:
            w = self._owner.weight.detach()
            w = w.full_tensor() if isinstance(w, DTensor) else w
            dist.send(w.contiguous(), group=self.pp_group, group_dst=self.pp - 1)
        else:
            buf = torch.empty_like(self._copy.weight)
            dist.recv(buf, group=self.pp_group, group_src=0)
            with torch.no_grad():
                self._copy.weight.copy_(buf)

    def _pull_grad(self) -> None:
        if not self._tied or self.has_first == self.has_last:
            return
        if self._copy is not None:
            g = self._copy.weight.grad
            g = torch.zeros_like(self._copy.weight) if g is None else g.detach()
            if self.dp_group is not None:
                dist.all_reduce(g, group=self.dp_group)
            dist.send(g.contiguous(), group=self.pp_group, group_dst=0)
            self._copy.weight.grad = None
        else:
            w = self._owner.weight
            g = torch.empty(w.shape, dtype=w.dtype, device=w.device if not isinstance(w, DTensor)
                            else w.to_local().device)
            dist.recv(g, group=self.pp_group, group_src=self.pp - 1)
            with torch.no_grad():
                if isinstance(w.grad, DTensor):
                    mesh = w.grad.device_mesh
                    local = DTensor.from_local(g, mesh, [Replicate()] * mesh.ndim, run_check=False)
                    w.grad.to_local().add_(local.redistribute(mesh, w.grad.placements).to_local())
                elif w.grad is None:
                    w.grad = g
                else:
                    w.grad.add_(g)

    # -- one optimizer step -------------------------------------------------------------------
    def step(self, micro_batches: Sequence[Any], optimizer: torch.optim.Optimizer, precision: Precision,
             comm: Comm, *, grad_clip: float, grad_clip_value: float = 0.0,
             group_stats: bool = False, judge: Callable[[float], Verdict | None] | None = None) -> StepResult:
        """The pipelined counterpart of `train_step`: the schedule runs forward and backward over
        the micro-batches, then the shared `apply_update` clips by the norm over all stages."""
        objective = self.objective
        batch = objective.batch_type.cat([objective.batch_of(b) for b in micro_batches])
        x, y = batch.input_ids, batch.targets
        n_targets, n_tokens = comm.sum_counts(objective.num_targets(batch), batch.num_tokens)
        self._denom = max(n_targets, 1)
        self._push_table()
        losses: list[torch.Tensor] = []
        with precision.autocast():
            self.schedule.step(*((x,) if self.has_first else ()), target=y if self.has_last else None,
                               losses=losses if self.has_last else None, return_outputs=False)
        self._pull_grad()
        local = (torch.stack([t.detach().float() for t in losses]).sum() if losses
                 else torch.zeros((), device=x.device))
        result = StepResult(float(comm.mean_loss(local)), n_tokens, n_targets, 0.0)
        if withheld(result, judge, optimizer):
            return result
        apply_update(optimizer, precision, result, grad_clip, grad_clip_value, group_stats, comm)
        return result

    @torch.no_grad()
    def eval_loss(self, objective: Objective, batch: Any) -> ObjectiveOutput:
        """This rank's share of the summed loss of one evaluation batch (on the last stage; zero
        elsewhere): every rank calls it with the same batch shape. The loss is the pipeline's own
        objective (its schedule was built with it)."""
        assert objective is self.objective, "a pipeline evaluates the objective it was built with"
        x, y = batch.input_ids, batch.targets
        n_micro = self.schedule._n_microbatches
        if x.shape[0] < n_micro:
            raise ValueError(f"the pipeline runs a batch as {n_micro} micro-batches, so an evaluation batch "
                             f"needs at least {n_micro} rows; got {x.shape[0]}")
        self._push_table()
        losses: list[torch.Tensor] = []
        self._denom = 1
        self.schedule.eval(*((x,) if self.has_first else ()), target=y if self.has_last else None,
                           losses=losses if self.has_last else None)
        local = torch.stack([t.float() for t in losses]).sum() if losses else torch.zeros((), device=x.device)
        return ObjectiveOutput(local, {})
