"""What the budget planner measures: the whole process's clock (`Deadline`, from the process's start) and
the machine's training speed for a few candidate shapes (`probe`), bounded to a small share of the budget.

The probe trains each shape for up to a second (2-8 steps, the fastest kept) as the run will: the engine's
own step (engine.step.train_step), AdamW fused where the run's is, the planned micro-batch and context,
random tokens, and host memory kept as `Trainer.fit` keeps it (without that, glibc returns each step's
temporaries to the OS and small CPU shapes step up to 2x slower than they train). Shapes go from the
smallest eligible up until the probe's time is spent, so a larger budget measures (and may choose) larger
shapes. Precision: the existing `resolve_precision("auto", ...)` path, at the largest shape measured, where
its cost fits what is left of the probe's time (on a CPU it times bf16 steps, which are up to 7x slower
where there are no bf16 units)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from lmforge.tools.planner import (
    Corpus,
    Measured,
    Shape,
    Throughput,
    batch_shape,
    candidate_shapes,
    contenders,
    could_win,
    model_config,
    vocab_for,
)

PROBE_SHARE = 0.05  # of the budget, at most (the first shape is always measured)
PROBE_MIN_S, PROBE_MAX_S = 0.5, 60.0  # a minute measures every shape of the ladder a budget can afford
# steps a shape is timed: as many as fit in PROBE_SHAPE_S (at least 2, at most PROBE_STEPS a second), the
# fastest kept. A fresh process's steps reach speed from the second or third (its heap grows to the step's
# peak first) and a 2-core machine's steps of 0.1-0.3 s vary by 10-30%: at 5 minutes on kjv one run's 2-3
# steps a shape measured d64-L2 and d96-L3 at ~60% of their speed and the plan took d128-L4 (1.302 bpb
# against 1.243). Longer is not cheaper than a second pass (below): 3 s a shape over the ladder and again
# took 23.6 s of a 5-minute budget (1 s and one pass: ~6.5 s)
PROBE_STEPS, PROBE_SHAPE_S = 8, 1.0
# a second pass: a stall of the machine while one shape is timed (another process's burst on a small
# machine) reads as a slow shape and flips a near tie (on 2 busy cores d64-L2 read at 17,462-17,889 tok/s
# instead of 22,691-28,861, and two 2-minute plans took d96-L3: python 1.962 bpb against 1.704-1.747), so
# the shapes within REMEASURE_NEAR of the plan's predicted loss are timed once more, a pass apart, and
# keep the faster reading (on a CPU, where the time allows)
REMEASURE_NEAR = 0.1
PRECISION_COST = 16  # resolve_precision's steps (fp32 + bf16, warm-up and timed) at up to 7x in bf16


def process_elapsed() -> float:
    """Seconds since this process started (Linux: /proc), so the interpreter's start-up and imports count
    against the budget; 0 where the start time cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class Deadline:
    """The whole process's budget: `elapsed` counts from the process's start, `left` is what remains."""

    budget_s: float
    now: Callable[[], float] = field(default=time.perf_counter, repr=False)
    _zero: float = 0.0

    @classmethod
    def from_process(cls, budget_s: float) -> Deadline:
        d = cls(budget_s)
        d._zero = d.now() - process_elapsed()
        return d

    @classmethod
    def since(cls, budget_s: float, start: float) -> Deadline:
        """A budget counted from `start` (a time.perf_counter() reading): `lmforge.cli.main(argv)` called
        from Python, whose process started before the command did."""
        return cls(budget_s, _zero=start)

    @property
    def elapsed(self) -> float:
        return self.now() - self._zero

    @property
    def left(self) -> float:
        return self.budget_s - self.elapsed


def probe_optimizer(params, device):
    """AdamW as a run builds it where the config leaves optim.fused unset (the fused kernel on CPU and CUDA:
    on CPU several times faster than the for-loop path)."""
    import torch

    from lmforge.optim.builder import fused_by_default

    return torch.optim.AdamW(params, lr=1e-4, fused=fused_by_default(device.type))


def timed_steps(model, opt, prec, vocab: int, micro: int, seq: int, device, until: float,
                keep_memory: bool = True, shape_s: float = PROBE_SHAPE_S) -> float:
    """The fastest of the training steps of `model` on a random (micro, seq) batch that fit in `shape_s`
    seconds and before `until` (at most PROBE_STEPS a second of it), at least two (the first allocates,
    the optimizer's state included). `keep_memory`: the run's train.keep_host_memory, held as `Trainer.fit`
    holds it (glibc then reuses freed memory instead of faulting fresh pages in every step: 1.8x the speed
    of d64-L2 at 16 x 256 on 2 AVX2 cores)."""
    import torch

    from lmforge.data.batch import TokenBatch
    from lmforge.engine.step import train_step
    from lmforge.utils.host_memory import keep_freed_memory

    x = torch.randint(0, vocab, (micro, seq + 1), device=device)
    batch = TokenBatch(x[:, :-1], x[:, 1:])
    times = []
    start = time.perf_counter()
    with keep_freed_memory(keep_memory):
        for _ in range(max(2, round(PROBE_STEPS * shape_s))):
            t0 = time.perf_counter()
            train_step(model, [batch], opt, prec).loss  # noqa: B018  (reading the loss synchronises)
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - t0)
            if len(times) >= 2 and (now + times[-1] > until or now + times[-1] > start + shape_s):
                break
    return min(times)


def timed_forward(model, prec, vocab: int, micro: int, seq: int, device, repeats: int = 2) -> float:
    """The fastest of `repeats` evaluation forwards of a random (micro, seq) batch as the final evaluation
    runs them (engine.evaluate: eval mode, no autograd, the loss read)."""
    import torch

    from lmforge.data.batch import TokenBatch
    from lmforge.engine.objectives import CausalLM

    x = torch.randint(0, vocab, (micro, seq + 1), device=device)
    batch, objective, times = TokenBatch(x[:, :-1], x[:, 1:]), CausalLM(), []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(repeats):
                t0 = time.perf_counter()
                with prec.autocast():
                    float(objective(model, batch).loss)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
    finally:
        model.train(was_training)
    return min(times)


def _step_seconds(shape: Shape, vocab: int, micro: int, seq: int, device, precision: str,
                  until: float, keep_memory: bool = True, shape_s: float = PROBE_SHAPE_S
                  ) -> tuple[float, float, Any]:
    """Seconds of one training step of `shape` (the fastest of timed_steps'), of one evaluation forward
    (timed_forward's, after the steps: the model is warm) and the model (for the precision probe)."""
    import torch

    from lmforge.engine.precision import Precision
    from lmforge.models import build_model

    with torch.random.fork_rng(devices=[]):  # measuring never changes the run's random stream
        torch.manual_seed(0)
        model = build_model(model_config(shape, vocab, seq), device=device)
        opt = probe_optimizer(model.parameters(), device)
        prec = Precision(precision, device)
        step = timed_steps(model, opt, prec, vocab, micro, seq, device, until, keep_memory, shape_s)
        return step, timed_forward(model, prec, vocab, micro, seq, device), model


def _second_pass(points: list, budget_s: float, deadline: Deadline, corpus: Corpus, user: dict[str, Any],
                 precision: str, until: float, keep: bool, say: Callable[[str], object]) -> list:
    """`points` with the contenders (planner.contenders) timed once more where the probe's time allows,
    each keeping the faster of its two readings."""
    import torch

    table = Throughput("cpu", tuple(points), precision, spent_s=deadline.elapsed)
    again = contenders(budget_s, table, corpus, user, REMEASURE_NEAR)
    if len(again) < 2:
        return points
    say(f"  again (the shapes within {REMEASURE_NEAR:.0%} of the best predicted loss): {', '.join(again)}")
    # its own time: a stall is what used the first pass's (each contender at most its share again)
    until = max(until, time.perf_counter()) + PROBE_SHAPE_S * len(again)
    out = list(points)
    for i, q in enumerate(points):
        if q.shape.name not in again:
            continue
        if time.perf_counter() + 2 * q.micro * q.seq_len / q.tokens_per_s > until:
            break
        seconds, forward, _ = _step_seconds(q.shape, q.vocab, q.micro, q.seq_len, torch.device("cpu"),
                                            precision, until, keep)
        tps = q.micro * q.seq_len / seconds
        if tps > q.tokens_per_s:
            out[i] = replace(q, tokens_per_s=tps, eval_batch_s=min(forward, q.eval_batch_s or forward))
        say(f"  {q.shape.name}: {tps:,.0f} tok/s (kept {out[i].tokens_per_s:,.0f})")
    return out


def probe(budget_s: float, user: dict[str, Any], deadline: Deadline, device_name: str = "auto",
          say: Callable[[str], object] = print, corpus: Corpus | None = None) -> Throughput:
    """Tokens/s of the candidate shapes this budget may choose, measured in at most PROBE_SHARE of it;
    with `corpus`, it stops before shapes the planner's loss rule says cannot win (planner.could_win)."""
    import torch

    from lmforge.engine.precision import resolve_precision
    from lmforge.models.flops import flops_per_token
    from lmforge.parallel.world import World, resolve_device
    from lmforge.utils.host_memory import keep_freed_memory

    device = resolve_device(device_name, World.from_env())
    micro, seq = batch_shape(device.type, user)
    vocab = vocab_for(budget_s, user, corpus.chars if corpus else None)[0]
    asked = user.get("train.precision", "auto")
    precision = resolve_precision(asked, device)  # no model: fp32 on a CPU, bf16 on a GPU that has it
    # smallest first: the cheapest to measure, and what a tiny budget needs (the planner takes shapes below
    # its rule's range only when none in it gets its steps)
    shapes = candidate_shapes(user)
    allot = min(max(PROBE_MIN_S, PROBE_SHARE * budget_s), PROBE_MAX_S)
    until = time.perf_counter() + allot
    say(f"planning: measuring training speed of up to {len(shapes)} shapes ({micro} x {seq} tokens, "
        f"{precision}) for at most {allot:.1f}s")
    # one tiny step first: the process's first step pays one-time costs (thread pools, allocator, lazy
    # imports) of a second or more that would otherwise be charged to the first shape measured
    keep = bool(user.get("train.keep_host_memory", True))
    _step_seconds(Shape(32, 1, 1, 1), vocab, 1, 16, device, precision, 0.0, keep)
    points, model, last = [], None, 0.0
    for i, shape in enumerate(shapes):
        if points and time.perf_counter() + 3 * last * 1.5 > until:
            break  # the next (larger) shape would not finish its steps in the probe's time
        if points and corpus is not None and not could_win(
                budget_s, Throughput(device.type, tuple(points), precision, spent_s=deadline.elapsed), corpus,
                user, shapes[i:]):
            say(f"  {shape.name} and larger: not measured (the loss rule at the best speed they could reach "
                "predicts none beats the shapes measured)")
            break
        try:
            seconds, forward, model = _step_seconds(shape, vocab, micro, seq, device, precision, until, keep)
        except torch.OutOfMemoryError:
            break
        last = seconds
        mc = model_config(shape, vocab, seq)
        points.append(Measured(shape, micro, seq, vocab, flops_per_token(mc, seq), micro * seq / seconds,
                               forward))
        say(f"  {shape.name}: {points[-1].tokens_per_s:,.0f} tok/s (evaluation forward {forward:.3f}s)")
    if device.type == "cpu" and corpus is not None and len(points) > 1:
        points = _second_pass(points, budget_s, deadline, corpus, user, precision, until, keep, say)
    why = f"{precision} (set)" if asked != "auto" else f"{precision} (auto on {device.type})"
    if asked == "auto" and device.type == "cpu" and model is not None:
        cost = PRECISION_COST * last
        if time.perf_counter() + cost <= until:
            with keep_freed_memory(keep):  # both precisions timed as the run will train
                precision = resolve_precision("auto", device, model, micro, seq, vocab)
            why = f"measured: resolve_precision(auto) at {points[-1].shape.name}"
        else:
            why = f"fp32 (bf16 not measured: ~{cost:.1f}s, more than the probe's time left)"
    del model
    return Throughput(device.type, tuple(points), precision, why, spent_s=round(deadline.elapsed, 2))
