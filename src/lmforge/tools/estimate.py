"""How much memory a training run needs per rank, before it starts (`lmforge estimate`).

The estimate is built from what a step really allocates, not from rules of thumb:

- model states: the parameters of a meta-device build of the model (every tensor's shape), their
  gradients, each optimizer's real state tensors (estimate_parts.optimizer_state_bytes) and, under
  bf16/fp16 autocast, the low-precision weight copies autocast keeps alive from forward to backward;
- activations: the tensors autograd saves for backward, op by op (estimate_parts.block_saved), per
  block, with and without activation checkpointing, by micro-batch and sequence length;
- temporaries: the logits and their gradients (or the chunked loss's chunk), the gradients a block's
  backward creates before it frees what it saved, the optimizer step's own scratch;
- the layout: DDP (its gradient buckets), ZeRO-1 (optimizer state partitioned as torch's
  ZeroRedundancyOptimizer partitions it), FSDP2 ZeRO-2/3 (shards, gathered units, CPU offload),
  tensor parallelism (split heads and MLP, sequence parallelism), expert parallelism (each rank's
  slice of the experts, outside DDP / FSDP), pipeline stages (the schedule's operations walked one
  by one: `pipeline_ops`, `_pipeline_step`).

Mixture-of-experts layers are modelled (estimate_parts.moe_saved); the encoder (model.arch=encoder)
is refused with a message rather than estimated as a decoder.

The peak is the largest of the moments a step passes through (forward end, each backward point,
the optimizer step). `verdict` compares it with the device and `suggest` re-runs the estimate for
candidate settings until one fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lmforge.config.schema import Config
from lmforge.errors import ConfigError
from lmforge.tools.estimate_parts import (
    ModelTensors,
    activation_profile,
    model_tensors,
    optimizer_state_bytes,
    optimizer_step_scratch,
)

MiB = 1024**2
GiB = 1024**3
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    """The per-rank layout of a run: what `ParallelDims.resolve` would make of `parallel.*`."""

    world_size: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 3
    cpu_offload: bool = False
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        if self.dp_shard > 1:
            return self.zero >= 2
        return self.dp_replicate > 1 and (self.tp > 1 or self.pp > 1)

    @property
    def ddp(self) -> bool:
        return self.dp > 1 and not self.fsdp

    @property
    def zero1(self) -> bool:
        return self.dp_shard > 1 and self.zero == 1

    @property
    def name(self) -> str:
        parts = []
        if self.fsdp:
            parts.append(f"FSDP zero{self.zero} x{self.dp_shard}" + (f" (HSDP x{self.dp_replicate})"
                                                                      if self.dp_replicate > 1 else ""))
        elif self.zero1:
            parts.append(f"DDP+ZeRO-1 x{self.dp}")
        elif self.ddp:
            parts.append(f"DDP x{self.dp}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        if self.ep > 1:
            parts.append(f"EP {self.ep}")
        if self.cpu_offload:
            parts.append("CPU offload")
        return " + ".join(parts) or "single process"


def resolve_layout(cfg: Config, world_size: int) -> Layout:
    """The layout `cfg.parallel` gives on `world_size` processes (the same checks as a real start)."""
    from lmforge.parallel.dims import ParallelDims

    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    dims = ParallelDims.resolve(cfg.parallel, world_size, cfg.model, cfg.train.grad_accum_steps)
    pc = cfg.parallel
    return Layout(world_size, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, pc.zero, pc.cpu_offload,
                  pc.ep)


@dataclass
class Estimate:
    """Bytes per rank: `rows` (component -> bytes held on the device), `host` (bytes a CPU-offload
    layout keeps in host RAM), `peak` (device bytes at the step's fullest moment) and `moments` (the
    device bytes at each moment of the step, the peak being their maximum)."""

    cfg: Config
    layout: Layout
    device_type: str
    rows: dict[str, int]
    host: dict[str, int]
    moments: dict[str, int]
    params: int  # parameter elements of the whole model
    rank: str = "rank 0"
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.moments.values())

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.moments.get)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def to_json(self) -> dict:
        tc = self.cfg.train
        return {
            "layout": self.layout.name, "world_size": self.layout.world_size, "rank": self.rank,
            "device": self.device_type, "params": self.params,
            "micro_batch_size": tc.micro_batch_size, "grad_accum_steps": tc.grad_accum_steps,
            "seq_len": self.cfg.seq_len, "precision": self.precision,
            "activation_checkpointing": tc.activation_checkpointing,
            "rows": self.rows, "host": self.host, "moments": self.moments,
            "peak_bytes": self.peak, "peak_moment": self.peak_moment, "notes": self.notes,
        }

    @property
    def precision(self) -> str:
        p = self.cfg.train.precision
        if p == "auto":  # what resolve_precision picks without measuring: bf16 on a GPU, fp32 elsewhere
            return "bf16" if self.device_type == "cuda" else "fp32"
        return p


def _shard(numel_dim0: int, rest: int, n: int) -> int:
    """Elements of one FSDP2 shard: dim 0 split in ceil(dim0 / n) rows (the last rank's is padded)."""
    return math.ceil(numel_dim0 / n) * rest


def _zero1_owned(sizes: list[int], n: int) -> list[int]:
    """Elements each rank owns under torch's ZeroRedundancyOptimizer: per param group, parameters
    sorted largest first, each given to the rank holding the fewest elements so far."""
    totals = [0] * n
    for numel in sorted(sizes, reverse=True):
        r = min(range(n), key=lambda i: totals[i])
        totals[r] += numel
    return totals


def estimate(cfg: Config, world_size: int = 1, device_type: str = "cpu", rank: int | None = None) -> Estimate:
    """The memory estimate of `cfg` on `world_size` processes for the busiest rank (or `rank`)."""
    if cfg.model.arch == "encoder":
        # Post-norm blocks, token-type embeddings and the MLM head on the masked rows only save other
        # tensors than the decoder's; an estimate from the decoder's would be wrong, so there is none.
        raise ConfigError("lmforge estimate models decoder training only; model.arch=encoder (masked LM) is "
                          "not modelled yet: measure a short run instead (lmforge train with a few steps)")
    layout = resolve_layout(cfg, world_size)
    tensors = model_tensors(cfg.model)
    ranks = [rank] if rank is not None else _candidate_ranks(layout)
    best = None
    for r in ranks:
        est = _estimate_rank(cfg, layout, device_type, tensors, r)
        if best is None or est.peak > best.peak:
            best = est
    return best


def _candidate_ranks(layout: Layout) -> list[int]:
    # Pipeline stages and ZeRO-1 owners differ between ranks; elsewhere all ranks are alike.
    if layout.pp > 1:
        per_stage = layout.world_size // layout.pp
        return [s * per_stage for s in range(layout.pp)]
    if layout.zero1:
        return list(range(layout.dp))
    return [0]


def _estimate_rank(cfg: Config, layout: Layout, device_type: str, mt: ModelTensors, rank: int) -> Estimate:
    tc, pc = cfg.train, cfg.parallel
    precision = tc.precision if tc.precision != "auto" else ("bf16" if device_type == "cuda" else "fp32")
    low = precision in ("bf16", "fp16")
    # -- which tensors this rank holds (pipeline stage, tensor-parallel split) -------------------
    pp_rank = 0
    stage_layers = list(range(cfg.model.n_layers))
    first = last = True
    if layout.pp > 1:
        per_stage = layout.world_size // layout.pp
        pp_rank = rank // per_stage
        v = pc.pp_stages_per_rank
        n_stages = layout.pp * v
        per = cfg.model.n_layers // n_stages
        stages = [pp_rank + k * layout.pp for k in range(v)]
        stage_layers = [i for s in stages for i in range(s * per, (s + 1) * per)]
        first, last = 0 in stages, n_stages - 1 in stages
    held = mt.held(stage_layers, first, last, layout.tp, layout.ep)
    trainable = [t for t in held if t.trainable]

    rows: dict[str, int] = {}
    host: dict[str, int] = {}
    notes: list[str] = []
    dp = layout.dp
    fsdp_n = layout.dp_shard if layout.fsdp else 1
    # -- parameters -------------------------------------------------------------------------------
    def shard_of(t) -> int:  # FSDP leaves expert-parallel experts whole on their rank
        n = 1 if (t.expert and layout.ep > 1) else fsdp_n
        return _shard(t.local_dim0, t.local // max(t.local_dim0, 1), n)

    sharded_params = sum(shard_of(t) for t in held) * 4
    unit_bytes = _fsdp_unit_bytes(cfg, layout, held, precision)
    if layout.fsdp and layout.cpu_offload:
        host["parameters (sharded, fp32)"] = sharded_params
        rows["parameters (sharded, fp32)"] = 0
    else:
        rows["parameters" + (" (sharded, fp32)" if layout.fsdp else " (fp32)")] = sharded_params
    # -- gradients -------------------------------------------------------------------------------
    grad_bytes = sum(shard_of(t) for t in trainable) * 4
    grads_key = "gradients" + (" (sharded, fp32)" if layout.fsdp else " (fp32)")
    if layout.fsdp and layout.cpu_offload:
        host[grads_key] = grad_bytes
        grad_dev = 0
    else:
        grad_dev = grad_bytes
    rows[grads_key] = grad_dev
    if layout.ddp:
        # DDP keeps a flat bucket copy of every gradient (gradient_as_bucket_view=False).
        # (expert-parallel experts are ignored modules: no bucket)
        rows["DDP gradient buckets"] = sum(t.local for t in trainable if not (t.expert and layout.ep > 1)) * 4
    # -- optimizer state --------------------------------------------------------------------------
    opt_tensors = trainable
    if layout.fsdp:
        opt_tensors = [t if (t.expert and layout.ep > 1) else t.sharded(fsdp_n) for t in trainable]
    if layout.zero1:
        owned = _zero1_owned([t.local for t in trainable], dp)[rank % dp]
        share = owned / max(sum(t.local for t in trainable), 1)
        state = optimizer_state_bytes(opt_tensors, cfg.optim, device_type)
        opt_bytes = int(state * share)
        notes.append(f"ZeRO-1: this rank owns {share:.1%} of the parameters' optimizer state")
    else:
        opt_bytes = optimizer_state_bytes(opt_tensors, cfg.optim, device_type)
    if layout.fsdp and layout.cpu_offload:
        host["optimizer state"] = opt_bytes
        rows["optimizer state"] = 0
    else:
        rows["optimizer state"] = opt_bytes
    # -- low-precision copies / FSDP unsharded parameters ------------------------------------------
    copies = 0
    if low and not (layout.fsdp and _fsdp_param_dtype(cfg, precision) != "fp32"):
        # autocast casts each matmul weight once per forward and backward keeps the copy.
        copies = sum(t.local for t in held if t.matmul) * 2
        rows["bf16/fp16 weight copies (autocast)"] = copies
    # -- activations ------------------------------------------------------------------------------
    rows["temporaries (largest)"] = 0  # filled from the moments below
    base = sum(v for k, v in rows.items() if k.startswith(("parameters", "optimizer", "DDP")))
    opt_scratch = optimizer_step_scratch(opt_tensors, cfg.optim, device_type)
    if layout.pp > 1:
        live_base = base + copies + (unit_bytes["backward_live"] if layout.fsdp else 0)
        moments = _pipeline_step(cfg, layout, device_type, precision, pp_rank, grad_dev, live_base, rows,
                                 notes)
        moments["optimizer step"] = base + grad_dev + opt_scratch
        rows["temporaries (largest)"] = max(rows["temporaries (largest)"], opt_scratch)
        n_params = sum(t.numel for t in mt.tensors)
        return Estimate(cfg, layout, device_type, rows, host, moments, n_params, f"rank {rank}", notes)
    prof = activation_profile(cfg, tc.micro_batch_size, cfg.seq_len, precision, device_type, stage_layers,
                              first, last, layout.tp, pc.sequence_parallel, ep=layout.ep)
    rows["activations (saved for backward)"] = prof.saved
    # -- the moments of a step -------------------------------------------------------------------
    accum_grads = grad_dev if tc.grad_accum_steps > 1 else 0
    gathered = 0
    if layout.fsdp:
        gathered = unit_bytes["forward_live"]
        rows["FSDP gathered parameters (peak)"] = unit_bytes["backward_live"]
    moments: dict[str, int] = {}
    moments["forward end (logits)"] = base + copies + gathered + prof.saved + prof.forward_extra + accum_grads
    for name, live_saved, grads_so_far, extra in prof.backward_points:
        g = accum_grads if accum_grads else grads_so_far * grad_dev // max(prof.grad_total, 1)
        bw_gathered = unit_bytes["backward_live"] if layout.fsdp else 0
        moments[f"backward: {name}"] = base + copies + bw_gathered + live_saved + g + extra
    moments["optimizer step"] = base + grad_dev + opt_scratch
    rows["temporaries (largest)"] = max(prof.forward_extra, *(p[3] for p in prof.backward_points),
                                        opt_scratch)
    n_params = sum(t.numel for t in mt.tensors)
    est = Estimate(cfg, layout, device_type, rows, host, moments, n_params, f"rank {rank}", notes)
    return est


def _fsdp_param_dtype(cfg: Config, precision: str) -> str:
    pd = cfg.parallel.param_dtype
    return ("bf16" if precision == "bf16" else "fp32") if pd == "auto" else pd


def _fsdp_unit_bytes(cfg: Config, layout: Layout, held, precision: str) -> dict[str, int]:
    """Unsharded parameters FSDP2 holds: one unit per block plus the root (embeddings, final norm,
    head). ZeRO-3 gathers a block for its forward and again for its backward (with the next one
    prefetched); ZeRO-2 keeps every gathered block from its forward to its backward. The root
    unit stays gathered from forward to backward either way."""
    if not layout.fsdp:
        return {"forward_live": 0, "backward_live": 0}
    size = _DTYPE_BYTES[_fsdp_param_dtype(cfg, precision)]
    blocks: dict[int, int] = {}
    root = 0
    for t in held:
        if t.expert and layout.ep > 1:
            continue  # expert-parallel experts are FSDP's ignored parameters
        if t.block is None:
            root += t.local
        else:
            blocks[t.block] = blocks.get(t.block, 0) + t.local
    largest = max(blocks.values(), default=0)
    if layout.zero == 2:
        live = sum(blocks.values())
        return {"forward_live": (root + live) * size, "backward_live": (root + live) * size}
    # ZeRO-3: the block being computed, its all-gather output before the copy-out, and in backward
    # the prefetched next block.
    return {"forward_live": (root + 2 * largest) * size, "backward_live": (root + 2 * largest) * size}


def pipeline_ops(schedule: str, pp: int, v: int, m: int, pp_rank: int) -> list[tuple[str, int, int]]:
    """The (F or B, micro-batch, local stage) operations `pp_rank` runs in one step, in the order of
    torch.distributed.pipelining's schedules: GPipe all forwards then all backwards; 1F1B pp - rank
    warm-up forwards, then a backward and a forward in turn; interleaved 1F1B its warm-up of
    (v - 1) * mb_per_round + 2 (pp - 1 - rank) forwards, then forward + backward pairs, each local
    stage in rounds of mb_per_round micro-batches (ScheduleInterleaved1F1B's operation list)."""
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        warm = min(m, pp - pp_rank)
        ops = [("F", i, 0) for i in range(warm)]
        f = warm
        for b in range(m):
            ops.append(("B", b, 0))
            if f < m:
                ops.append(("F", f, 0))
                f += 1
        return ops
    per_round = m // max(1, m // pp)
    total = m * v
    warm = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    next_f, next_b = [0] * v, [0] * v
    ops = []
    for op in range(total + warm):
        if op < total:
            s = (op // per_round) % v
            ops.append(("F", next_f[s], s))
            next_f[s] += 1
        if op >= warm:
            s = v - 1 - ((op - warm) // per_round) % v
            ops.append(("B", next_b[s], s))
            next_b[s] += 1
    return ops


def _pipeline_step(cfg: Config, layout: Layout, device_type: str, precision: str, pp_rank: int,
                   grad_dev: int, base: int, rows: dict[str, int], notes: list[str]) -> dict[str, int]:
    """The moments of one pipelined step on `pp_rank`, walked through its schedule's operations.

    What a stage holds (torch.distributed.pipelining's PipelineStage, measured): for every micro-batch
    between its forward and its backward, the tensors autograd saved plus, on the last stage, the
    stage output (the logits) in `fwd_cache` until that micro-batch's backward has run; a receive
    buffer per micro-batch for the activations (non-first stages) and one for the output gradients
    (non-last stages), allocated at the first step and kept; once a stage's first backward has run,
    all its gradients (they accumulate over the micro-batches). GPipe and 1F1B also keep the latest
    forward's output referenced from the schedule loop until the next forward returns."""
    tc, pc, m_cfg = cfg.train, cfg.parallel, cfg.model
    c = _DTYPE_BYTES["bf16" if precision in ("bf16", "fp16") else "fp32"]
    v = pc.pp_stages_per_rank
    n_stages = layout.pp * v
    per = m_cfg.n_layers // n_stages
    m = pc.pp_microbatches or tc.grad_accum_steps
    rows_per_mb = max(1, tc.micro_batch_size * tc.grad_accum_steps // m)
    N = rows_per_mb * cfg.seq_len
    ids = [pp_rank + k * layout.pp for k in range(v)]
    profs, held, fwd_tr, logits, lasts = [], [], [], [], []
    boundary = 0
    for sid in ids:
        first, last = sid == 0, sid == n_stages - 1
        prof = activation_profile(cfg, rows_per_mb, cfg.seq_len, precision, device_type,
                                  list(range(sid * per, (sid + 1) * per)), first, last, layout.tp,
                                  pc.sequence_parallel)
        out = N * m_cfg.vocab_size * c if last else 0
        profs.append(prof)
        held.append(prof.saved + out)
        fwd_tr.append(max(prof.forward_extra - out, 0))
        logits.append(out)
        lasts.append(last)
        boundary += ((not first) + (not last)) * m * N * m_cfg.d_model * 4
    grad_total = max(sum(p.grad_total for p in profs), 1)
    stage_grads = [p.grad_total * grad_dev // grad_total for p in profs]
    base += boundary
    if boundary:
        rows["pipeline send/recv buffers"] = boundary
    inflight: dict[tuple[int, int], int] = {}
    done = [False] * v
    prev_f: list[int | None] = [None] * v
    loop_holds = pc.pp_schedule in ("gpipe", "1f1b")
    moments: dict[str, int] = {}
    most = 0
    temp = 0
    for kind, mb, s in pipeline_ops(pc.pp_schedule, layout.pp, v, m, pp_rank):
        grads = sum(g for g, d in zip(stage_grads, done) if d)
        if kind == "F":
            stale = prev_f[s] is not None and (prev_f[s], s) not in inflight
            inflight[(mb, s)] = held[s]
            live = sum(inflight.values())
            most = max(most, live)
            moments[f"forward mb {mb} stage {ids[s]}"] = (base + grads + live + fwd_tr[s]
                                                          + (logits[s] if loop_holds and stale else 0))
            temp = max(temp, fwd_tr[s])
            prev_f[s] = mb
            continue
        inflight.pop((mb, s))
        others = sum(inflight.values())
        worst = 0
        for _, live, so_far, extra in profs[s].backward_points:
            mine = stage_grads[s] if done[s] else so_far * stage_grads[s] // max(profs[s].grad_total, 1)
            g = grads + mine
            worst = max(worst, base + g + others + live + logits[s] + extra)
            temp = max(temp, extra)
        moments[f"backward mb {mb} stage {ids[s]}"] = worst
        done[s] = True
    if m_cfg.tie_embeddings and 0 in ids and n_stages - 1 not in ids:
        # the last stage's gradient of the tied table arrives whole before it is added to the owner's
        table = m_cfg.vocab_size * m_cfg.d_model * 4
        moments["tied embedding gradient received"] = base + grad_dev + table
    rows["activations (saved for backward)"] = most
    rows["temporaries (largest)"] = temp
    notes.append(f"pipeline {pc.pp_schedule}: {m} micro-batches of {rows_per_mb} rows; at most "
                 f"{max(1, round(most / max(held)))} in flight on this rank")
    return moments


# -- verdict and suggestion ------------------------------------------------------------------------


def device_memory(device: str | None, device_memory_gib: float | None) -> tuple[str, int, str]:
    """(device type, bytes available, how they were found): --device-memory wins; a CUDA device's
    total memory; on the CPU the available RAM (psutil)."""
    if device_memory_gib is not None:
        if not device_memory_gib > 0:
            raise ConfigError(f"--device-memory must be a positive number of GiB, got {device_memory_gib}")
        kind = (device or "cpu").split(":")[0]
        return kind, int(device_memory_gib * GiB), f"--device-memory {device_memory_gib:g} GiB"
    device = device or "cpu"
    kind = device.split(":")[0]
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA device here; pass --device-memory GiB to judge "
                              "against a GPU's size")
        index = int(device.split(":")[1]) if ":" in device else 0
        props = torch.cuda.get_device_properties(index)
        return "cuda", int(props.total_memory), f"{props.name} total memory"
    if kind != "cpu":
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    import psutil

    return "cpu", int(psutil.virtual_memory().available), "available RAM"


@dataclass
class Suggestion:
    change: dict[str, object]  # config key -> value
    peak: int
    why: str


def suggest(cfg: Config, world_size: int, device_type: str, budget: int) -> list[Suggestion]:
    """Settings that fit `budget` bytes per rank, each found by re-running the estimate: a smaller
    micro-batch with more accumulation (same tokens per step), activation checkpointing, a higher
    ZeRO stage, CPU offload, and combinations; the fitting ones, least invasive first."""
    tc, pc = cfg.train, cfg.parallel
    candidates: list[tuple[dict, str]] = []
    mb, accum = tc.micro_batch_size, tc.grad_accum_steps
    m = mb
    while m > 1:
        m //= 2
        if mb % m == 0:
            candidates.append(({"train.micro_batch_size": m, "train.grad_accum_steps": accum * mb // m},
                               "same tokens per step"))
    # least recomputation first: selective redoes only elementwise ops; nothing saves more than full
    for ac, why in (("selective", "recompute the cheap ops in backward"),
                    ("every_k", "recompute activations in backward"),
                    ("full", "recompute activations in backward")):
        if tc.activation_checkpointing in (ac, "full"):
            continue
        candidates.append(({"train.activation_checkpointing": ac}, why))
    if cfg.model.vocab_size and tc.loss_chunk_tokens == 0:
        candidates.append(({"train.loss_chunk_tokens": 4096}, "never hold all the logits"))
    if world_size > 1 and pc.tp == 1 and pc.pp == 1:
        for zero in (1, 2, 3):
            if zero > pc.zero or pc.dp_shard == 1 or pc.dp_replicate > 1:
                what = "optimizer state" if zero == 1 else "model states"
                candidates.append(({"parallel.dp_replicate": 1, "parallel.dp_shard": -1,
                                    "parallel.zero": zero}, f"ZeRO-{zero}: shard {what}"))
        candidates.append(({"parallel.dp_replicate": 1, "parallel.dp_shard": -1, "parallel.zero": 3,
                            "parallel.cpu_offload": True}, "FSDP, params, grads and optimizer on the CPU"))
    out: list[Suggestion] = []
    tried: list[dict] = []
    for change, why in candidates:
        extras = [{}, {"train.activation_checkpointing": "full"}]
        if "train.activation_checkpointing" in change:
            extras = [{}]
        for extra in extras:
            full = {**change, **extra}
            if full in tried:
                continue
            tried.append(full)
            try:
                est = estimate(apply_changes(cfg, full), world_size, device_type)
            except ConfigError:
                continue
            if est.peak <= budget:
                out.append(Suggestion(full, est.peak, why + (" + activation checkpointing" if extra else "")))
                break
    return sorted(out, key=lambda s: (len(s.change), -s.peak))[:4]


def apply_changes(cfg: Config, change: dict[str, object]) -> Config:
    """`cfg` with dotted keys replaced, validated like --set."""
    data = cfg.model_dump()
    for key, value in change.items():
        section, name = key.split(".")
        data[section][name] = value
    return Config.model_validate(data)


__all__ = ["Estimate", "Layout", "Suggestion", "apply_changes", "device_memory", "estimate", "resolve_layout",
           "suggest", "MiB", "GiB"]
