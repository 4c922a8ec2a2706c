"""The training loop's sections: `train`, `schedule`, `finetune` (which weights train), `checkpoint`,
`stability` and `averaging`."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config.section import Section

_DURATION = re.compile(r"(?:(\d+(?:\.\d*)?)h)?(?:(\d+(?:\.\d*)?)m)?(?:(\d+(?:\.\d*)?)s)?")


def parse_duration(text: str) -> float:
    """Seconds in "300", "90s", "5m", "1h30m", "2.5m"; a ValueError naming the accepted forms otherwise."""
    t = text.strip().lower().replace(" ", "")
    try:
        return float(t)
    except ValueError:
        pass
    m = _DURATION.fullmatch(t)
    if not t or m is None or not any(m.groups()):
        raise ValueError(f"{text!r} is not a duration: give seconds (300) or hours/minutes/seconds such as "
                         "'90s', '5m', '1h30m'")
    h, mins, secs = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mins * 60 + secs


# The suffix of the length keys of each schedule unit: warmup_steps, warmup_tokens, warmup_seconds, ...
UNIT_SUFFIX = {"steps": "steps", "tokens": "tokens", "time": "seconds"}


class ScheduleConfig(Section):
    """The learning-rate schedule. Lengths count optimizer steps (`*_steps` keys), tokens seen
    (`*_tokens` keys) or seconds of training (`*_seconds` keys, against train.max_time), as `unit`
    says; keys of another unit are errors, never silently ignored."""

    name: Literal[
        "cosine", "linear", "constant", "inverse_sqrt", "polynomial", "one_cycle", "wsd", "constant_cooldown"
    ] = Field(
        "cosine", description="Shape after warm-up: cosine, linear or polynomial decay to min_lr_ratio; "
        "constant; inverse_sqrt; one_cycle (torch OneCycleLR); wsd (warmup-stable-decay, as transformers); "
        "constant_cooldown (constant, then a cooldown at the end, Hägele et al. 2024)."
    )
    unit: Literal["steps", "tokens", "time"] = Field(
        "steps", description="What the schedule counts: optimizer steps, tokens seen (stays right when "
        "the batch size ramps up), or seconds of training against the wall-clock budget train.max_time "
        "(the lr at each step follows the time the run has trained so far, so the decay ends when the "
        "budget does)."
    )
    warmup_steps: int | None = Field(
        None, ge=0, description="Linear warm-up steps from 0 to the peak lr (None: 100; one_cycle: none)."
    )
    warmup_tokens: int | None = Field(
        None, ge=0, description="unit=tokens: linear warm-up tokens (0: none; one_cycle: leave unset)."
    )
    warmup_seconds: float | None = Field(
        None, ge=0.0, description="unit=time: linear warm-up over this many seconds of training (0: none; "
        "one_cycle: leave unset)."
    )
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Final lr as a fraction of the peak (cosine, linear, polynomial, "
        "wsd, constant_cooldown)."
    )
    decay_steps: int | None = Field(
        None, ge=1, description="Step at which the decay (one_cycle: the cycle) ends (None: train.max_steps)."
    )
    decay_tokens: int | None = Field(
        None, ge=1, description="unit=tokens: tokens seen when the decay ends (None: all the run's tokens)."
    )
    decay_seconds: float | None = Field(
        None, gt=0.0, description="unit=time: seconds of training when the decay ends (None: train.max_time)."
    )
    power: float = Field(1.0, gt=0.0, description="polynomial: exponent of the decay (1: linear).")
    timescale_steps: int | None = Field(
        None, ge=1, description="inverse_sqrt: lr = peak / sqrt((step - warmup + t) / t) after warm-up "
        "(None: the warm-up length, or 10000 without warm-up)."
    )
    timescale_tokens: int | None = Field(
        None, ge=1, description="unit=tokens: inverse_sqrt timescale in tokens (None: warmup_tokens)."
    )
    timescale_seconds: float | None = Field(
        None, gt=0.0, description="unit=time: inverse_sqrt timescale in seconds (None: warmup_seconds)."
    )
    cooldown_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="wsd/constant_cooldown: the final decay spans this fraction of "
        "the schedule up to its decay end (None: 0.2, unless cooldown_steps/_tokens/_seconds is set)."
    )
    cooldown_steps: int | None = Field(
        None, ge=1, description="wsd/constant_cooldown: the final decay spans this many steps."
    )
    cooldown_tokens: int | None = Field(
        None, ge=1, description="unit=tokens: wsd/constant_cooldown final decay length in tokens."
    )
    cooldown_seconds: float | None = Field(
        None, gt=0.0, description="unit=time: wsd/constant_cooldown final decay length in seconds."
    )
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = Field(
        "1-sqrt", description="wsd/constant_cooldown: shape of the final decay (constant_cooldown: linear "
        "or 1-sqrt)."
    )
    pct_start: float = Field(
        0.3, gt=0.0, lt=1.0, description="one_cycle: fraction of the cycle spent rising to the peak lr."
    )
    div_factor: float = Field(25.0, ge=1.0, description="one_cycle: the cycle starts at peak / div_factor.")
    final_div_factor: float = Field(
        1e4, ge=1.0, description="one_cycle: the cycle ends at peak / (div_factor * final_div_factor)."
    )

    @model_validator(mode="after")
    def _check_combination(self) -> ScheduleConfig:
        own = UNIT_SUFFIX[self.unit]
        for key in ("warmup", "decay", "cooldown", "timescale"):
            for unit, suffix in UNIT_SUFFIX.items():
                if unit != self.unit and getattr(self, f"{key}_{suffix}") is not None:
                    raise ValueError(f"schedule.{key}_{suffix} counts {suffix} but schedule.unit="
                                     f"{self.unit}; use schedule.{key}_{own} or set schedule.unit={unit}")
        warmup, decay = getattr(self, f"warmup_{own}"), getattr(self, f"decay_{own}")
        cooldown = getattr(self, f"cooldown_{own}")
        if self.name == "one_cycle" and warmup:
            raise ValueError(f"schedule.name=one_cycle rises from peak/div_factor over pct_start of the "
                             f"cycle; remove schedule.warmup_{own} (or set it to 0) and tune "
                             "schedule.pct_start")
        if self.unit != "steps" and warmup is None and self.name != "one_cycle":
            raise ValueError(f"schedule.unit={self.unit} needs schedule.warmup_{own} ({own} of linear "
                             "warm-up; 0 for none)")
        if decay is not None and self.name in ("constant", "inverse_sqrt"):
            raise ValueError(f"schedule.name={self.name} never ends a decay; remove schedule.decay_{own}")
        if decay is not None and warmup is not None and decay <= warmup:
            raise ValueError(f"schedule.decay_{own}={decay} must exceed schedule.warmup_{own}={warmup}: "
                             "the decay ends after the warm-up")
        set_cooldown = [k for k in (f"cooldown_{own}", "cooldown_fraction") if getattr(self, k) is not None]
        if set_cooldown and self.name not in ("wsd", "constant_cooldown"):
            raise ValueError(f"schedule.{set_cooldown[0]} applies to name=wsd or constant_cooldown, "
                             f"not {self.name}")
        if len(set_cooldown) == 2:
            raise ValueError(f"set one of schedule.cooldown_{own} and schedule.cooldown_fraction, not both")
        if cooldown is not None and decay is not None and cooldown + (warmup or 0) > decay:
            raise ValueError(f"schedule.cooldown_{own}={cooldown} does not fit between the warm-up "
                             f"({warmup or 0}) and schedule.decay_{own}={decay}; shorten it or raise "
                             f"schedule.decay_{own}")
        if getattr(self, f"timescale_{own}") is not None and self.name != "inverse_sqrt":
            raise ValueError(f"schedule.timescale_{own} applies to name=inverse_sqrt, not {self.name}")
        if (self.name == "inverse_sqrt" and self.unit != "steps" and not warmup
                and getattr(self, f"timescale_{own}") is None):
            raise ValueError(f"schedule.name=inverse_sqrt with unit={self.unit} and no warm-up needs "
                             f"schedule.timescale_{own} (the {own} over which the lr falls to 1/sqrt(2))")
        if self.name == "constant_cooldown" and self.decay_shape == "cosine":
            raise ValueError("schedule.name=constant_cooldown cools down as linear or 1-sqrt; set "
                             "schedule.decay_shape to one of those, or use name=wsd for a cosine decay")
        return self


class TrainConfig(Section):
    max_steps: int = Field(1000, ge=1, description="Optimizer steps to train (derived instead when "
                           "train.epochs or train.max_tokens is set).")
    epochs: int | None = Field(
        None, ge=1, le=1_000_000, description="Train this many passes over the training data instead of "
        "train.max_steps (which is then derived, so the schedule's fractions still apply), validating at "
        "the end of each pass. A weighted mixture's pass is as many windows as its sources hold together."
    )
    max_tokens: int | None = Field(
        None, ge=1, description="Train on this many tokens instead of train.max_steps (which is then "
        "derived: the steps whose tokens reach it). Pretraining objectives only."
    )
    max_time: float | None = Field(
        None, gt=0.0, description="Wall-clock budget of training, in seconds or as '90s', '5m', '1h30m' "
        "(None: none). The run stops before a step that would end past it, saves a checkpoint and runs the "
        "final evaluation; validations, task evaluations and checkpoint saves do not count against it. "
        "train.max_steps still applies (set it high for a run that only the clock ends), and "
        "schedule.unit=time spreads the schedule over the budget."
    )
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward pass.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    seq_len: int | None = Field(None, ge=1, description="Training sequence length (None: model.max_seq_len).")
    grad_clip: float = Field(1.0, ge=0.0, description="Clip gradients to this global norm (0: off).")
    grad_clip_value: float = Field(
        0.0, ge=0.0, description="Clamp every gradient element to [-v, v] before the norm clip (0: off)."
    )
    log_group_stats: bool = Field(
        True, description="Log per-group gradient norms and update/parameter norm ratios at log steps."
    )
    batch_warmup_tokens: int = Field(
        0, ge=0, description="Ramp tokens per optimizer step linearly over this many tokens (0: off)."
    )
    batch_warmup_start_tokens: int | None = Field(
        None, ge=1, description="Tokens per step at the start of the ramp (None: one micro-batch per rank)."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="fp32, bf16/fp16 autocast; auto: bf16 on a GPU that has it; on a CPU, fp32 at "
        "once without bf16 matrix units (AVX512-BF16, AMX, Arm BF16), else a bf16 and an fp32 step timed "
        "within 5 s (or 3% of train.max_time), the verdict cached per machine and shape in ~/.cache/lmforge."
    )
    optimizer_offload: Literal["none", "cpu"] = Field(
        "none", description="cpu: keep the optimizer state in host memory and run the update there (weights "
        "and gradients copied down, weights back up each step); one process or DDP (FSDP: "
        "parallel.cpu_offload). Frees the optimizer state's device memory for step time (optim/offload.py)."
    )
    activation_offload: bool = Field(
        False, description="Move the tensors a training forward saves for its backward to pinned host memory "
        "(torch's save_on_cpu; with activation_checkpointing only the checkpoints' inputs). CUDA only; "
        "trades step time for GPU memory (engine/act_offload.py)."
    )
    fp8: Literal["none", "tensorwise", "rowwise"] = Field(
        "none", description="FP8 training of the transformer blocks' Linear layers with torchao's float8 "
        "recipe of that name (tensorwise: one scale per tensor, fastest; rowwise: one per row, closer to "
        "bf16), under bf16 autocast; CUDA GPUs of compute capability >= 8.9 only, best with train.compile "
        "(engine/fp8.py says what is converted)."
    )
    tf32: bool | None = Field(
        None, description="TensorFloat-32 on CUDA (Ampere and later) for fp32 matmuls and convolutions, "
        "including the fp32 parts of a mixed-precision step: true trades fp32's 23-bit mantissa for 10 bits "
        "in the products for up to ~8x fp32 matmul speed; false forces IEEE fp32; null leaves torch's "
        "defaults (IEEE matmuls, TF32 convolutions). true is refused on a device other than CUDA."
    )
    master_weights: Literal["off", "fp32"] = Field(
        "off", description="fp32: store the matmul weights (Linear weights no embedding shares) in bf16 and "
        "keep fp32 master copies in the optimizer state, which steps them and copies them back as bf16 "
        "(needs precision bf16; one process or DDP: FSDP does this with parallel.param_dtype=bf16)."
    )
    activation_checkpointing: Literal["none", "full", "every_k", "selective"] = Field(
        "none", description="Recompute activations in backward: in no block, every block, every k-th; "
        "selective: in every block, only the cheap ops (matmul and attention outputs are kept)."
    )
    ac_every: int = Field(2, ge=1, description="k for activation_checkpointing=every_k.")
    ac_save: Literal["all_matmuls", "alternate_matmuls"] = Field(
        "all_matmuls", description="activation_checkpointing=selective keeps every matmul's output, or "
        "every second one (torchtitan's rule: less memory, half the matmuls redone)."
    )
    compile: bool = Field(False, description="torch.compile the model.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device (auto: cuda if available).")
    threads: int | Literal["auto"] | None = Field(
        None, description="torch CPU threads (None: torch's default; auto: the fastest of torch's default, "
        "the physical, the logical and half the physical cores, timed on one MLP of the run's shape, cached "
        "per machine and shape in ~/.cache/lmforge; under OMP_NUM_THREADS or torchrun, what those give)."
    )
    keep_host_memory: bool = Field(
        True, description="While training, keep freed host memory for reuse instead of returning it to the "
        "OS (glibc on Linux; elsewhere nothing changes): steps then allocate without page faults (1.0-1.17x "
        "faster CPU steps at bench/host_memory.py's shapes, 1.8x for a d64 two-layer model at 16 x 256 "
        "tokens), and the process holds its peak memory until training ends."
    )
    log_every: int = Field(10, ge=1, description="Log metrics every this many steps.")
    eval_every: int = Field(200, ge=0, description="Validate every this many steps (0: only at the end).")
    eval_batches: int = Field(20, ge=1, description="Validation micro-batches per evaluation.")
    eval_tasks: list[str] = Field(
        default_factory=list, description="Task evaluation at every validation: task files in "
        "lm-evaluation-harness's YAML format, dirs of them, or builtin:code (lmforge eval tasks); the "
        "scores are logged as task/<task>/<metric> (metrics.jsonl, TensorBoard)."
    )
    eval_tasks_limit: float | None = Field(
        200, gt=0, description="Documents per task at each task evaluation (below 1: that fraction of "
        "each task; None: all of them)."
    )
    loss_chunk_tokens: int = Field(
        0, ge=0, description="Compute the output projection and cross-entropy this many tokens at a time, "
        "never holding all (tokens x vocab) logits (0: off; e.g. 4096 saves memory at large vocabularies)."
    )

    sanity_check: Literal["none", "overfit_one_batch"] = Field(
        "none", description="overfit_one_batch: before a fresh run's first step, train "
        "train.sanity_steps steps on its first batch at the peak lr and stop with a diagnosis unless the "
        "loss falls below train.sanity_loss_ratio of its start; then the weights, optimizer, data position "
        "and RNG go back to where they were, so the run itself is the one it would be without the check."
    )
    sanity_steps: int = Field(50, ge=2, le=10000, description="Steps of train.sanity_check.")
    sanity_loss_ratio: float = Field(
        0.5, gt=0.0, lt=1.0, description="train.sanity_check passes when the last step's loss is below this "
        "fraction of the first step's."
    )

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if self.epochs is not None and self.max_tokens is not None:
            raise ValueError(f"train.epochs={self.epochs} and train.max_tokens={self.max_tokens} both decide "
                             "when training ends; set one of them (or train.max_steps)")
        return self

    @model_validator(mode="after")
    def _check_master_weights(self) -> TrainConfig:
        if self.master_weights == "fp32" and self.precision in ("fp32", "fp16"):
            raise ValueError(f"train.master_weights=fp32 stores the weights in bf16 and computes under bf16 "
                             f"autocast; train.precision={self.precision} cannot run it - set "
                             f"train.precision=bf16 (or auto), or train.master_weights=off")
        return self

    @field_validator("max_time", mode="before")
    @classmethod
    def _parse_duration(cls, value: Any) -> Any:
        return parse_duration(value) if isinstance(value, str) else value

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> Any:
        # One message for the whole union (pydantic would name each branch as if it were a key).
        if value is None or value == "auto":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if type(value) is int and value >= 1:
            return value
        raise ValueError("give a number of threads >= 1, 'auto' (measured) or null (torch's default)")


class FinetuneConfig(Section):
    """Which weights train: all of them, or low-rank adapters on a frozen (optionally 4-bit) base."""

    method: Literal["full", "lora", "dora", "qlora"] = Field(
        "full", description="full: every weight; lora: low-rank adapters, base frozen; dora: weight-"
        "decomposed LoRA; qlora: LoRA on a base quantised to NF4 with double quantisation."
    )
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the input of the adapter path.")
    rslora: bool = Field(False, description="Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023).")
    targets: list[str] = Field(
        default_factory=lambda: ["all-linear"], description="Linear layers that get adapters: all-linear, "
        "names (wq, w_down), globs (layers.*.attn.wq) or Hugging Face names (q_proj, down_proj)."
    )
    quant_blocksize: int = Field(64, ge=16, description="qlora: weights per NF4 quantisation block.")
    train_tokens: list[int] = Field(
        default_factory=list, description="Token ids whose embedding (and untied output) rows train beside "
        "the adapters (PEFT's trainable_token_indices); a chat template's added tokens are put here."
    )
    init_adapter: str | None = Field(
        None, description="Start from these adapters (a PEFT adapter dir: adapter_config.json + "
        "adapter_model.safetensors) instead of fresh ones; r, alpha and targets then come from it."
    )


class CheckpointConfig(Section):
    every: int = Field(500, ge=0, description="Save a checkpoint every this many steps (0: only at the end).")
    keep_last: int = Field(3, ge=1, description="Keep this many most recent checkpoints.")
    save_final: bool = Field(True, description="Save a checkpoint when training ends.")
    keep_best: bool = Field(
        False, description="Also keep the checkpoint with the lowest validation loss (checkpoints/best)."
    )


class StabilityConfig(Section):
    max_nonfinite: int = Field(
        5, ge=1, description="Stop (with a checkpoint) after this many consecutive steps with NaN/Inf "
        "loss or gradients; each one is skipped, never applied."
    )
    spike_detection: bool = Field(False, description="Detect loss spikes (robust z-score) and recover.")
    spike_window: int = Field(
        50, ge=5, description="Trailing steps the median/MAD of the loss is taken over."
    )
    spike_min_history: int = Field(20, ge=3, description="Steps of history before spikes are judged.")
    spike_z: float = Field(
        6.0, gt=0.0, description="Robust z-score (0.6745*(x-median)/MAD) that counts as a spike."
    )
    spike_action: Literal["rollback", "skip", "log"] = Field(
        "rollback", description="rollback: reload the last good checkpoint and skip the data since; "
        "skip: drop this update only; log: record the event and go on."
    )
    spike_lr_factor: float = Field(
        1.0, gt=0.0, le=1.0, description="Multiply the lr by this after each recovery (1: unchanged)."
    )
    spike_max_recoveries: int = Field(
        5, ge=0, description="Give up (stop with an error) after this many recoveries."
    )
    early_stopping_patience: int = Field(
        0, ge=0, description="Stop when val_loss has not improved for this many evaluations (0: off)."
    )
    early_stopping_min_delta: float = Field(
        0.0, ge=0.0, description="Improvement that counts for early stopping."
    )


class AveragingConfig(Section):
    ema: bool = Field(False, description="Keep an exponential moving average of the weights.")
    ema_decay: float = Field(0.999, gt=0.0, lt=1.0, description="EMA decay per update.")
    ema_every: int = Field(1, ge=1, description="Update the EMA every this many steps.")
    swa: bool = Field(False, description="Keep a stochastic weight average (equal-weight mean of snapshots).")
    swa_start: int = Field(0, ge=0, description="First step that enters the SWA mean.")
    swa_every: int = Field(10, ge=1, description="Add a snapshot to the SWA mean every this many steps.")
    eval_averaged: bool = Field(
        True, description="Also report val loss of the EMA/SWA weights at each evaluation."
    )
