"""Mixed precision: which dtype to autocast to, and the loss scaler fp16 needs.

`auto` on a CPU: without bf16 matrix units (AVX512-BF16, AMX-BF16, Arm BF16) a bf16 matmul is many times
slower than fp32 (shared cpu-facts), so such a CPU gets fp32 at once, with no timing. With them the
matmuls are faster but a whole bf16 training step can still be slower, so a real step of the model is
timed both ways, within a deadline of a few seconds, and the verdict is cached per machine and shape
(utils/machine.py), so that only a machine's first run of a shape pays for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmforge.engine.comm import LOCAL, Comm
from lmforge.engine.loss import logits_of
from lmforge.utils.machine import CpuFacts, ProbeCache, cpu_facts

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEADLINE_S = 5.0  # the most a CPU's bf16 probe may take; a budgeted run gets a few % of its budget
BUDGET_FRACTION = 0.03
SPEEDUP_NEEDED = 1.1  # a smaller bf16 gain is within timing noise: stay in fp32, the exact one
# Before timing at r rows: a bf16 warm-up, one fp32 and one bf16 step, each bf16 step assumed up to
# 1.5x the fp32 one (a machine without known bf16 units may be slower still: each step is checked).
_STEPS_PER_ROW_COST = 4.0

StepTimer = Callable[[str, int], float]  # (precision, rows) -> seconds of one step


def _step_timer(model: torch.nn.Module, seq_len: int, vocab_size: int, device: torch.device,
                backward: bool) -> StepTimer:
    """Times one forward(+backward) of `model` in fp32 or under bf16 autocast at `rows` x `seq_len`."""
    gen = torch.Generator().manual_seed(0)

    def time_step(name: str, rows: int) -> float:
        x = torch.randint(0, vocab_size, (rows, seq_len), generator=gen).to(device)
        ctx = contextlib.nullcontext() if name == "fp32" else torch.autocast(device.type, torch.bfloat16)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward), ctx:
            out = logits_of(model(x)).float().mean()
        if backward:
            out.backward()
        return time.perf_counter() - t0

    return time_step


def bf16_step_speedup(model: torch.nn.Module, batch_size: int, seq_len: int, vocab_size: int,
                      device: torch.device, backward: bool = True, repeats: int = 1) -> float:
    """fp32 time / bf16-autocast time of one forward(+backward) of `model` on a real-sized micro-batch.

    The whole step at the run's own shape is timed, not a matmul: on CPUs with fast bf16 matmuls (AMX)
    the casts and non-matmul ops under autocast make small shapes slower in bf16 and large ones faster
    (measured on a Xeon with AMX: the debug model's 8 x 64 batch 0.58x, the demo model at 1 x 256
    1.1-1.2x, at its real 16 x 256 micro-batch 1.5x).
    Global RNG state is left untouched, so measuring never changes a run's random stream.
    """
    best = {"fp32": float("inf"), "bf16": float("inf")}
    with torch.random.fork_rng(devices=[]):
        time_step = _step_timer(model, seq_len, vocab_size, device, backward)
        for name in ("fp32", "bf16") * (repeats + 1):  # the first pair warms up kernels
            best[name] = min(best[name], time_step(name, batch_size))
    model.zero_grad(set_to_none=True)
    return best["fp32"] / best["bf16"]


@dataclass
class Bf16Timing:
    """What a bounded probe measured: the best fp32 and bf16 step at `rows` rows (inf: not timed)."""

    rows: int
    fp32_s: float
    bf16_s: float
    spent_s: float

    @property
    def complete(self) -> bool:
        return self.fp32_s < float("inf") and self.bf16_s < float("inf")


def time_bf16_bounded(time_step: StepTimer, batch_size: int, deadline_s: float,
                      say: Callable[[str], object] = lambda _: None, seq_len: int = 0) -> Bf16Timing:
    """Time bf16 against fp32 steps within about `deadline_s` seconds of step time.

    An fp32 step of a single row warms fp32's kernels and a second prices a row; the rows timed are as many
    of the micro-batch as a bf16 warm-up and an fp32/bf16 pair fit in what is left (fewer rows than the
    run's favour fp32, since small shapes gain least from bf16: a conservative error). Pairs repeat while
    time is left; before each step its cost is predicted and a step that would overrun is not started.
    """
    spent = time_step("fp32", 1)
    per_row = spent
    if spent < deadline_s / 4:  # the first call pays one-off costs (allocation, kernel choice): price again
        per_row = time_step("fp32", 1)
        spent += per_row
    per_row = max(per_row, 1e-9)
    rows = max(1, min(batch_size, int((deadline_s - spent) / (_STEPS_PER_ROW_COST * per_row))))
    if rows < batch_size:
        say(f"precision auto: a step of {batch_size} rows would overrun the {deadline_s:.1f} s deadline; "
            f"timing {rows}x{seq_len} instead (fewer rows favour fp32)")
    best = {"fp32": float("inf"), "bf16": float("inf")}
    last = {"fp32": per_row * rows, "bf16": 1.5 * per_row * rows}
    for name in ("bf16-warm",) + ("fp32", "bf16") * 3:
        kind = name.split("-")[0]
        if spent + last[kind] > deadline_s:
            break
        t = time_step(kind, rows)
        spent += t
        last[kind] = t
        if name != "bf16-warm":
            best[kind] = min(best[kind], t)
    return Bf16Timing(rows, best["fp32"], best["bf16"], spent)


def model_signature(model: torch.nn.Module) -> str:
    """A short hash of the model's class, parameter names, shapes, dtypes and trainability."""
    parts = [type(model).__name__] + [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
                                      for n, p in model.named_parameters()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def set_tf32(enabled: bool | None, device: torch.device) -> Callable[[], None]:
    """Apply train.tf32 for this process's CUDA matmuls and cuDNN convolutions; returns what puts torch's
    previous settings back (the Python API's caller keeps its own). Uses torch's fp32_precision API only:
    mixing it with the legacy allow_tf32 flags makes torch raise."""
    if enabled is None:
        return lambda: None
    if enabled and device.type != "cuda":
        from lmforge.errors import ConfigError

        raise ConfigError(f"train.tf32=true: TensorFloat-32 is a CUDA matmul mode, and this run's device is "
                          f"{device.type}; remove train.tf32 (fp32 on {device.type} is always IEEE fp32)")
    if device.type != "cuda":
        return lambda: None  # false: nothing here computes in TF32
    targets = [torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn]
    before = [t.fp32_precision for t in targets]
    for t in targets:
        t.fp32_precision = "tf32" if enabled else "ieee"

    def restore() -> None:
        for t, value in zip(targets, before):
            t.fp32_precision = value

    return restore


def probe_deadline(max_time: float | None) -> float:
    """Seconds the bf16 probe may take: DEADLINE_S, or BUDGET_FRACTION of a run's time budget if smaller."""
    return DEADLINE_S if not max_time else min(DEADLINE_S, BUDGET_FRACTION * max_time)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve_precision(name: str, device: torch.device, model: torch.nn.Module | None = None,
                      batch_size: int = 1, seq_len: int = 128, vocab_size: int = 256,
                      backward: bool = True, *, say: Callable[[str], object] = _stderr,
                      deadline_s: float = DEADLINE_S, facts: CpuFacts | None = None,
                      cache: ProbeCache | None = None, time_step: StepTimer | None = None) -> str:
    """'auto' -> bf16 on a GPU that supports it; on a CPU, fp32 where it has no bf16 matrix units, else
    bf16 only where a step of this model measures clearly faster in bf16 than in fp32 (fp32 when there
    is no model to measure). A CPU decision is said in one line through `say`; a measurement is
    announced before it starts, bounded by `deadline_s` and cached (`facts`, `cache` and `time_step`
    replace the machine's facts, the cache file and the real step, for tests)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if model is None:
        return "fp32"
    facts = facts or cpu_facts()
    if facts.bf16_units is False:
        say(f"precision auto: fp32 (this CPU has no bf16 matrix units: {facts.capability})")
        return "fp32"
    cache = cache or ProbeCache()
    shape = f"{batch_size}x{seq_len}"
    key = ProbeCache.key("precision", **facts.key(), threads=torch.get_num_threads(),
                         model=model_signature(model), batch=batch_size, seq_len=seq_len, backward=backward,
                         device=device.type)
    hit = cache.get(key)
    if hit is not None and hit.get("verdict") in ("fp32", "bf16"):
        say(f"precision auto: {hit['verdict']} (measured before on this machine at {shape}: "
            f"{_times(hit.get('bf16_s'), hit.get('fp32_s'))}; cached in {cache.path})")
        return hit["verdict"]
    units = "bf16 matrix units" if facts.bf16_units else "no sign of bf16 matrix units either way"
    say(f"precision auto: timing a bf16 and an fp32 {'training' if backward else 'forward'} step at "
        f"{shape} on this CPU ({units}), at most {deadline_s:.1f} s ...")
    with torch.random.fork_rng(devices=[]):
        step = time_step or _step_timer(model, seq_len, vocab_size, device, backward)
        timing = time_bf16_bounded(step, batch_size, deadline_s, say, seq_len)
    model.zero_grad(set_to_none=True)
    if not timing.complete:
        say(f"precision auto: fp32 (one bf16 and one fp32 step at {timing.rows}x{seq_len} do not fit in "
            f"{deadline_s:.1f} s)")
        return "fp32"
    verdict = "bf16" if timing.fp32_s / timing.bf16_s > SPEEDUP_NEEDED else "fp32"
    stored = cache.put(key, {"verdict": verdict, "rows": timing.rows, "fp32_s": timing.fp32_s,
                             "bf16_s": timing.bf16_s})
    times = _times(timing.bf16_s, timing.fp32_s)
    where = f"cached in {cache.path}" if stored else "not cached"
    say(f"precision auto: {verdict} (a step at {timing.rows}x{seq_len}: {times}; probe "
        f"{timing.spent_s:.1f} s; {where})")
    return verdict


def _times(bf16_s, fp32_s) -> str:
    try:
        return f"bf16 {bf16_s:.3f} s, fp32 {fp32_s:.3f} s, {fp32_s / bf16_s:.2f}x"
    except (TypeError, ValueError, ZeroDivisionError):
        return "times not recorded"


class LossScaler(torch.amp.GradScaler):
    """torch's dynamic loss scaler, whose overflow verdict is the whole job's.

    Each rank checks only the gradients it holds (an FSDP shard, a tensor-parallel slice, or, under DDP,
    a replica a rank-local fault can still spoil after the all-reduce), so left alone one rank would skip a
    step and lower its scale while another applied it: replicas drift apart for good. `unscale_` therefore
    replaces the found-inf flags with their maximum over all ranks (`Comm.any_overflow`); `step` and
    `update` then make the same decision everywhere. With one process it is torch's GradScaler exactly.
    """

    def unscale_(self, optimizer: torch.optim.Optimizer, comm: Comm = LOCAL) -> None:
        super().unscale_(optimizer)
        if comm is LOCAL:
            return
        # torch keeps the flags per device in this (private, stable since torch 1.6) per-optimizer state;
        # its step() and update() read them from there, so agreeing here is enough.
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        device = self._scale.device if self._scale is not None else torch.device(self._device)
        local = (torch.stack([f.to(device) for f in found.values()]).sum() if found
                 else torch.zeros((), device=device))
        agreed = comm.any_overflow(local)  # every rank calls it, even one without gradients
        for dev in found or [device]:
            found[dev] = agreed.to(dev)

    def overflowed(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the step being unscaled found a non-finite gradient (on any rank, after `unscale_`)."""
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return any(float(f) > 0 for f in found.values())


@dataclass
class Precision:
    """Autocast context and gradient scaler for one resolved precision."""

    name: str
    device: torch.device
    offload_activations: bool = False  # train.activation_offload (engine/act_offload.py)

    def __post_init__(self) -> None:
        self.dtype = _DTYPES[self.name]
        # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range and needs none.
        self.scaler = LossScaler(self.device.type) if self.name == "fp16" else None

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def training_forward(self):
        """Autocast, and with train.activation_offload the saved tensors to host memory."""
        from lmforge.engine.act_offload import offloading

        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast())
        stack.enter_context(offloading(self.offload_activations, self.device))
        return stack

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, sd: dict) -> None:
        if self.scaler is not None and sd.get("scaler"):
            self.scaler.load_state_dict(sd["scaler"])
