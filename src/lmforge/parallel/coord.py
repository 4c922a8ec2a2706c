"""Agreement between ranks on things outside the step: who prepares shared files, what a
rank-0 decision was, whether any rank got a signal. Each is the identity in a single process.

A rank that fails alone must not leave the others waiting in a collective: `on_rank0` sends
rank 0's user error to every rank, so the whole job stops with the same message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from lmforge.errors import LmforgeError

T = TypeVar("T")


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def on_rank0(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only; every rank returns its result, or raises its LmforgeError."""
    if not _active():
        return fn()
    from lmforge.parallel.process_group import coord_group

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except LmforgeError as e:
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0, group=coord_group())
    status, value = box[0]
    if status == "error":
        raise value
    return value


def rank0_first(fn: Callable[[], T]) -> T:
    """Rank 0 runs `fn` first (e.g. writes a cache), then the others run it (and reuse the cache)."""
    if not _active():
        return fn()
    if dist.get_rank() == 0:
        return on_rank0(fn)
    on_rank0(lambda: None)  # returns once rank 0 is done; its error, if any, is raised here
    return fn()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on any (e.g. a SIGTERM that reached one rank). A host value
    over the host (gloo) group: asking every step never waits on the device."""
    if not _active():
        return flag
    from lmforge.parallel.process_group import host_group

    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group())
    return bool(t.item())


def max_over_ranks(value: float) -> float:
    """The largest of every rank's `value` (e.g. the slowest rank's step time), on every rank; over the
    host (gloo) group like `any_rank`."""
    if not _active():
        return value
    from lmforge.parallel.process_group import host_group

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group())
    return float(t.item())
