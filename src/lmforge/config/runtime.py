"""Where and how a run runs and reports: `parallel`, `logging`, `eval`, `generate`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmforge.config.section import SEED_MAX, Section


class ParallelConfig(Section):
    """Layout of a distributed run: dp_replicate x dp_shard x tp x pp must equal the process count."""

    dp_replicate: int = Field(
        1, ge=1, description="Data-parallel replicas: DDP, or HSDP's replicate dim (with tp/pp/dp_shard > 1)."
    )
    dp_shard: int = Field(
        -1, ge=-1, description="Data-parallel shard degree for FSDP (-1: whatever the other degrees leave)."
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (heads and MLP width split).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel stages (layers split).")
    ep: int = Field(
        1, ge=1, description="Expert-parallel degree (model.moe): each group of ep data-parallel ranks "
        "splits the experts and exchanges tokens all-to-all; must divide dp_replicate x dp_shard."
    )
    zero: Literal[1, 2, 3] = Field(
        3, description="With dp_shard > 1: 3 shards params+grads+optimizer (FSDP2), 2 also but keeps params "
        "gathered from forward to backward, 1 shards optimizer state only (DDP + ZeroRedundancyOptimizer; "
        "tp = pp = 1)."
    )
    sequence_parallel: bool = Field(
        True, description="With tp > 1: shard norms and residuals on the sequence."
    )
    cpu_offload: bool = Field(
        False, description="FSDP: keep sharded params, grads and optimizer state on CPU."
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="Pipeline schedule."
    )
    pp_microbatches: int | None = Field(
        None, ge=1, description="Pipeline micro-batches per step (None: train.grad_accum_steps)."
    )
    pp_stages_per_rank: int = Field(
        1, ge=1, description="Model chunks per rank: 1 for gpipe/1f1b, >= 2 for interleaved_1f1b."
    )
    param_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="FSDP compute dtype of params (auto: bf16 with bf16 precision, else fp32)."
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="FSDP gradient reduce dtype.")
    timeout_s: int = Field(
        600, ge=10, description="Collective timeout: a dead rank stops the job after this."
    )


class MlflowConfig(Section):
    enabled: bool = Field(False, description="Log config, metrics and final artifacts to MLflow "
                          "(needs `lmforge[mlflow]`).")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI (file:/path/mlruns or "
                                     "http://host:port); unset: file:<run.dir>/mlruns.")
    experiment: str = Field("lmforge", min_length=1, description="MLflow experiment name (created if new).")
    run_name: str | None = Field(None, description="MLflow run name; unset: run.name.")


class WandbConfig(Section):
    enabled: bool = Field(False, description="Log config, metrics and final artifacts to Weights & Biases "
                          "(needs `lmforge[wandb]`).")
    project: str = Field("lmforge", min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (user or team); unset: your default.")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: write the run locally (upload later with `wandb sync`); "
        "online: stream to the W&B server (needs `wandb login`).")
    dir: str | None = Field(None, description="Where W&B writes its wandb/ folder; unset: run.dir.")
    run_name: str | None = Field(None, description="W&B run name; unset: run.name.")


class MonitorConfig(Section):
    """What the train records carry beyond loss, lr, gradient norm, tokens/s, MFU and peak memory. Costs are
    measured by bench/monitoring_cost.py (docs: Monitoring); what costs more than 1% is off by default."""

    param_norm: bool = Field(True, description="param_norm: the L2 norm of all weights, at log steps.")
    memory: bool = Field(
        True, description="CUDA only (absent on a CPU): mem_allocated_mib, mem_reserved_mib and "
        "mem_fragmentation (inactive split blocks / reserved) from the caching allocator, at log steps.")
    data_time: bool = Field(
        True, description="data_s: seconds spent taking the window's batches from the loader (host side).")
    checkpoint_time: bool = Field(True, description="checkpoint_save_s: seconds each checkpoint save took.")
    grad_sync_time: bool = Field(
        False, description="grad_sync_s: DDP only: seconds from the first gradient bucket's all-reduce to "
        "the last one's completion, summed over the window's steps (on CUDA it synchronises per bucket).")
    pipeline_bubble: bool = Field(
        False, description="pipeline_bubble: parallel.pp > 1 only: the share of the window's pipeline "
        "steps the stages sat idle, 1 - busy / wall per rank (busy: its stages' forward, backward and loss; "
        "wall: the schedule's step), averaged over ranks (on CUDA it synchronises around each stage's work).")
    attention_entropy_every: int = Field(
        0, ge=0, description="attention_entropy: every this many steps (0: off; a multiple of "
        "train.log_every), the mean entropy in nats of one layer's attention probabilities on one row of "
        "the step's first batch, computed beside the model's attention (SDPA gives no probabilities).")
    attention_entropy_layer: int | None = Field(
        None, ge=0, description="The layer whose attention entropy is logged (None: the middle one).")
    attention_entropy_tokens: int = Field(
        128, ge=2, le=4096, description="Tokens of the row the attention entropy is computed on.")


class LoggingConfig(Section):
    progress: Literal["auto", "bar", "plain", "none"] = Field(
        "auto", description="Console output: a live bar, one line per log step, or nothing."
    )
    tensorboard: bool = Field(False, description="Also write TensorBoard events (needs `tensorboard`).")
    plot: bool = Field(True, description="Draw loss/lr curves to <run.dir>/curves.png.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow tracking (rank 0 only).")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases tracking "
                               "(rank 0 only).")
    monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="Extra training metrics "
                                   "and their costs (docs: Monitoring).")


class EvalConfig(Section):
    split: Literal["val", "train"] = Field("val", description="Split to evaluate.")
    max_batches: int | None = Field(None, ge=1, description="Evaluate at most this many batches.")
    batch_size: int = Field(8, ge=1, le=4096, description="Sequences per evaluation batch.")


class GenerateConfig(Section):
    prompt: str = Field("", description="Text to continue.")
    max_new_tokens: int = Field(200, ge=1, description="Tokens to generate.")
    temperature: float = Field(0.8, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int | None = Field(None, ge=1, description="Sample from the k most likely tokens.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    num_samples: int = Field(1, ge=1, le=1024, description="Independent samples (one batch: a KV-cache "
                             "row each).")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Sampling seed.")
