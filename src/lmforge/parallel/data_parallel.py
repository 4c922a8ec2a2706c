"""Data parallelism applied from outside: DDP, FSDP2 (ZeRO-2 / ZeRO-3, HSDP) and ZeRO-1.

What each rank holds between steps (P params, G grads, O optimizer state, N ranks):

    DDP      P + G + O             gradients all-reduced
    ZeRO-1   P + G + O/N           DDP gradients; each rank updates the parameters it owns and
                                   broadcasts them (torch's ZeroRedundancyOptimizer)
    ZeRO-2   P/N + G/N + O/N       FSDP2, parameters stay gathered from forward to backward
    ZeRO-3   P/N + G/N + O/N       FSDP2, parameters re-gathered for backward (least memory)

ZeRO-1 is DDP + ZeroRedundancyOptimizer rather than an FSDP2 setting: FSDP2 always shards
gradients (reduce-scatter), so nothing in it keeps whole gradients with sharded optimizer state.

Gradients are SUMMED over data-parallel ranks, not averaged as DDP and FSDP do by default: the
shared train step already divides every rank's loss by the whole step's target count, so the
sum is exactly the one-process gradient of the global batch (also with uneven target counts).
"""

from __future__ import annotations

import inspect
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixed_precision(param_dtype: str, reduce_dtype: str, precision: str) -> MixedPrecisionPolicy:
    """FSDP's compute / reduce dtypes; param_dtype 'auto' follows the run's precision."""
    if param_dtype == "auto":
        param_dtype = "bf16" if precision == "bf16" else "fp32"
    return MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, each its own FSDP unit: the decoder's `layers`; an encoder-decoder's
    encoder blocks, then its decoder blocks (their stacks' relative biases and norms stay at the root)."""
    if getattr(getattr(model, "cfg", None), "arch", None) == "t5":
        return [*model.encoder.layers.children(), *model.decoder.layers.children()]
    return list(model.layers.children())


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, zero: int, mp: MixedPrecisionPolicy,
               cpu_offload: bool, ignored: list[nn.Parameter] = ()) -> None:
    """fully_shard each transformer block, then the rest (embeddings, final norm, head) at the root.

    One FSDP unit per block lets the all-gather of block i+1 overlap block i's compute, and bounds
    the unsharded parameters alive at once to about one block. A 2-D `mesh` (dp_replicate,
    dp_shard) gives HSDP: sharded within a row, all-reduced across rows. `ignored` parameters (expert-
    parallel experts) are left as they are.
    """
    # Pinned memory needs an accelerator; on a CPU-only machine it fails (shared cpu-facts).
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    reshard = zero == 3
    ignored = set(ignored) or None
    units = []
    for block in _blocks(model):
        units.append(fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp,
                                 offload_policy=offload, ignored_params=ignored))
    units.append(fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp,
                             offload_policy=offload, ignored_params=ignored))
    for unit in units:  # per unit: these setters do not recurse
        unit.set_gradient_divide_factor(1.0)
        # Plain SUM collectives (no AVG / PREMUL_SUM): gloo has neither, NCCL loses nothing.
        unit.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device,
              ignored: list[nn.Module] = ()) -> None:
    """Composable DDP: parameter names and the module class stay as they are (no `module.`).

    No buffer sync before each forward: the only buffers (RoPE tables) are computed identically
    on every rank, and DDP would otherwise send them before every forward. `ignored` modules (expert-
    parallel experts) keep their gradients to themselves."""
    kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
    # The group, not the mesh: given a mesh sliced from a bigger one, replicate() turns every DTensor
    # parameter into a local tensor after each forward (its DDP + TP path), ignored ones included.
    replicate(model, process_group=mesh.get_group(), forward_sync_buffers=False,
              ignored_modules=list(ignored) or None, **kwargs)
    state = _HookState(mesh.get_group())
    model.register_comm_hook(state, _allreduce_sum_hook)
    model.lmforge_ddp_hook = state  # logging.monitor.grad_sync_time sets its timer


class SyncTimer:
    """Wall time of a step's gradient all-reduces: from the first bucket's launch to the last bucket's
    completion (both on the host: exact for gloo, whose collectives complete on the host), summed over
    steps. Completion callbacks run on the communication thread, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: float | None = None
        self._last: float | None = None
        self.total = 0.0

    def launched(self) -> None:
        with self._lock:
            if self._first is None:
                self._first = time.perf_counter()

    def done(self) -> None:
        with self._lock:
            self._last = time.perf_counter()

    def end_step(self) -> None:
        """Close the step (DDP waits for every bucket before its backward returns)."""
        with self._lock:
            if self._first is not None and self._last is not None:
                self.total += max(0.0, self._last - self._first)
            self._first = self._last = None

    def take(self) -> float:
        self.end_step()
        total, self.total = self.total, 0.0
        return total


class _HookState:
    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.timer: SyncTimer | None = None


def _allreduce_sum_hook(state, bucket):
    """DDP's default hook without its division by the world size. (No annotations: DDP checks
    them against the classes, and postponed evaluation turns them into strings.)"""
    timer = state.timer
    if timer is None:
        fut = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    timer.launched()
    fut = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True).get_future()

    def finished(f):
        timer.done()
        return f.value()[0]

    return fut.then(finished)


def zero1_optimizer(optimizer: torch.optim.Optimizer, group: ProcessGroup) -> ZeroRedundancyOptimizer:
    """Shard `optimizer`'s state over `group`: the same class, param groups and hyperparameters.

    Each rank keeps a local optimizer over the parameters it owns (whole tensors, balanced by
    size); `step()` updates those and broadcasts them. The lr schedule writes the wrapper's
    param_groups, which ZeroRedundancyOptimizer copies into the local one before every step.
    """
    if len(optimizer.state):
        raise ValueError("zero1_optimizer needs a fresh optimizer (it has state already)")
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    groups = [dict(g) for g in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=group, **defaults)
