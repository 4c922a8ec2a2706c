"""Expert parallelism: the experts of every mixture-of-experts layer split over groups of `parallel.ep`
data-parallel ranks, tokens sent to the rank holding their expert and back with all-to-all.

Layout (tp = pp = 1; D data-parallel ranks, ep | D, mesh (edp, ep) = (D / ep, ep)):

    rank r holds experts [ (r % ep) * E/ep, (r % ep + 1) * E/ep )   each expert tensor a DTensor,
                                                                     (Replicate on edp, Shard(0) on ep)
    every other parameter: DDP or FSDP over all D ranks, as without ep

A layer's routing, capacity and weighting run on each rank's own tokens as in one process; only
`GroupedExperts.forward(x_sorted, counts)` (tokens grouped by expert, E counts) is replaced:

    1. all-to-all of the counts: rank j learns how many rows every rank sends to each of its experts;
    2. all-to-all of the rows (uneven splits), regrouped so each local expert's rows are contiguous;
    3. the local experts on their rows (the model's own forward, with the local weight shards);
    4. the inverse regrouping and all-to-all back, in the caller's order.

Both all-to-alls are differentiable (the backward is the reverse exchange). An expert's gradient
is then the sum over the tokens of its ep group; the ranks of one edp group hold the same experts
for different data, so `DistComm.finish_grads` sums their gradients (plain all-reduce, after the
last micro-batch), as DDP does for everything else. DDP and FSDP leave the experts alone (ignored
modules / parameters): they are already split ep ways, and the global gradient norm sums their
squares over "ep" because they are DTensors sharded there (DistComm.norms).

torchtitan's expert parallelism (`ExpertParallel`) is the model: experts as DTensors sharded on an ep
mesh, token exchange around the grouped matmul. Unlike it, experts are not additionally sharded
by FSDP over edp (they stay whole on their ep rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split `in_splits` (to each rank) -> received rows split `out_splits` (from each)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def dispatch_combine(local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                     counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Run rows grouped by global expert (`x` (N, d), `counts` (E,)) on the ranks of `group` that
    hold their experts (rank j: experts j*E/ep .. (j+1)*E/ep - 1) and return their outputs in
    `x`'s row order. `local_experts(rows, local_counts)` computes this rank's experts."""
    ep = dist.get_world_size(group)
    n_experts = counts.numel()
    local = n_experts // ep
    counts = counts.to(torch.int64)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)  # equal splits: `local` counts per rank
    recv = recv.view(ep, local)  # recv[j, e]: rows rank j sends to this rank's expert e
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    rows = _AllToAll.apply(x, recv_splits, send_splits, group)  # (M, d) in (source rank, expert) blocks
    # Regroup the blocks by local expert (stable: within an expert, rows keep their source order).
    block_expert = torch.arange(local, device=x.device).repeat(ep)  # the expert of each (j, e) block
    order = torch.argsort(torch.repeat_interleave(block_expert, recv.flatten().to(x.device)), stable=True)
    out = local_experts(rows.index_select(0, order), recv.sum(0))  # (M, d) by local expert
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return _AllToAll.apply(out.index_select(0, inverse), send_splits, recv_splits, group)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The GroupedExperts module of every mixture-of-experts layer of `model`."""
    from lmforge.models.moe import GroupedExperts

    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Split every layer's experts over `ep_mesh["ep"]` (this rank keeps its slice as DTensor shards)
    and route their tokens there. Returns the expert parameters (for `finish_grads` and to keep
    DDP / FSDP off them). Every rank must hold the same full weights on entry (same seed)."""
    group = ep_mesh.get_group("ep")
    params: list[nn.Parameter] = []
    for experts in expert_modules(model):
        for name, p in list(experts.named_parameters(recurse=False)):
            # Local slicing of identical full tensors; src_data_rank=None: no scatter needed.
            dt = distribute_tensor(p.data, ep_mesh, [Replicate(), Shard(0)], src_data_rank=None)
            param = nn.Parameter(dt, requires_grad=p.requires_grad)
            experts.register_parameter(name, param)
            params.append(param)
        experts.forward = _ep_forward(experts, group)
    return params


def _ep_forward(experts: nn.Module, group: ProcessGroup) -> Callable[..., torch.Tensor]:
    from lmforge.models.moe import grouped_swiglu

    def local_experts(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # The model's own expert maths on this rank's weight shards: to_local's backward hands their
        # gradients to the DTensor parameters.
        biases = None
        if experts.has_bias:  # sharded over the experts like the weights
            biases = tuple(b.to_local() for b in (experts.b_gate, experts.b_up, experts.b_down))
        return grouped_swiglu(rows, counts, experts.w_gate.to_local(), experts.w_up.to_local(),
                              experts.w_down.to_local(), biases=biases, clamp=experts.clamp)

    def forward(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return dispatch_combine(local_experts, x, counts, group)

    return forward
