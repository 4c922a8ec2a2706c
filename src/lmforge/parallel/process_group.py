"""Process-group lifetime: start it from torchrun's environment, end it cleanly.

    init_distributed(timeout_s, device) -> World     (no-op for a single process)
    shutdown()                                       barrier + destroy_process_group
    coord_group(), host_group(), host_twin(group)    the CPU-side (gloo) groups

A CUDA job's collectives run over NCCL, and reading an NCCL result on the host waits for everything
queued on the device before it. What the loop agrees on every step (target counts, a signal flag, the
slowest rank's clock) are host values, so they travel over gloo groups on CPU tensors: the host stays
ahead of the device, which only waits where a logged value is read.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from lmforge.parallel.world import World


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def _store(world: World, timeout: timedelta) -> dist.Store:
    """A TCPStore namespaced by the torchrun restart attempt.

    Under `torchrun --max-restarts`, restarted workers meet in the same store as the failed
    attempt; keys left by the dead attempt made init_process_group hang in most restarts
    (shared cpu-facts: 7 of 9). A fresh prefix per TORCHELASTIC_RESTART_COUNT fixed it (9 of 9).
    """
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"])
    # Under torchrun the agent hosts the store and every worker is a client.
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    base = dist.TCPStore(host, port, world.world_size, is_master=world.rank == 0 and not agent_hosts,
                         timeout=timeout, wait_for_workers=False, multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"lmforge/attempt_{attempt}/", base)


def _set_threads(world: World, device: torch.device, threads: int | None) -> None:
    """One CPU's cores split between the processes that share it, unless the user chose.

    Oversubscribed OpenMP makes gloo ranks on one machine ~10x slower (shared cpu-facts).
    """
    if threads or device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))


def init_distributed(timeout_s: int = 600, device: torch.device | None = None,
                     threads: int | None = None) -> World:
    """Join the job described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Collectives time out after `timeout_s`, so a dead rank makes the others fail with an error
    instead of hanging. Returns the World; a single process gets no process group.
    """
    world = World.from_env()
    device = device or torch.device("cpu")
    if world.world_size == 1 or dist.is_initialized():
        return world
    _set_threads(world, device, threads)
    if device.type == "cuda":
        torch.cuda.set_device(world.local_rank)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend_for(device), store=_store(world, timeout), rank=world.rank,
                            world_size=world.world_size, timeout=timeout)
    global _COORD_GROUP, _HOST_GROUP, _TIMEOUT
    _TIMEOUT = timeout
    # Per-step host values (parallel.coord's flags and clocks): the default group where that is gloo.
    _HOST_GROUP = None if backend_for(device) == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    # CPU-side agreement (lmforge.parallel.coord) waits on rank 0's work, e.g. preparing a corpus,
    # which may take far longer than a training collective may: its own gloo group, a long timeout.
    _COORD_GROUP = dist.new_group(backend="gloo", timeout=timedelta(hours=24))
    return world


_COORD_GROUP = None
_HOST_GROUP = None
_TIMEOUT: timedelta | None = None


def coord_group():
    """The process group for rank-0 decisions and waits (None: the default group)."""
    return _COORD_GROUP


def host_group():
    """The gloo group of all ranks for per-step host values (None: the default group, gloo itself)."""
    global _HOST_GROUP
    if _HOST_GROUP is None and dist.is_initialized() and "gloo" not in str(dist.get_backend()):
        # A default group someone else started (not init_distributed) without gloo: made on first use,
        # which every rank reaches together (whoever asks for it runs a collective over it next).
        _HOST_GROUP = dist.new_group(backend="gloo", timeout=_TIMEOUT)
    return _HOST_GROUP


def host_twin(group, force: bool = False):
    """A gloo group over the ranks of `group`, for summing host values over them without a device
    synchronisation: `group` itself when it is gloo already (unless `force`), None for None.

    Every rank must call this together, each with its own group of one partition of the ranks (a
    mesh dimension's groups): the partition is gathered and each of its groups created in one order.
    """
    if group is None:
        return None
    if not force and dist.get_backend(group) == "gloo":
        return group
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dist.get_process_group_ranks(group), group=coord_group())
    twin = None
    for ranks in sorted({tuple(r) for r in everyone}):
        created = dist.new_group(list(ranks), backend="gloo", timeout=_TIMEOUT)
        if dist.get_rank() in ranks:
            twin = created
    return twin


def shutdown() -> None:
    """Leave the job. The barrier first: a rank that destroys its group while a peer still runs a
    collective (FSDP's last reshard, a checkpoint's final gather) made runs abort at exit."""
    global _COORD_GROUP, _HOST_GROUP
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _COORD_GROUP = _HOST_GROUP = None


def abandon() -> None:
    """Leave the job after an error, without the barrier: the other ranks may never reach it."""
    global _COORD_GROUP, _HOST_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _COORD_GROUP = _HOST_GROUP = None
