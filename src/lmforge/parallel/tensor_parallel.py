"""Tensor parallelism (Megatron-style) with optional sequence parallelism, applied from outside.

Per block: wq/wk/wv and w_gate/w_up are split by output columns (whole heads / MLP channels per
rank), wo and w_down by input rows, so each attention and MLP costs one all-reduce forward and
one backward. With sequence parallelism the norms and the residual stream between them hold a
1/tp slice of the sequence, and the all-reduce becomes an all-gather before attention/MLP and a
reduce-scatter after (the same bytes, 1/tp of the norm compute and activation memory).

Every parameter becomes a DTensor on the tp mesh, the unsplit ones (norms without sequence
parallelism, a tied table, learned positions) as Replicate: fused optimizers, foreach clipping
and FSDP's 2-D sharding all need one kind of tensor on one mesh.

Embeddings and head:
  - untied: the input table is split by vocabulary rows (each rank looks up its rows, one
    all-reduce), the output projection by vocabulary columns, gathered to full logits so the
    shared `token_loss_sum` sees plain tensors;
  - tied: the one table serves both ends, so it stays whole (Replicate) on every tp rank; FSDP
    still shards it over data parallelism. Splitting it would need vocabulary-parallel logits and
    loss, which the shared train step does not take. Its gradient is whole and equal on every tp
    rank: the lookup's output gradient is gathered back from the sequence slices, and every tp
    rank computes the same head gradient from the same full logits.

The residual stream between blocks is plain local tensors (the whole sequence, or with sequence
parallelism this rank's slice): each pipeline stage enters that region at its first block and
leaves it at the final norm or, before the last stage, after its last block, so stages exchange
whole sequences (a stage derives its RoPE positions from the length of what it receives).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _block_plan(sp: bool, swiglu: bool) -> dict:
    seq = Shard(1) if sp else Replicate()
    plan = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=seq),
        "mlp.w_up": ColwiseParallel(),
        "mlp.w_down": RowwiseParallel(output_layouts=seq),
    }
    if swiglu:
        plan["mlp.w_gate"] = ColwiseParallel()
    if sp:
        plan.update({
            "attn_norm": SequenceParallel(),
            "mlp_norm": SequenceParallel(),
            # attn(x, rope, mask, kv): only x is sequence-sharded; gather it before the projections.
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                       desired_input_layouts=(Replicate(), None, None, None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def replicate_on(module: nn.Module, mesh: DeviceMesh, local_output: bool) -> None:
    """Parameters -> Replicate DTensors; plain tensor inputs are taken as replicated; the output
    is handed on as a local tensor (`local_output`) or as the Replicate DTensor."""

    def inputs_fn(mod, inputs, device_mesh):
        return tuple(DTensor.from_local(t, device_mesh, [Replicate()], run_check=False)
                     if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

    def output_fn(mod, out, device_mesh):
        return out.to_local() if local_output and isinstance(out, DTensor) else out

    distribute_module(module, mesh, input_fn=inputs_fn, output_fn=output_fn)


def _grad_like_param(p: torch.Tensor) -> None:
    """DTensor autograd can leave a gradient laid out unlike its parameter: Partial for a norm
    weight under sequence parallelism (each rank holds its sequence slice's share), Replicate for
    a vocabulary-split table. Give it the parameter's layout as it accumulates, so clipping by
    value sees true values and a sharded table keeps a sharded gradient. (Under FSDP the hook
    never fires - FSDP trains new parameter objects - and FSDP does this itself.)"""
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        p.grad = g.redistribute(p.device_mesh, p.placements)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model` (a Transformer or one pipeline stage of it) over `tp_mesh` in place."""
    tp, sp = tp_mesh.size(), sequence_parallel
    tied = model.cfg.tie_embeddings
    table = getattr(model, "tok_embeddings", None)
    embeds = isinstance(table, nn.Embedding)
    has_head = getattr(model, "norm", None) is not None
    # The tied head reads the table as F.linear(x, table) inside the model's forward: with the
    # owner's table (a DTensor) it needs x as a DTensor; a pipeline's last-stage copy is plain.
    head_on_dtensor = has_head and tied and embeds

    # -- input side: outputs stay Replicate DTensors until the first block's entry hook --------
    if embeds:
        if tied:
            replicate_on(table, tp_mesh, local_output=False)
        else:
            parallelize_module(table, tp_mesh, RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=False))
    for name in ("pos_embeddings", "block_pos_embeddings"):  # learned position tables (GPT-2; GLM's)
        if getattr(model, name, None) is not None:
            replicate_on(getattr(model, name), tp_mesh, local_output=False)

    # -- blocks -----------------------------------------------------------------------------
    blocks = list(model.layers.children())
    for block in blocks:
        parallelize_module(block, tp_mesh, _block_plan(sp, block.mlp.gated))
        if not sp:
            replicate_on(block.attn_norm, tp_mesh, local_output=True)
            replicate_on(block.mlp_norm, tp_mesh, local_output=True)
        # Each rank now holds whole heads: the projections' local widths are 1/tp of the model's.
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
    if blocks:
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(), None, None, None),
            desired_input_layouts=(Shard(1) if sp else Replicate(), None, None, None), use_local_output=True))
        if sp and not has_head:
            parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))

    # -- head -----------------------------------------------------------------------------------
    if has_head:
        _parallelize_head(model, tp_mesh, sp, tied, head_on_dtensor)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_grad_like_param)


def _parallelize_head(model: nn.Module, tp_mesh: DeviceMesh, sp: bool, tied: bool,
                      head_on_dtensor: bool) -> None:
    if sp:
        parallelize_module(model.norm, tp_mesh, SequenceParallel())
        if tied:
            parallelize_module(model.norm, tp_mesh, PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(),
                use_local_output=not head_on_dtensor))
    else:
        replicate_on(model.norm, tp_mesh, local_output=tied and not head_on_dtensor)
    if not tied:
        parallelize_module(model.output, tp_mesh, ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()))
    if head_on_dtensor:
        # The logits come out of the model as a Replicate DTensor: hand the loss plain logits.
        parallelize_module(model, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=True))
