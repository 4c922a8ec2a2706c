"""The one typed config tree. Every field has a default and a one-line doc (its `description`).

YAML is its serialised form (`lmforge.config.load`), `--set a.b=c` the only second level. Unknown keys,
wrong types and out-of-range values are errors raised before any work starts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmforge.config.curate import CurateConfig
from lmforge.models.presets import PRESETS


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class RunConfig(Section):
    name: str = Field("run", description="Human-readable run name (used in logs and reports).")
    dir: str = Field("runs/run", description="Run directory: config, metrics, plots and checkpoints go here.")
    seed: int = Field(1337, ge=0, description="Seed for model init, dropout and data order.")
    overwrite: bool = Field(
        False, description="Allow training into a run dir that already holds another run (deletes it)."
    )


class TokenizerConfig(Section):
    path: str | None = Field(
        None, description="Existing tokenizer.json to use; when unset a byte-level BPE is trained."
    )
    vocab_size: int = Field(8192, ge=260, le=1_000_000, description="Vocabulary size of a trained BPE.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    train_chars: int = Field(
        50_000_000, ge=1000, description="At most this many characters of the corpus train the tokenizer."
    )


class DataConfig(Section):
    sources: list[str] = Field(
        default_factory=lambda: ["builtin:python"],
        description="Text sources: files or folders of .txt/.md/.jsonl, or 'builtin:python' "
        "(the docs and stdlib source of the running Python).",
    )
    dir: str | None = Field(
        None, description="Where prepared shards and the tokenizer go (default: <run.dir>/data)."
    )
    text_key: str = Field("text", description="Field holding the document text in JSONL records.")
    val_fraction: float = Field(
        0.02, gt=0.0, lt=0.5, description="Fraction of documents held out for validation."
    )
    max_chars: int | None = Field(
        None, ge=1, description="Stop reading sources after this many characters (None: read all)."
    )
    on_bad_utf8: Literal["skip", "fail"] = Field(
        "skip", description="A file that is not UTF-8: skip it and count it, or fail with its path."
    )
    on_bad_json: Literal["skip", "fail"] = Field(
        "fail", description="A malformed JSONL line: skip it and count it, or fail with file and line."
    )
    shard_tokens: int = Field(
        1 << 24, ge=1024, description="Tokens per shard file (shards are memory-mapped when loading)."
    )
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer settings.")


class RopeScalingConfig(Section):
    """RoPE context extension, as in Hugging Face `rope_scaling` (linear, dynamic NTK, llama3)."""

    type: Literal["linear", "dynamic", "llama3"] = Field(
        "linear", description="linear: positions / factor; dynamic: NTK base growth past the original "
        "length; llama3: per-frequency interpolation (Llama 3.1)."
    )
    factor: float = Field(1.0, ge=1.0, description="Context extension factor.")
    original_max_position_embeddings: int | None = Field(
        None, ge=1, description="Context length the model was trained with (dynamic and llama3)."
    )
    low_freq_factor: float = Field(1.0, gt=0.0, description="llama3: low-frequency wavelength factor.")
    high_freq_factor: float = Field(4.0, gt=0.0, description="llama3: high-frequency wavelength factor.")


class ModelConfig(Section):
    preset: str | None = Field(
        None, description=f"Named size filling the other keys; explicit keys win. One of {sorted(PRESETS)}."
    )
    vocab_size: int | None = Field(
        None, ge=2, description="Vocabulary size (None: the tokenizer's, rounded up to a multiple of 64)."
    )
    d_model: int = Field(256, ge=1, description="Hidden size.")
    n_layers: int = Field(4, ge=1, description="Number of transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention (query) heads.")
    n_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (None: = n_heads; fewer: grouped-query attention)."
    )
    head_dim: int | None = Field(None, ge=1, description="Per-head size (None: d_model // n_heads).")
    d_ff: int | None = Field(
        None, ge=1, description="MLP hidden size (None: 4*d_model for gelu, Llama's 8/3 rule for swiglu)."
    )
    max_seq_len: int = Field(256, ge=1, description="Longest sequence the model is built for.")
    norm: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="Normalisation layer.")
    norm_eps: float = Field(1e-5, gt=0.0, description="Epsilon of the normalisation layers.")
    pos_embedding: Literal["rope", "learned"] = Field(
        "rope", description="Rotary position embedding or a learned absolute position table."
    )
    rope_theta: float = Field(10000.0, gt=0.0, description="RoPE base frequency.")
    mlp: Literal["swiglu", "gelu", "gelu_tanh"] = Field(
        "swiglu", description="MLP type: SwiGLU (Llama), GELU (erf), or GELU tanh approximation (GPT-2)."
    )
    bias: bool = Field(False, description="Biases in every linear layer and in LayerNorm (GPT-2 style).")
    qkv_bias: bool = Field(False, description="Biases in the q/k/v projections only (Qwen2 style).")
    tie_embeddings: bool = Field(True, description="Share the input embedding and output projection.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on attention, residual and embeddings.")
    sliding_window: int | None = Field(
        None, ge=1, description="Attend to at most this many previous tokens (Mistral style)."
    )
    rope_scaling: RopeScalingConfig | None = Field(
        None, description="RoPE scaling for context extension (None: plain RoPE)."
    )
    init_std: float = Field(0.02, gt=0.0, description="Std of the normal init of weights.")
    init_from: str | None = Field(
        None, description="Start from these weights instead of a random init: a Hugging Face model dir, "
        "an `lmforge import` dir, a run dir or a checkpoint dir (the shapes must match this section)."
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            name = data["preset"]
            if name not in PRESETS:
                raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}")
            data = {**PRESETS[name], **data}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "change one of them or set head_dim"
            )
        if self.pos_embedding == "rope" and self.resolved_head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.resolved_head_dim}")
        rs = self.rope_scaling
        if rs is not None and rs.type == "llama3" and rs.original_max_position_embeddings is None:
            raise ValueError("rope_scaling.type=llama3 needs rope_scaling.original_max_position_embeddings "
                             "(the context length the model was pre-trained with, e.g. 8192)")
        return self

    @property
    def resolved_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp != "swiglu":
            return 4 * self.d_model
        hidden = int(2 * 4 * self.d_model / 3)
        return 64 * ((hidden + 63) // 64)


class OptimConfig(Section):
    name: Literal["adamw", "adam", "sgd", "lion", "adafactor"] = Field(
        "adamw", description="Optimizer: adamw, adam (L2 decay), sgd, lion, adafactor."
    )
    lr: float = Field(3e-4, gt=0.0, description="Peak learning rate (adafactor relative_step: ignored).")
    betas: tuple[float, float] = Field(
        (0.9, 0.95), description="Adam/AdamW/Lion beta1, beta2 (Lion paper: 0.9, 0.99)."
    )
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon.")
    weight_decay: float = Field(
        0.1, ge=0.0, description="Weight decay (never applied to norms, biases, embeddings); L2 for adam/sgd."
    )
    fused: bool | None = Field(
        None, description="Fused Adam/AdamW kernel (None: use it where supported); adam/adamw only."
    )
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum (0: plain SGD, no state).")
    nesterov: bool = Field(False, description="SGD Nesterov momentum (needs momentum > 0).")
    adafactor_beta1: float | None = Field(
        None, ge=0.0, lt=1.0, description="Adafactor first-moment decay (None: no first moment)."
    )
    adafactor_eps: tuple[float, float] = Field(
        (1e-30, 1e-3), description="Adafactor eps: added to g^2, and floor of the parameter scale."
    )
    relative_step: bool = Field(
        False, description="Adafactor step size min(1e-2, 1/sqrt(t)) instead of lr (the schedule is ignored)."
    )
    scale_parameter: bool = Field(False, description="Adafactor: scale the step by the parameter RMS.")
    warmup_init: bool = Field(
        False, description="Adafactor relative step warm-up 1e-6*t (needs relative_step)."
    )
    clip_threshold: float = Field(1.0, gt=0.0, description="Adafactor: clip the update to this RMS.")
    decay_rate: float = Field(
        -0.8, lt=0.0, description="Adafactor second-moment rate: beta2_t = 1 - t^decay_rate."
    )

    @model_validator(mode="after")
    def _check_betas(self) -> OptimConfig:
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas must lie in [0, 1), got {list(self.betas)}")
        if self.nesterov and self.momentum <= 0.0:
            raise ValueError("optim.nesterov needs optim.momentum > 0")
        if self.warmup_init and not self.relative_step:
            raise ValueError("optim.warmup_init needs optim.relative_step")
        if self.fused and self.name not in ("adamw", "adam"):
            raise ValueError(f"optim.fused applies to adamw/adam only, not {self.name}")
        return self


class ScheduleConfig(Section):
    name: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Shape after warm-up: cosine or linear decay to min_lr_ratio, or constant."
    )
    warmup_steps: int = Field(100, ge=0, description="Linear warm-up steps from 0 to the peak lr.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr as a fraction of the peak.")
    decay_steps: int | None = Field(
        None, ge=1, description="Step at which the decay ends (None: train.max_steps)."
    )


class TrainConfig(Section):
    max_steps: int = Field(1000, ge=1, description="Optimizer steps to train.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward pass.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    seq_len: int | None = Field(None, ge=1, description="Training sequence length (None: model.max_seq_len).")
    grad_clip: float = Field(1.0, ge=0.0, description="Clip gradients to this global norm (0: off).")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="fp32, bf16/fp16 autocast; auto measures what is fast on this device."
    )
    activation_checkpointing: Literal["none", "full", "every_k"] = Field(
        "none", description="Recompute activations in backward: in no block, every block, every k-th."
    )
    ac_every: int = Field(2, ge=1, description="k for activation_checkpointing=every_k.")
    compile: bool = Field(False, description="torch.compile the model.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device (auto: cuda if available).")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default).")
    log_every: int = Field(10, ge=1, description="Log metrics every this many steps.")
    eval_every: int = Field(200, ge=0, description="Validate every this many steps (0: only at the end).")
    eval_batches: int = Field(20, ge=1, description="Validation micro-batches per evaluation.")


class CheckpointConfig(Section):
    every: int = Field(500, ge=0, description="Save a checkpoint every this many steps (0: only at the end).")
    keep_last: int = Field(3, ge=1, description="Keep this many most recent checkpoints.")
    save_final: bool = Field(True, description="Save a checkpoint when training ends.")


class LoggingConfig(Section):
    progress: Literal["auto", "bar", "plain", "none"] = Field(
        "auto", description="Console output: a live bar, one line per log step, or nothing."
    )
    tensorboard: bool = Field(False, description="Also write TensorBoard events (needs `tensorboard`).")
    plot: bool = Field(True, description="Draw loss/lr curves to <run.dir>/curves.png.")


class EvalConfig(Section):
    split: Literal["val", "train"] = Field("val", description="Split to evaluate.")
    max_batches: int | None = Field(None, ge=1, description="Evaluate at most this many batches.")
    batch_size: int = Field(8, ge=1, description="Sequences per evaluation batch.")


class GenerateConfig(Section):
    prompt: str = Field("", description="Text to continue.")
    max_new_tokens: int = Field(200, ge=1, description="Tokens to generate.")
    temperature: float = Field(0.8, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int | None = Field(None, ge=1, description="Sample from the k most likely tokens.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    num_samples: int = Field(1, ge=1, description="Independent samples.")
    seed: int = Field(0, ge=0, description="Sampling seed.")


class Config(Section):
    """The whole run: what `lmforge <verb> -c run.yaml` reads."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and directory.")
    data: DataConfig = Field(default_factory=DataConfig, description="Text sources and preparation.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model architecture.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Learning-rate schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="`lmforge eval` settings.")
    generate: GenerateConfig = Field(default_factory=GenerateConfig,
                                     description="`lmforge generate` settings.")
    curate: CurateConfig = Field(default_factory=CurateConfig,
                                 description="`lmforge data` corpus-cleaning pipeline.")

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        seq = self.train.seq_len
        if seq is not None and seq > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={seq} exceeds model.max_seq_len={self.model.max_seq_len}; "
                "lower train.seq_len or raise model.max_seq_len"
            )
        return self

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len
