"""The training metrics beyond loss, lr, gradient norm, tokens/s and MFU (`logging.monitor`): parameter
norm, samples/s, CUDA allocator memory and fragmentation, data-loading, checkpoint-save and gradient-sync
time, the pipeline bubble, and one layer's attention entropy. Each one's cost is measured by
bench/monitoring_cost.py; what costs more than 1% of a step is off by default (docs: Monitoring)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lmforge.config.schema import Config
from lmforge.engine.comm import Comm
from lmforge.errors import ConfigError
from lmforge.models.common.attention import Attention
from lmforge.models.common.rope import apply_rope
from lmforge.parallel.data_parallel import SyncTimer
from lmforge.parallel.dims import ParallelDims
from lmforge.parallel.pipeline_timing import BubbleTimer
from lmforge.parallel.pipeline_timing import attach as attach_bubble_timer
from lmforge.parallel.process_group import host_group


def batch_rows(batch: Any) -> int:
    """The samples in one micro-batch: preference pairs, prompts, else rows of input_ids."""
    if hasattr(batch, "pairs"):
        return int(batch.pairs)
    if hasattr(batch, "prompts"):
        return len(batch.prompts)
    ids = getattr(batch, "input_ids", None)
    return int(ids.size(0)) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0


def param_norm(model: nn.Module, comm: Comm) -> float:
    """The L2 norm of all weights, whole (sharded tensors summed over their shards, stages over pp)."""
    params = [p.detach() for p in model.parameters()]
    if not params:
        return 0.0
    sq = torch.stack([n.float().square() for n in comm.norms(params)]).sum()
    return float(comm.reduce_norm_sq(sq).sqrt())


def cuda_memory(device: torch.device) -> dict[str, float]:
    """The caching allocator's view: allocated and reserved MiB, and the share of reserved memory held in
    inactive split blocks (free, but not whole blocks a large tensor could take: fragmentation)."""
    stats = torch.cuda.memory_stats(device)
    allocated = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    inactive = stats.get("inactive_split_bytes.all.current", 0)
    return {"mem_allocated_mib": allocated / 2**20, "mem_reserved_mib": reserved / 2**20,
            "mem_fragmentation": inactive / reserved if reserved else 0.0}


def attention_probs(module: Attention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """The probabilities `module` attends with for input x (B, T, d_model): (B, H, T, T), from the same
    projections, norms, rotary angles, scale and soft-cap (SDPA returns only its output). mask None
    (causal, or every key for an encoder) or boolean (T, T), True = attend."""
    B, T, _ = x.shape
    q, k = module.wq(x), module.wk(x)
    if module.qk_norm:
        q, k = module.q_norm(q), module.k_norm(k)
    q = q.view(B, T, module.n_heads, module.head_dim)  # (B, T, H, D)
    k = k.view(B, T, module.n_kv_heads, module.head_dim)  # (B, T, Hkv, D)
    if module.qk_head_norm:
        q, k = module.q_norm(q), module.k_norm(k)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    q, k = q.transpose(1, 2).float(), k.transpose(1, 2).float()  # (B, H, T, D), (B, Hkv, T, D)
    if k.size(1) != q.size(1):  # grouped-query: each kv head serves H / Hkv query heads
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scale = module.scale if module.scale is not None else module.head_dim**-0.5
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, T)
    if module.softcap is not None:
        scores = module.softcap * torch.tanh(scores / module.softcap)
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device)
        mask = mask.tril() if module.causal else mask
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def entropy(probs: torch.Tensor) -> float:
    """Mean entropy (nats) of the rows of `probs` (..., S); zero probabilities add nothing."""
    return float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean())


class Monitor:
    """Accumulates a log window's monitoring metrics and hands them to the train record."""

    def __init__(self, config: Config, model: nn.Module, comm: Comm, device: torch.device,
                 dims: ParallelDims | None = None, pipeline: Any = None) -> None:
        cfg = self.cfg = config.logging.monitor
        self.model, self.comm, self.device = model, comm, device
        self.rows = self.local_tokens = 0
        self.data_seconds = 0.0
        self.sync = self._sync_timer() if cfg.grad_sync_time else None
        self.bubble = self._bubble_timer(pipeline) if cfg.pipeline_bubble else None
        self._entropy_row: torch.Tensor | None = None
        self.layer: Attention | None = None
        if cfg.attention_entropy_every:
            pp, tp = (dims.pp, dims.tp) if dims is not None else (1, 1)
            self.layer = self._entropy_layer(config.train.log_every, pp, tp, config.train.compile)

    def _sync_timer(self) -> SyncTimer:
        state = getattr(self.model, "lmforge_ddp_hook", None)
        key = "logging.monitor.grad_sync_time"
        if state is None:
            raise ConfigError(f"{key}=true times DDP's gradient all-reduce: this run has none (one process, "
                              "FSDP or a pipeline); run with parallel.dp_replicate > 1, or set "
                              f"{key}=false")
        if self.device.type != "cpu":
            raise ConfigError(f"{key}=true is measured on the host, which is exact for gloo (CPU) only; on "
                              f"{self.device.type} use the torch profiler, and set {key}=false")
        state.timer = SyncTimer()
        return state.timer

    def _bubble_timer(self, pipeline: Any) -> BubbleTimer:
        if pipeline is None:
            raise ConfigError("logging.monitor.pipeline_bubble=true measures a pipeline's idle time: this "
                              "run has none (parallel.pp=1); run with parallel.pp > 1, or set "
                              "logging.monitor.pipeline_bubble=false")
        return attach_bubble_timer(pipeline, self.device)

    def _entropy_layer(self, log_every: int, pp: int, tp: int, compiled: bool) -> Attention:
        every = self.cfg.attention_entropy_every
        key = "logging.monitor.attention_entropy_every"
        if every % log_every:
            fit = log_every * max(1, every // log_every)
            raise ConfigError(f"{key}={every} must be a multiple of train.log_every={log_every} (the entropy "
                              f"is logged with a train record); e.g. {key}={fit}")
        why = ("parallel.pp > 1 (no one rank runs the whole model)" if pp > 1 else
               "parallel.tp > 1 (each rank holds only some heads)" if tp > 1 else
               "train.compile=true (hooks on compiled blocks recompile them)" if compiled else None)
        if why:
            raise ConfigError(f"{key} is not available with {why}; set {key}=0")
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if not layers or any(m.sinks is not None for m in layers):
            raise ConfigError(f"{key}: this model's attention (MLA, attention sinks or none) is not one the "
                              f"entropy can be computed beside; set {key}=0")
        index = self.cfg.attention_entropy_layer
        if index is None:
            index = len(layers) // 2
        if index >= len(layers):
            raise ConfigError(f"logging.monitor.attention_entropy_layer={index}: the model has {len(layers)} "
                              f"attention layers (0..{len(layers) - 1})")
        return layers[index]

    # -- what the trainer reports ---------------------------------------------------------------
    def batches(self, batches: Sequence[Any], seconds: float, next_step: int) -> None:
        """The batches of step `next_step` were taken from the loader in `seconds`."""
        self.data_seconds += seconds
        if self.sync is not None:
            self.sync.end_step()
        self.rows += sum(batch_rows(b) for b in batches)
        self.local_tokens += sum(int(getattr(b, "num_tokens", 0)) for b in batches)
        every = self.cfg.attention_entropy_every
        if every and next_step % every == 0 and batches:
            ids = getattr(batches[0], "input_ids", None)
            if isinstance(ids, torch.Tensor) and ids.dim() == 2:
                self._entropy_row = ids[:1, : self.cfg.attention_entropy_tokens].clone()

    # -- the record -----------------------------------------------------------------------------
    def collect(self, tokens_per_s: float) -> dict[str, float]:
        """This window's metrics (then the window restarts). `tokens_per_s`: the job's, for samples/s."""
        out: dict[str, float] = {}
        if self.rows and self.local_tokens:  # the job's rate, at this rank's rows per token
            out["samples_per_s"] = tokens_per_s * self.rows / self.local_tokens
        if self.cfg.param_norm:
            out["param_norm"] = param_norm(self.model, self.comm)
        if self.cfg.memory and self.device.type == "cuda":
            out.update(cuda_memory(self.device))
        if self.cfg.data_time:
            out["data_s"] = self.data_seconds
        if self.sync is not None:
            out["grad_sync_s"] = self.sync.take()
        if self.bubble is not None:
            idle = self.bubble.take(host_group())
            if idle is not None:
                out["pipeline_bubble"] = idle
        if self._entropy_row is not None:
            value = self._entropy()
            if math.isfinite(value):
                out["attention_entropy"] = value
        self.rows = self.local_tokens = 0
        self.data_seconds = 0.0
        self._entropy_row = None
        return out

    @torch.no_grad()
    def _entropy(self) -> float:
        """One forward of the kept row; a hook on the chosen layer computes its attention probabilities
        from the same projections, norms and rotary angles the layer uses. Every rank runs it (a sharded
        model's forward is collective)."""
        attn, found = self.layer, []

        def hook(module: Attention, args: tuple, kwargs: dict) -> None:
            x = args[0]
            rope = args[1] if len(args) > 1 else kwargs.get("rope")
            mask = args[2] if len(args) > 2 else kwargs.get("mask")
            # a boolean (T, T) mask (sliding window) is used; a packed rows' BlockMask is not a tensor,
            # and the row is then taken as one causal sequence
            mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
            found.append(entropy(attention_probs(module, x, rope, mask)))

        handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
        was_training = self.model.training
        self.model.eval()  # no dropout on the probabilities
        try:
            self.model(self._entropy_row.to(self.device))
        finally:
            handle.remove()
            self.model.train(was_training)
        return found[0] if found else math.nan
