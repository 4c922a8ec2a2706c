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
is refused with a message rather than estimated as a decoder. The training method (objective and
finetune sections: SFT, LoRA / QLoRA, DPO and its reference model, reward models) changes what trains,
what is stored and what a micro-batch holds (estimate_methods, estimate_adapters); what is not modelled
is refused by name. Sizes and counts are bounded before any work (`check_bounds`): the estimate is
arithmetic on shapes, never a model build.

The peak is the largest of the moments a step passes through (forward end, each backward point,
the optimizer step). `verdict` compares it with the device and `suggest` re-runs the estimate for
candidate settings until one fits.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from lmforge.config.methods import DEFAULT_METHOD
from lmforge.config.schema import Config
from lmforge.errors import ConfigError
from lmforge.tools.estimate_methods import (
    Method,
    dense_packed_mask,
    method_moments,
    method_of,
    method_tensors,
    trainable_elements,
    weight_copies,
)
from lmforge.tools.estimate_parts import (
    DTYPE_BYTES,
    ModelTensors,
    activation_profile,
    model_tensors,
    optimizer_state_bytes,
    optimizer_step_scratch,
)
from lmforge.tools.estimate_pipeline import pipeline_ops, pipeline_step

MiB = 1024**2
GiB = 1024**3


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
    method: str = DEFAULT_METHOD  # the training method estimated (estimate_methods.Method.label)

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
            "method": self.method,
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
    sorted largest first, each given to the rank holding the fewest elements so far (the lowest rank
    among equals)."""
    totals = [0] * n
    heap = [(0, r) for r in range(n)]  # (elements, rank): already a heap
    for numel in sorted(sizes, reverse=True):
        total, r = heapq.heappop(heap)
        totals[r] = total + numel
        heapq.heappush(heap, (totals[r], r))
    return totals


def estimate(cfg: Config, world_size: int = 1, device_type: str = "cpu", rank: int | None = None) -> Estimate:
    """The memory estimate of `cfg` on `world_size` processes for the busiest rank (or `rank`)."""
    if cfg.model.arch != "decoder":
        # Post-norm blocks, token-type embeddings and the MLM head on the masked rows only save other
        # tensors than the decoder's, and T5's two stacks and cross-attention others again; an estimate
        # from the decoder's would be wrong, so there is none.
        kind = {"encoder": "masked LM", "t5": "encoder-decoder"}[cfg.model.arch]
        raise ConfigError(f"lmforge estimate models decoder training only; model.arch={cfg.model.arch} "
                          f"({kind}) is not modelled yet: measure a short run instead (lmforge train with a "
                          "few steps)")
    if cfg.model.mla is not None:
        # Latent attention saves other activations than grouped-query attention (latents, per-head keys
        # expanded from them): the decoder's model of them would be wrong.
        raise ConfigError("lmforge estimate does not model multi-head latent attention (model.mla) yet: "
                          "measure a short run instead (lmforge train with a few steps)")
    check_bounds(cfg, world_size)
    layout = resolve_layout(cfg, world_size)
    method = method_of(cfg, layout)
    tensors = method_tensors(model_tensors(cfg.model), cfg, method)
    ranks = [rank] if rank is not None else _candidate_ranks(layout, tensors)
    best = None
    for r in ranks:
        est = _estimate_rank(cfg, layout, device_type, tensors, r, method)
        if best is None or est.peak > best.peak:
            best = est
    return best


# The counts an estimate walks one by one are bounded before it starts; everything else is arithmetic
# on shapes, whatever their size. The bounds lie far above any real run (the deepest published models
# have about 200 blocks) and keep an estimate and its suggestions within seconds.
MAX_LAYERS = 4096
MAX_WORLD_SIZE = 1 << 20
MAX_PIPELINE_OPS = 1 << 16
MAX_DEVICE_GIB = 1 << 20  # --device-memory: a pebibyte per rank


# Sizes become tensor shapes (a one-block build on the meta device) and byte counts: each is bounded far
# above any real model (the largest vocabularies hold about 2^18 tokens, hidden sizes 2^15) and below what
# torch's int64 shapes and a float's range can hold.
MAX_DIM = 1 << 31
MAX_COUNT = 1 << 40
_DIMS = ("model.vocab_size", "model.d_model", "model.n_heads", "model.n_kv_heads", "model.head_dim",
         "model.d_ff", "model.max_seq_len", "model.sliding_window", "model.moe.n_experts", "model.moe.top_k",
         "model.moe.d_ff_expert", "model.moe.n_shared_experts", "model.moe.shared_d_ff", "train.seq_len",
         "train.loss_chunk_tokens", "finetune.r", "parallel.pp_stages_per_rank")
_COUNTS = ("train.micro_batch_size", "train.grad_accum_steps", "parallel.pp_microbatches")


def check_bounds(cfg: Config, world_size: int) -> None:
    """ConfigError naming the key and its limit for a size or count beyond what the estimate takes: a
    tensor dimension (MAX_DIM), a batch count (MAX_COUNT), or a count it walks one by one."""
    for keys, limit in ((_DIMS, MAX_DIM), (_COUNTS, MAX_COUNT)):
        for key in keys:
            value = cfg
            for part in key.split("."):
                value = getattr(value, part, None) if value is not None else None
            if isinstance(value, int) and value > limit:
                raise ConfigError(f"{key}={value:,} is beyond what lmforge estimate takes (at most "
                                  f"{limit:,})")
    pc = cfg.parallel
    if cfg.model.n_layers > MAX_LAYERS:
        raise ConfigError(f"model.n_layers={cfg.model.n_layers:,}: lmforge estimate walks the blocks one by "
                          f"one and takes at most {MAX_LAYERS:,} (the deepest published models have about "
                          "200)")
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"--world-size {world_size:,}: lmforge estimate takes at most {MAX_WORLD_SIZE:,} "
                          "processes")
    if pc.pp > 1:
        m = pc.pp_microbatches or cfg.train.grad_accum_steps
        key = "parallel.pp_microbatches" if pc.pp_microbatches else "train.grad_accum_steps"
        # every pipeline rank's schedule is walked (the busiest is not known before)
        if pc.pp * m * pc.pp_stages_per_rank > MAX_PIPELINE_OPS:
            raise ConfigError(f"{key}={m:,} micro-batches x parallel.pp_stages_per_rank="
                              f"{pc.pp_stages_per_rank:,} x parallel.pp={pc.pp:,} ranks: lmforge estimate "
                              f"walks each pipeline rank's operations one by one and takes at most "
                              f"{MAX_PIPELINE_OPS:,} (micro-batches x stages per rank x pipeline ranks)")


def _candidate_ranks(layout: Layout, mt: ModelTensors) -> list[int]:
    # Pipeline stages differ between ranks; under ZeRO-1 only the optimizer state each rank owns does,
    # so the busiest is the one owning the most; elsewhere all ranks are alike.
    if layout.pp > 1:
        per_stage = layout.world_size // layout.pp
        return [s * per_stage for s in range(layout.pp)]
    if layout.zero1:
        owned = _zero1_owned([t.local for t in mt.tensors if t.trainable], layout.dp)
        return [max(range(layout.dp), key=owned.__getitem__)]
    return [0]


def _stage(cfg: Config, layout: Layout, rank: int) -> tuple[int, list[int], bool, bool]:
    """(pipeline rank, the layers of its stages, whether it holds the first stage (embeddings), whether it
    holds the last (norm and head)) of `rank`: every layer, first and last without pipeline parallelism."""
    pp_rank = 0
    stage_layers = list(range(cfg.model.n_layers))
    first = last = True
    if layout.pp > 1:
        per_stage = layout.world_size // layout.pp
        pp_rank = rank // per_stage
        v = cfg.parallel.pp_stages_per_rank
        n_stages = layout.pp * v
        per = cfg.model.n_layers // n_stages
        stages = [pp_rank + k * layout.pp for k in range(v)]
        stage_layers = [i for s in stages for i in range(s * per, (s + 1) * per)]
        first, last = 0 in stages, n_stages - 1 in stages
    return pp_rank, stage_layers, first, last


def _weight_rows(layout: Layout, held, trainable, rows: dict[str, int], host: dict[str, int],
                 lowered=frozenset()) -> int:
    """The parameters, gradients and DDP buckets rows of a rank holding `held` (host: what FSDP's CPU
    offload keeps off the device); returns the gradient bytes on the device. `lowered`: names of the
    weights train.master_weights=fp32 stores in bf16 (their gradients and DDP buckets are bf16 too)."""
    fsdp_n = layout.dp_shard if layout.fsdp else 1

    def shard_of(t) -> int:  # FSDP leaves expert-parallel experts whole on their rank
        n = 1 if (t.expert and layout.ep > 1) else fsdp_n
        return _shard(t.local_dim0, t.local // max(t.local_dim0, 1), n)

    def size(t) -> int:  # bytes per element of the weight, its gradient and its DDP bucket
        return 2 if t.name in lowered else 4

    sharded_params = sum(shard_of(t) * size(t) if t.stored is None else t.stored for t in held)
    if layout.fsdp and layout.cpu_offload:
        host["parameters (sharded, fp32)"] = sharded_params
        rows["parameters (sharded, fp32)"] = 0
    else:
        nf4 = any(t.stored for t in held if not t.trainable)
        kind = (" (NF4 block linears, fp32 rest)" if nf4 else " (bf16 matmul weights, fp32 rest)" if lowered
                else " (fp32)")
        rows["parameters" + (" (sharded, fp32)" if layout.fsdp else kind)] = sharded_params
    # -- gradients -------------------------------------------------------------------------------
    grad_bytes = sum(shard_of(t) * size(t) for t in trainable)
    grads_key = "gradients" + (" (sharded, fp32)" if layout.fsdp else " (bf16 matmul weights, fp32 rest)"
                               if lowered else " (fp32)")
    if layout.fsdp and layout.cpu_offload:
        host[grads_key] = grad_bytes
        grad_dev = 0
    else:
        grad_dev = grad_bytes
    rows[grads_key] = grad_dev
    if layout.ddp:
        # DDP keeps a flat bucket copy of every gradient (gradient_as_bucket_view=False).
        # (expert-parallel experts are ignored modules: no bucket)
        rows["DDP gradient buckets"] = sum(t.local * size(t) for t in trainable
                                           if not (t.expert and layout.ep > 1))
    return grad_dev


def _optimizer_rows(cfg: Config, layout: Layout, device_type: str, trainable, rank: int,
                    rows: dict[str, int], host: dict[str, int], notes: list[str]) -> list:
    """The optimizer state row (this rank's ZeRO-1 share, or its FSDP shards); returns the tensors the
    optimizer steps (FSDP: the shards)."""
    fsdp_n = layout.dp_shard if layout.fsdp else 1
    dp = layout.dp
    opt_tensors = trainable
    if layout.fsdp:
        opt_tensors = [t if (t.expert and layout.ep > 1) else t.sharded(fsdp_n) for t in trainable]
    if layout.zero1:
        owned = _zero1_owned([t.local for t in trainable], dp)[rank % dp]  # (rank: the busiest, one pass)
        share = owned / max(sum(t.local for t in trainable), 1)
        state = optimizer_state_bytes(opt_tensors, cfg.optim, device_type)
        opt_bytes = int(state * share)
        notes.append(f"ZeRO-1: this rank owns {share:.1%} of the parameters' optimizer state")
    else:
        opt_bytes = optimizer_state_bytes(opt_tensors, cfg.optim, device_type)
    if layout.fsdp and layout.cpu_offload:
        host["optimizer state"] = opt_bytes
        rows["optimizer state"] = 0
    elif cfg.train.optimizer_offload == "cpu" and not layout.fsdp:
        # optim/offload.py: state, and a host copy of each trained weight and of its gradient
        host["optimizer state"] = opt_bytes
        host["optimizer's host copies (weights + gradients)"] = 2 * 4 * sum(t.local for t in opt_tensors)
        rows["optimizer state"] = 0
        notes.append("train.optimizer_offload=cpu: the optimizer state and the update are in host memory")
    else:
        rows["optimizer state"] = opt_bytes
    return opt_tensors


def _estimate_rank(cfg: Config, layout: Layout, device_type: str, mt: ModelTensors, rank: int,
                   method: Method) -> Estimate:
    tc, pc = cfg.train, cfg.parallel
    precision = tc.precision if tc.precision != "auto" else ("bf16" if device_type == "cuda" else "fp32")
    low = precision in ("bf16", "fp16")
    # -- which tensors this rank holds (pipeline stage, tensor-parallel split) -------------------
    pp_rank, stage_layers, first, last = _stage(cfg, layout, rank)
    held = mt.held(stage_layers, first, last, layout.tp, layout.ep)
    trainable = [t for t in held if t.trainable]

    rows: dict[str, int] = {}
    host: dict[str, int] = {}
    notes: list[str] = []
    # -- parameters, gradients, optimizer state (rows in that order) ------------------------------
    unit_bytes = _fsdp_unit_bytes(cfg, layout, held, precision)
    lowered = _lowered(cfg, layout, trainable)
    grad_dev = _weight_rows(layout, held, trainable, rows, host, lowered)
    opt_tensors = _optimizer_rows(cfg, layout, device_type, trainable, rank, rows, host, notes)
    if lowered:
        # Optimizer state (optim/master.py). At the step each master's gradient is an fp32 copy while its
        # bf16 weight and gradient are freed: 4 bytes out for 4 in, so the step moment needs no term.
        rows["optimizer fp32 master weights"] = sum(t.local for t in trainable if t.name in lowered) * 4
    # -- low-precision copies / FSDP unsharded parameters ------------------------------------------
    copies = 0
    if low and not (layout.fsdp and _fsdp_param_dtype(cfg, precision) != "fp32"):
        # autocast casts each matmul weight once per forward and backward keeps the copy (a weight
        # already stored in bf16 is used as it is).
        copies = sum(t.local for t in held if t.matmul and t.name not in lowered) * 2
        rows["bf16/fp16 weight copies (autocast)"] = copies
    # -- activations ------------------------------------------------------------------------------
    rows["temporaries (largest)"] = 0  # filled from the moments below
    base = sum(v for k, v in rows.items() if k.startswith(("parameters", "optimizer", "DDP")))
    reference = 0
    if method.reference == "copy" and not method.precompute:
        # a frozen fp32 copy of the starting model, beside the trained one for the whole run
        reference = rows["reference model (frozen copy, fp32)"] = sum(t.numel for t in mt.tensors) * 4
    base += reference
    opt_scratch = optimizer_step_scratch(opt_tensors, cfg.optim, device_type)
    if layout.pp > 1:
        live_base = base + copies + (unit_bytes["backward_live"] if layout.fsdp else 0)
        moments = pipeline_step(cfg, layout, device_type, precision, pp_rank, grad_dev, live_base, rows,
                                 notes)
        moments["optimizer step"] = base + grad_dev + opt_scratch
        rows["temporaries (largest)"] = max(rows["temporaries (largest)"], opt_scratch)
        n_params = sum(t.numel for t in mt.tensors)
        return Estimate(cfg, layout, device_type, rows, host, moments, n_params, f"rank {rank}", notes,
                        method.label)
    B = tc.micro_batch_size * method.rows
    prof = activation_profile(cfg, B, cfg.seq_len, precision, device_type, stage_layers, first, last,
                              layout.tp, pc.sequence_parallel, ep=layout.ep, packed=method.packed,
                              dense_mask=method.packed and dense_packed_mask(cfg, device_type),
                              adapters=method.adapters, head=method.head,
                              trainable=trainable_elements(held, stage_layers, method))
    if copies:
        copies = rows["bf16/fp16 weight copies (autocast)"] = weight_copies(
            [t for t in held if t.name not in lowered], prof)
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
    method_moments(cfg, method, held, B, base, rows, moments, notes)
    n_params = sum(t.numel for t in mt.tensors)
    return Estimate(cfg, layout, device_type, rows, host, moments, n_params, f"rank {rank}", notes,
                    method.label)


def _lowered(cfg: Config, layout: Layout, trainable) -> frozenset[str]:
    """Names of the weights train.master_weights=fp32 stores in bf16 (optim/master.py: the trainable
    nn.Linear weights no embedding shares; in lmforge's Transformer, the 2-d tensors that are not
    embedding tables or stacked experts). None under FSDP, where the run refuses the switch."""
    if cfg.train.master_weights != "fp32" or layout.fsdp:
        return frozenset()
    return frozenset(t.name for t in trainable if len(t.shape) == 2 and not t.expert
                     and not t.name.startswith(("tok_embeddings", "pos_embeddings")))


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
    size = DTYPE_BYTES[_fsdp_param_dtype(cfg, precision)]
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


# -- verdict and suggestion ------------------------------------------------------------------------


def device_memory(device: str | None, device_memory_gib: float | None) -> tuple[str, int, str]:
    """(device type, bytes available, how they were found): --device-memory wins; a CUDA device's
    total memory; on the CPU the available RAM (psutil)."""
    if device_memory_gib is not None:
        if not 0 < device_memory_gib <= MAX_DEVICE_GIB:  # (NaN fails too)
            raise ConfigError(f"--device-memory must be a positive number of GiB up to {MAX_DEVICE_GIB:,}, "
                              f"got {device_memory_gib}")
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


__all__ = ["Estimate", "Layout", "Suggestion", "apply_changes", "check_bounds", "device_memory", "estimate",
           "pipeline_ops", "resolve_layout", "suggest", "MiB", "GiB"]
