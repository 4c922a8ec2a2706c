"""One entry point: `parallelize(model, cfg, dims)` applies the layout's strategies to a built
model and returns a `ParallelModel` whose `step` replaces `train_step` in the training loop.

Order (torchtitan's): pipeline split -> expert parallel -> tensor parallel -> activation
checkpointing -> compile -> FSDP / DDP. TP rewrites parameters into DTensors that FSDP then
shards on the data-parallel dims; expert parallelism splits the experts into DTensors on its own
mesh, which DDP / FSDP leave alone; checkpointing and compile wrap the already-parallel blocks;
FSDP goes last so its units (one per block) contain everything a block runs.

    world = init_distributed(cfg.parallel.timeout_s, device, cfg.train.threads)
    dims = ParallelDims.resolve(cfg.parallel, world.world_size, cfg.model, cfg.train.grad_accum_steps)
    dims.build_mesh(device.type)                                         # (world size > 1)
    pm = parallelize(build_model(cfg.model, device), cfg, dims, "fp32", objective)
    optimizer = pm.wrap_optimizer(build_optimizer(pm.model, cfg.optim))
    loader rank / world size: dims.dp_rank / dims.dp_size
    result = pm.step(micro_batches, optimizer, precision, grad_clip=1.0)  # each step
    evaluate_loss(pm, batches, objective, pm.comm, precision=precision)  # validation
    CheckpointManager(...).save(step, pm.model, optimizer, state)        # every rank calls it
    shutdown()                                                           # at exit
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmforge.config.schema import Config
from lmforge.engine.comm import LOCAL, Comm
from lmforge.engine.objectives import CausalLM, Objective, ObjectiveModule, ObjectiveOutput
from lmforge.engine.precision import Precision
from lmforge.engine.step import StepHook, StepResult, Verdict, train_step
from lmforge.errors import ConfigError
from lmforge.parallel.checkpointing import apply_activation_checkpointing
from lmforge.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from lmforge.parallel.pipeline import Pipeline


@dataclass
class ParallelModel:
    """A model with its parallel strategies applied, on this rank.

    model: the module the optimizer and checkpoints take; parameter names are the unsplit
        model's (a pipeline rank holds only its stages' parameters).
    parts: the modules that run forward on this rank (pipeline: its stages; else [model]).
    """

    model: nn.Module
    parts: list[nn.Module]
    dims: ParallelDims
    comm: Comm
    objective: Objective
    pipeline: Pipeline | None = None
    forward: nn.Module | None = None  # the compiled model + objective (one process with train.compile)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to train with: ZeRO-1 shards its state over the data-parallel group."""
        if not self.dims.zero1:
            return optimizer
        from lmforge.parallel.data_parallel import zero1_optimizer

        return zero1_optimizer(optimizer, self.dims.dp_mesh.get_group())

    def step(
        self,
        micro_batches: Sequence[Any],
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        *,
        grad_clip: float,
        grad_clip_value: float = 0.0,
        group_stats: bool = False,
        judge: Callable[[float], Verdict | None] | None = None,
        hooks: Sequence[StepHook] = (),
        defer: bool = False,
    ) -> StepResult:
        """One optimizer step over this rank's micro-batches (its data-parallel share of the step).

        Same contract as `train_step`; the loss and gradient norm in the result are the whole job's.
        A pipeline never defers (its schedule reads the loss on the host).
        """
        if self.pipeline is not None:
            return self.pipeline.step(micro_batches, optimizer, precision, self.comm,
                                      grad_clip=grad_clip, grad_clip_value=grad_clip_value,
                                      group_stats=group_stats, judge=judge)
        return train_step(self.model, micro_batches, optimizer, precision, objective=self.objective,
                          grad_clip=grad_clip, grad_clip_value=grad_clip_value, group_stats=group_stats,
                          comm=self.comm, judge=judge, hooks=hooks, forward=self.forward, defer=defer)

    @torch.no_grad()
    def eval_loss(self, objective: Objective, batch: Any) -> ObjectiveOutput:
        """This rank's share of the summed loss of one evaluation batch (`evaluate_loss` sums the
        shares over the job; every rank must call it with its own batch of the same shape). Runs the
        eager model: a compiled one would recompile for the shorter last batch of a split."""
        if self.pipeline is not None:
            return self.pipeline.eval_loss(objective, batch)
        was = self.model.training
        self.model.eval()
        try:
            out = objective(self.model, batch)
        finally:
            self.model.train(was)
        if self.dims.world_size > 1:
            # ZeRO-2 keeps parameters gathered after a forward until its backward, which evaluation
            # never runs: shard them again, or weight swaps (EMA/SWA) and the optimizer see full tensors.
            from torch.distributed.fsdp import FSDPModule

            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
        return out


def parallelize(model: nn.Module, cfg: Config, dims: ParallelDims, precision: str = "fp32",
                objective: Objective | None = None) -> ParallelModel:
    """Apply `dims`' layout and `cfg.train`'s activation checkpointing / compile to `model`.

    `model` is a freshly built Transformer (same seed on every rank, so replicas start equal);
    use the returned `.model` / `.parts` from here on. `precision` is the resolved train
    precision (fp32 / bf16 / fp16); FSDP's param_dtype 'auto' follows it. `objective` (default:
    causal LM) is what the step minimises.
    """
    tc = cfg.train
    objective = objective or CausalLM()
    if dims.world_size == 1:
        apply_activation_checkpointing(model, tc.activation_checkpointing, tc.ac_every, tc.ac_save)
        # One process compiles the model and the objective together: one graph, the loss included
        # (an eager loss on a copy of all logits outside the graph costs as much as the model's blocks).
        forward = torch.compile(ObjectiveModule(model, objective)) if tc.compile else None
        return ParallelModel(model, [model], dims, LOCAL, objective, forward=forward)
    if precision == "fp16" and dims.pp > 1:
        # The pipeline schedule runs the backward itself, on the unscaled loss: fp16 gradients would
        # underflow, and the scaler would then divide them by a scale they never got.
        raise ConfigError(
            "train.precision=fp16 with parallel.pp > 1: the pipeline schedule's backward does not apply "
            "the loss scale; fp16 works with DDP, FSDP/ZeRO and tensor parallelism (one loss scale agreed "
            "over all ranks) - use train.precision=bf16 (no scaler) or fp32 with a pipeline"
        )
    if tc.compile and dims.tp > 1:
        raise ConfigError(
            "train.compile=true with parallel.tp > 1: torch 2.13's compiler fails on the tensor-parallel "
            "blocks (AOT autograd guesses the DTensor -> local tensor hand-offs wrongly in backward); "
            "compile works with DDP, FSDP and pipeline layouts - set train.compile=false or parallel.tp=1"
        )
    if dims.mesh is None:
        raise ValueError("ParallelDims.build_mesh(device_type) must run before parallelize()")
    from lmforge.parallel.comm import DistComm
    from lmforge.parallel.data_parallel import apply_ddp, apply_fsdp, mixed_precision
    from lmforge.parallel.process_group import host_twin
    from lmforge.parallel.tensor_parallel import apply_tp

    mesh, pc = dims.mesh, dims.cfg
    device = next(model.parameters()).device
    dp_group = dims.dp_mesh.get_group() if dims.dp_size > 1 else None
    pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
    if dims.pp > 1:
        from lmforge.parallel.pipeline import split_model

        ids, parts, holder = split_model(model, dims.pp, pc.pp_stages_per_rank, dims.pp_rank)
    else:
        parts, holder = [model], model
    expert_params: list[nn.Parameter] = []
    for part in parts:
        if dims.ep > 1:
            from lmforge.parallel.expert_parallel import apply_ep, expert_modules

            expert_params += apply_ep(part, dims.ep_mesh)
        if dims.tp > 1:
            apply_tp(part, mesh["tp"], pc.sequence_parallel)
        apply_activation_checkpointing(part, tc.activation_checkpointing, tc.ac_every, tc.ac_save)
        _maybe_compile(part, tc.compile)
        if dims.fsdp:
            dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
            apply_fsdp(part, dp_mesh, pc.zero, mixed_precision(pc.param_dtype, pc.reduce_dtype, precision),
                       pc.cpu_offload, ignored=expert_params)
        elif dims.ddp:
            apply_ddp(part, dims.dp_mesh, device, ignored=expert_modules(part) if dims.ep > 1 else ())
    edp_group = dims.ep_mesh.get_group("edp") if dims.ep > 1 else None
    comm = DistComm(dp_group, pp_group, device, expert_params, edp_group,
                    count_group=host_twin(dp_group))
    pipeline = None
    if dims.pp > 1:
        from lmforge.parallel.pipeline import Pipeline, gather_parts

        if holder is not parts[0]:
            gather_parts(holder, parts)
        pipeline = Pipeline(parts, ids, dims.pp * pc.pp_stages_per_rank, pc.pp_schedule,
                            dims.microbatches(tc.grad_accum_steps), device, pp_group, dp_group, objective)
    return ParallelModel(holder, parts, dims, comm, objective, pipeline)


def _maybe_compile(model: nn.Module, enabled: bool) -> None:
    """Compile each block in place: module.compile keeps parameter names (torch.compile's wrapper
    would put `_orig_mod.` into every checkpoint key), and per-block graphs are what FSDP's
    per-block units and the checkpoint wrapper expect."""
    if not enabled:
        return
    for block in model.layers.children():
        block.compile()
