"""The job's parallel layout: degrees from `parallel.*`, checked against the world size and the
model, and the `DeviceMesh` every strategy takes its process groups from.

Mesh dimensions, outermost first (torchtitan's order, so that the innermost, most
communication-hungry dimension, tp, spans neighbouring ranks - the same host on GPUs):

    pp, dp_replicate, dp_shard, tp        + `dp_mesh`: (dp_replicate, dp_shard) flattened

Every dimension is in the mesh even at degree 1, so code can always ask for `mesh["tp"]`.
Ranks with the same dp coordinate see the same data: the loader is indexed by `dp_rank` of
`dp_size`, never by the global rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmforge.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lmforge.config.schema import ModelConfig, ParallelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # plus `dp_mesh`: dp_replicate x dp_shard


@dataclass
class ParallelDims:
    """Resolved degrees; build with `ParallelDims.resolve`."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cfg: ParallelConfig
    mesh: DeviceMesh | None = field(default=None, repr=False)
    dp_mesh: DeviceMesh | None = field(default=None, repr=False)  # (dp_replicate, dp_shard) flattened
    # (edp, ep) over the data-parallel ranks with parallel.ep > 1: "ep" groups of ep neighbouring ranks
    # split the experts; "edp" links the ranks holding the same experts (their gradients are summed).
    ep_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int, model: ModelConfig | None = None,
                grad_accum_steps: int = 1) -> ParallelDims:
        """Resolve dp_shard=-1 and check the layout against the world size and (when given) the
        model; a wrong layout is a ConfigError at start-up, never a hang or a shape error later."""
        dp_shard = cfg.dp_shard
        others = cfg.dp_replicate * cfg.tp * cfg.pp
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallel.dp_replicate={cfg.dp_replicate} x parallel.tp={cfg.tp} x parallel.pp={cfg.pp}"
                    f" = {others} does not divide the world size {world_size}, so parallel.dp_shard=-1 "
                    "cannot fill it; choose degrees whose product divides the number of processes"
                )
            dp_shard = world_size // others
        elif dp_shard == 0:
            raise ConfigError("parallel.dp_shard must be -1 (fill) or >= 1, got 0")
        if others * dp_shard != world_size:
            fill = f"{world_size // others}" if world_size % others == 0 else "none fits"
            raise ConfigError(
                f"parallel layout dp_replicate={cfg.dp_replicate} x dp_shard={dp_shard} x tp={cfg.tp} x "
                f"pp={cfg.pp} = {others * dp_shard} processes, but the world size is {world_size}; "
                f"the product must equal the number of processes (dp_shard={fill} with these "
                "dp_replicate/tp/pp, or parallel.dp_shard=-1 to fill)"
            )
        dims = cls(cfg.dp_replicate, dp_shard, cfg.tp, cfg.pp, world_size, cfg)
        dims._check_strategy()
        dims._check_schedule(grad_accum_steps)
        if model is not None:
            dims.check_model(model)
        return dims

    # -- checks ---------------------------------------------------------------------------------
    def _check_strategy(self) -> None:
        ep = self.cfg.ep
        if ep > 1 and (self.tp > 1 or self.pp > 1):
            raise ConfigError(
                f"parallel.ep={ep} (expert parallelism) works beside data parallelism only; with "
                f"parallel.tp={self.tp}, parallel.pp={self.pp} set parallel.ep=1 or tp = pp = 1"
            )
        if ep > 1 and self.dp_size % ep:
            raise ConfigError(
                f"parallel.ep={ep} must divide the data-parallel ranks dp_replicate x dp_shard = "
                f"{self.dp_size}: expert groups are made of data-parallel ranks; choose an ep that divides it"
            )
        if ep > 1 and self.zero1:
            raise ConfigError(
                f"parallel.ep={ep} with parallel.zero=1: the sharded optimizer broadcasts every parameter "
                "from its owner, which would overwrite the experts other ranks hold; use parallel.zero=2 or 3"
            )
        if self.cfg.zero == 1 and self.dp_shard > 1 and (self.tp > 1 or self.pp > 1):
            raise ConfigError(
                "parallel.zero=1 (DDP + sharded optimizer state) works on a data-parallel-only layout; "
                f"with parallel.tp={self.tp}, parallel.pp={self.pp} use parallel.zero=2 or 3 (FSDP)"
            )
        if self.cfg.cpu_offload and not self.fsdp:
            raise ConfigError(
                "parallel.cpu_offload=true offloads FSDP shards, but this layout has no FSDP "
                "(it needs parallel.dp_shard > 1 with parallel.zero=2 or 3)"
            )
        if self.cfg.pp_stages_per_rank > 1 and self.pp == 1:
            raise ConfigError(
                f"parallel.pp_stages_per_rank={self.cfg.pp_stages_per_rank} needs parallel.pp > 1"
            )

    def _check_schedule(self, grad_accum_steps: int) -> None:
        if self.pp == 1:
            return
        cfg, v = self.cfg, self.cfg.pp_stages_per_rank
        if cfg.pp_schedule == "interleaved_1f1b" and v < 2:
            raise ConfigError(
                "parallel.pp_schedule=interleaved_1f1b needs parallel.pp_stages_per_rank >= 2 "
                "(several model chunks per rank); with 1 stage per rank use gpipe or 1f1b"
            )
        if cfg.pp_schedule != "interleaved_1f1b" and v != 1:
            raise ConfigError(
                f"parallel.pp_schedule={cfg.pp_schedule} runs one stage per rank, but "
                f"parallel.pp_stages_per_rank={v}; set it to 1 or use interleaved_1f1b"
            )
        m = self.microbatches(grad_accum_steps)
        if cfg.pp_schedule == "1f1b" and m < self.pp:
            raise ConfigError(
                f"parallel.pp_schedule=1f1b needs at least parallel.pp={self.pp} micro-batches per step, "
                f"got {m} (parallel.pp_microbatches, default train.grad_accum_steps); raise it"
            )
        if cfg.pp_schedule == "interleaved_1f1b":
            rounds = max(1, m // self.pp)
            if m % rounds:
                raise ConfigError(
                    f"parallel.pp_schedule=interleaved_1f1b needs the micro-batches ({m}) to be a multiple "
                    f"of "
                    f"{rounds} (micro-batches // parallel.pp); use {rounds * (m // rounds + 1)} or {self.pp}"
                )

    def check_model(self, model: ModelConfig) -> None:
        """The model splits evenly over tp (heads, kv heads) and pp (layers into stages)."""
        if self.tp > 1:
            for key, n in (("n_heads", model.n_heads), ("n_kv_heads", model.resolved_kv_heads)):
                if n % self.tp:
                    raise ConfigError(
                        f"model.{key}={n} is not divisible by parallel.tp={self.tp}: tensor parallelism "
                        f"gives each rank whole heads; use a parallel.tp that divides {n}"
                    )
        if self.tp > 1 and model.any_dropout:
            named = ", ".join(f"model.{k}={getattr(model, k)}" for k in ("dropout", "attention_dropout",
                              "hidden_dropout") if (getattr(model, k) or 0) > 0)
            raise ConfigError(
                f"{named} with parallel.tp={self.tp}: tensor-parallel ranks hold "
                "copies of the same activations and would draw different dropout masks for them; "
                "set them to 0 or parallel.tp=1"
            )
        ep, moe = self.cfg.ep, getattr(model, "moe", None)
        if ep > 1 and moe is None:
            raise ConfigError(f"parallel.ep={ep} splits the experts of a mixture-of-experts model, but "
                              "model.moe is not set; set parallel.ep=1 or configure model.moe")
        if ep > 1 and moe.n_experts % ep:
            raise ConfigError(f"model.moe.n_experts={moe.n_experts} is not divisible by parallel.ep={ep}: "
                              "each expert-parallel rank holds the same number of experts")
        if self.pp > 1 and moe is not None:
            raise ConfigError(
                f"parallel.pp={self.pp} with model.moe: the router's auxiliary losses and statistics are "
                "gathered outside the pipeline's stage losses, so a pipeline would train without them; set "
                "parallel.pp=1 (data or expert parallelism split a mixture-of-experts model)"
            )
        if self.tp > 1 and getattr(model, "mla", None) is not None:
            raise ConfigError(f"parallel.tp={self.tp} with model.mla: the tensor-parallel plan splits the "
                              "q/k/v projections of grouped-query attention, which latent attention has not; "
                              "set parallel.tp=1 (data parallelism or FSDP split it)")
        if self.tp > 1 and model.attn_sinks:
            raise ConfigError(f"parallel.tp={self.tp} with model.attn_sinks: the per-head sink logits are "
                              "not split with the heads; set parallel.tp=1")
        if self.tp > 1 and (moe is not None or model.qk_norm):
            what = "model.moe (the tensor-parallel plan splits a dense MLP)" if moe is not None else \
                "model.qk_norm (not in the tensor-parallel plan: an RMSNorm over the whole q/k projection, " \
                "which tp would split, or per head)"
            raise ConfigError(f"parallel.tp={self.tp} with {what}; set parallel.tp=1")
        if self.tp > 1 and model.norm_placement != "pre":
            raise ConfigError(f"parallel.tp={self.tp} with model.norm_placement={model.norm_placement}: the "
                              "tensor-parallel plan places the pre-norms only; set parallel.tp=1")
        if self.pp > 1:
            stages = self.pp * self.cfg.pp_stages_per_rank
            if model.n_layers % stages:
                raise ConfigError(
                    f"model.n_layers={model.n_layers} cannot be split into parallel.pp={self.pp} x "
                    f"parallel.pp_stages_per_rank={self.cfg.pp_stages_per_rank} = {stages} equal stages; "
                    "choose degrees whose product divides n_layers"
                )

    # -- derived --------------------------------------------------------------------------------
    def microbatches(self, grad_accum_steps: int) -> int:
        """Pipeline micro-batches per step (pp_microbatches, default the accumulation steps)."""
        return self.cfg.pp_microbatches or grad_accum_steps

    @property
    def ep(self) -> int:
        """Expert-parallel degree (1: every rank holds every expert)."""
        return self.cfg.ep

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """FSDP2 carries data parallelism (ZeRO-2/3, or HSDP / replicate beside tp or pp)."""
        if self.dp_shard > 1:
            return self.cfg.zero >= 2
        return self.dp_replicate > 1 and (self.tp > 1 or self.pp > 1)

    @property
    def ddp(self) -> bool:
        """Plain DDP gradients (pure data parallelism without FSDP; ZeRO-1 adds the sharded optimizer)."""
        return self.dp_size > 1 and not self.fsdp

    @property
    def zero1(self) -> bool:
        return self.dp_shard > 1 and self.cfg.zero == 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the DeviceMesh (needs an initialised process group) and the flattened "dp" mesh
        (kept here: slicing a flattened dim back out of the root mesh is deprecated)."""
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(
            device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIMS
        )
        self.dp_mesh = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        if self.ep > 1:
            # tp = pp = 1 here, so the data-parallel ranks are all ranks in order: rank = edp * ep + ep_rank.
            self.ep_mesh = init_device_mesh(device_type, (self.dp_size // self.ep, self.ep),
                                            mesh_dim_names=("edp", "ep"))
        return self.mesh

    def _coord(self, name: str) -> int:
        assert self.mesh is not None, "build_mesh() first"
        return self.mesh[name].get_local_rank()

    @property
    def dp_rank(self) -> int:
        """This rank's index among data-parallel replicas: the loader's rank."""
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None and self.dp_size > 1 else 0

    @property
    def pp_rank(self) -> int:
        return self._coord("pp") if self.pp > 1 else 0

    @property
    def tp_rank(self) -> int:
        return self._coord("tp") if self.tp > 1 else 0

    @property
    def is_last_stage(self) -> bool:
        """This rank computes the loss (holds the last pipeline stage)."""
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """Global rank 0 speaks: it is dp 0, tp 0 and on the first stage; step losses are reduced so
        every rank, rank 0 included, holds the job's loss."""
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "tp", "pp")]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        kind = "ddp" if self.ddp else ("fsdp" if self.fsdp else "none")
        if self.zero1:
            kind = "ddp+zero1"
        elif self.fsdp and self.dp_shard > 1:
            kind = f"fsdp zero{self.cfg.zero}"
        return f"{' x '.join(parts)} ({self.world_size} ranks, data parallel: {kind})"
