"""The pipeline bubble while training (`logging.monitor.pipeline_bubble`): the share of each pipeline
step this rank's stages sat idle, 1 - busy / wall.

torch's schedules run every stage's work through three PipelineStage methods (forward_one_chunk,
backward_one_chunk, backward_weight_one_chunk) and the loss through the schedule's `_compute_loss`, for
GPipe, 1F1B and interleaved 1F1B alike; the send/receive waits and the schedule's own bookkeeping are
outside them. `attach` wraps those methods on this rank's own stage and schedule objects (no class is
patched, nothing is wrapped unless the metric is on): busy is the time inside them, wall the time inside
`schedule.step` (the optimizer step after it is not pipeline time), counted only within `step`, so an
evaluation's forward passes are left out. On CUDA the device is synchronised around each piece, so the
times are the device's (this costs overlap, hence off by default); on a CPU the host clock is exact.

GPipe's textbook bubble is (p-1)/(m+p-1) for p stages and m micro-batches; the measured one is above it
by the send/receive time and any imbalance between stages (docs: Distributed, Monitoring).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_STAGE_WORK = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class BubbleTimer:
    """Busy and wall seconds of this rank's pipeline steps since the last `take`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.busy = self.wall = 0.0
        self._in_step = False

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _busy(self, inner: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:
                return inner(*args, **kwargs)
            self._sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._sync()
                self.busy += time.perf_counter() - t0

        return timed

    def _step(self, inner: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            self._in_step = True
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._sync()
                self.wall += time.perf_counter() - t0
                self._in_step = False

        return timed

    def take(self, group: dist.ProcessGroup | None = None) -> float | None:
        """The mean over the job's ranks of each one's idle share since the last call (None before any
        pipeline step). Every rank calls it together (one all-reduce of two numbers over `group`, a gloo
        group: the values are host clocks)."""
        stepped = self.wall > 0
        idle = 1.0 - self.busy / self.wall if stepped else 0.0
        t = torch.tensor([idle, float(stepped)], dtype=torch.float64)
        self.busy = self.wall = 0.0
        if dist.is_initialized():
            dist.all_reduce(t, group=group)
        return float(t[0] / t[1]) if t[1] > 0 else None


def attach(pipeline: Any, device: torch.device) -> BubbleTimer:
    """Time `pipeline`'s (parallel/pipeline.py's Pipeline) stages from now on; returns the timer."""
    timer = BubbleTimer(device)
    schedule = pipeline.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        for name in _STAGE_WORK:
            if hasattr(stage, name):
                setattr(stage, name, timer._busy(getattr(stage, name)))
    schedule._compute_loss = timer._busy(schedule._compute_loss)
    schedule.step = timer._step(schedule.step)
    return timer
