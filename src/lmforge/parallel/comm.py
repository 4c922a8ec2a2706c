"""The distributed `Comm` of the shared train step: target counts, loss and gradient norms summed
over the right process groups, and deferred gradient synchronisation for accumulation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate

from lmforge.engine.comm import Comm


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class DistComm(Comm):
    """Collectives over the data-parallel group (`dp_group`) and the pipeline group (`pp_group`).

    Tensor-parallel ranks of one data-parallel replica see the same batch and compute the same
    loss, so counts and losses are summed over dp only; a pipeline's loss lives on its last
    stage and its parameters are split over stages, so losses and squared norms also sum over pp.
    """

    def __init__(self, dp_group: ProcessGroup | None, pp_group: ProcessGroup | None,
                 device: torch.device, expert_params: list[nn.Parameter] = (),
                 edp_group: ProcessGroup | None = None, count_group: ProcessGroup | None = None) -> None:
        self.dp_group = dp_group if _size(dp_group) > 1 else None
        # Counts are host integers: summed over a gloo group of the dp ranks (`init.host_twin`) on CPU
        # tensors, so a CUDA step learns its global target count without waiting for the device.
        self.count_group = count_group if count_group is not None else self.dp_group
        self.pp_group = pp_group if _size(pp_group) > 1 else None
        self.device = device
        # Expert-parallel experts: ranks of edp_group hold the same experts for different data.
        self.expert_params = list(expert_params) if _size(edp_group) > 1 else []
        self.edp_group = edp_group

    def finish_grads(self) -> None:
        grads = [p.grad.to_local() for p in self.expert_params if p.grad is not None]
        if grads:
            # One all-reduce for all experts of all layers (gloo and NCCL both sum in place).
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.edp_group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def sum_count(self, n: int) -> int:
        return self.sum_counts(n)[0]

    def sum_counts(self, *ns: int) -> list[int]:
        if self.dp_group is None:
            return list(ns)
        t = torch.tensor(ns, dtype=torch.int64)
        dist.all_reduce(t, group=self.count_group)
        return t.tolist()

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        # DDP (composable replicate) and FSDP2 share this switch; TP and single-stage models
        # have no deferred reduction to skip.
        if enabled or not hasattr(model, "set_requires_gradient_sync"):
            return contextlib.nullcontext()
        return _no_sync(model)

    def norms(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Norms of whole gradients: a sharded DTensor's local squared norm summed over the mesh
        dims it is sharded on, in one all-reduce per (mesh, dims) for all tensors alike."""
        out: list[torch.Tensor | None] = [None] * len(grads)
        tensors = list(grads)
        plain: list[int] = []
        pending: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        for i, g in enumerate(grads):
            if isinstance(g, DTensor):
                if any(p.is_partial() for p in g.placements):
                    g = g.redistribute(placements=[Replicate() if p.is_partial() else p
                                                   for p in g.placements])
                # Any placement left but Replicate splits the tensor (Shard, and FSDP-over-TP's
                # _StridedShard, which is not a Shard subclass).
                dims = tuple(d for d, p in enumerate(g.placements) if not p.is_replicate())
                local = g.to_local()
                if dims:
                    sq = torch.linalg.vector_norm(local, 2.0, dtype=torch.float32).square()
                    pending.setdefault((g.device_mesh, dims), []).append((i, sq))
                    continue
                tensors[i] = local
            plain.append(i)
        if plain:
            for i, n in zip(plain, torch._foreach_norm([tensors[i] for i in plain], 2.0)):
                out[i] = n
        # Ranks that share a mesh hold the same parameters in the same order (one stage of the
        # same model), so the stacked tensors line up element for element.
        for (mesh, dims), items in pending.items():
            stacked = torch.stack([sq for _, sq in items])
            for d in dims:
                dist.all_reduce(stacked, group=mesh.get_group(d))
            for (i, _), n in zip(items, stacked.sqrt().unbind()):
                out[i] = n
        return out  # type: ignore[return-value]

    def reduce_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        if self.pp_group is None:
            return sq
        sq = sq.detach().clone()
        dist.all_reduce(sq, group=self.pp_group)
        return sq

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.detach().clone()
        for group in (self.dp_group, self.pp_group):
            if group is not None:
                dist.all_reduce(loss, group=group)
        return loss

    def any_overflow(self, found: torch.Tensor) -> torch.Tensor:
        # Over every rank of the job, not only dp: a rank of another tensor-parallel shard, FSDP shard or
        # expert group holds other gradients, and one overflow anywhere must skip the step everywhere.
        found = found.detach().float().clone()
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found


@contextlib.contextmanager
def _no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
