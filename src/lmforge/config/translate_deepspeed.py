"""A DeepSpeed ds_config.json -> lmforge config keys, with every key that does not map and why.

Semantics are DeepSpeed's documented ones (deepspeed.ai/docs/config-json, deepspeed/runtime/lr_schedules.py):
- ZeRO stage 0 is plain data parallelism (lmforge: DDP, parallel.dp_replicate = world, dp_shard = 1);
  stages 1, 2, 3 shard optimizer state / + gradients / + parameters (lmforge: parallel.zero 1, 2, 3; 1 is
  DDP + ZeroRedundancyOptimizer, 2 and 3 are FSDP2). On one process every stage is the same run.
- train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size; given two,
  DeepSpeed derives the third, and so does this translator; all three that disagree are an error.
- The optimizer type "Adam" is AdamW unless params.adam_w_mode is false (DeepSpeed's FusedAdam/CPUAdam
  default to decoupled decay).
- WarmupLR warms up to warmup_max_lr and stays there; WarmupDecayLR then decays linearly to warmup_min_lr at
  total_num_steps; WarmupCosineLR warms up to the optimizer's lr and decays by a cosine to cos_min_ratio x lr.
  lmforge warms up linearly from 0: warmup_type "log" and a non-zero warmup start are noted as unmapped.
- "auto" (a value HF's Trainer fills from its TrainingArguments) is taken from those when they are given
  (translate_hf.py), else lmforge's default is kept; either way the key is listed with the reason.
"""

from __future__ import annotations

from typing import Any

from lmforge.config.translate import Translation, is_number
from lmforge.errors import ConfigError

# Keys that tune DeepSpeed's own machinery and have no lmforge counterpart: key -> why.
NO_COUNTERPART: dict[str, str] = {
    "wall_clock_breakdown": "DeepSpeed's timers; lmforge logs step time and throughput always",
    "dump_state": "DeepSpeed debug output",
    "prescale_gradients": "lmforge averages gradients in the reduce (FSDP2/DDP's own scaling)",
    "gradient_predivide_factor": "lmforge averages gradients in the reduce (FSDP2/DDP's own scaling)",
    "sparse_gradients": "lmforge has no sparse-gradient all-reduce",
    "amp": "NVIDIA apex AMP; lmforge uses torch autocast (train.precision)",
    "zero_allow_untested_optimizer": "lmforge's optimizers all work with every parallel.zero",
    "zero_force_ds_cpu_optimizer": "DeepSpeed's CPU Adam; lmforge has no CPU optimizer kernel of its own",
    "flops_profiler": "lmforge logs MFU from its own FLOP count",
    "activation_checkpointing": "DeepSpeed's checkpointing API for its own model code; set "
    "train.activation_checkpointing (none/full/every_k/selective) instead",
    "comms_logger": "DeepSpeed communication logging",
    "compression_training": "DeepSpeed Compression; see `lmforge quantize` and `lmforge prune`",
    "data_efficiency": "DeepSpeed's curriculum / data routing",
    "curriculum_learning": "DeepSpeed's curriculum / data routing",
    "elasticity": "DeepSpeed elastic batch sizes",
    "autotuning": "DeepSpeed autotuner; see `lmforge estimate`",
    "aio": "NVMe offload I/O; lmforge has no NVMe offload",
    "pipeline": "DeepSpeed's pipeline engine; set parallel.pp and parallel.pp_schedule",
    "csv_monitor": "lmforge writes metrics.jsonl in every run dir",
    "comet": "no Comet integration (lmforge: TensorBoard, MLflow, W&B)",
    "checkpoint": "DeepSpeed checkpoint layout; lmforge writes DCP checkpoints (checkpoint.*)",
    "data_types": "gradient accumulation dtype: lmforge accumulates in the parameter dtype",
    "memory_breakdown": "DeepSpeed memory logging; see `lmforge estimate`",
}

# zero_optimization's tuning keys: DeepSpeed's buckets and prefetch; FSDP2 sizes its own.
ZERO_TUNING = {
    "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
    "allgather_partitions", "reduce_scatter", "round_robin_gradients", "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "elastic_checkpoint", "ignore_unused_parameters", "legacy_stage1", "load_from_fp32_weights",
    "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory", "zero_hpz_partition_size",
    "zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear", "use_multi_rank_bucket_allreduce", "stage3_module_granularity_threshold",
}
FSDP_TUNING = "DeepSpeed's bucket/prefetch tuning; FSDP2 sizes its own all-gathers and reduce-scatters"

# fp16 loss-scaler settings: lmforge scales dynamically with torch's GradScaler (starts at 2^16, halves on
# an overflow, doubles after 2000 clean steps) and has no keys for these.
LOSS_SCALE = {
    "loss_scale": "lmforge's fp16 loss scale is always dynamic (0 here means dynamic too)",
    "initial_scale_power": "lmforge's scaler starts at 2^16 (torch GradScaler); no key",
    "loss_scale_window": "lmforge's scaler doubles after 2000 clean steps (torch GradScaler); no key",
    "hysteresis": "lmforge's scaler halves on every overflow (no hysteresis)",
    "consecutive_hysteresis": "lmforge's scaler halves on every overflow (no hysteresis)",
    "min_loss_scale": "lmforge's scaler has no floor key",
    "auto_cast": "lmforge always autocasts (train.precision)",
    "fp16_master_weights_and_grads": "lmforge keeps fp32 weights under autocast",
}
LOSS_SCALE_DEFAULTS = {"loss_scale": 0, "initial_scale_power": 16, "min_loss_scale": 1, "auto_cast": False}

# DeepSpeed optimizer type (case-insensitive) -> lmforge optim.name; the rest are refused by name.
OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "cpuadam": "adamw", "fusedadam": "adamw", "lion": "lion",
              "sgd": "sgd", "adafactor": "adafactor"}
NO_OPTIMIZER = "lmforge has no {t} (optimizers: adamw, adam, sgd, lion, adafactor, adamw8bit, sophia, muon)"

AUTO = "auto: left to lmforge's default ({key}), or set from the TrainingArguments given with it"


def _world(world_size: int | None) -> int:
    return world_size if world_size and world_size > 0 else 1


def _num(t: Translation, key: str, value: Any, target: str, kind: type = float) -> None:
    """Map a number (or skip "auto"), refusing a non-number with both keys named."""
    if value == "auto":
        t.skip(key, value, AUTO.format(key=target))
        return
    if not is_number(value):
        raise ConfigError(f"{t.source}: {key}={value!r} is not a number (lmforge {target}); give a number "
                          "or \"auto\"")
    if kind is int:
        if float(value) != int(value):
            raise ConfigError(f"{t.source}: {key}={value!r} must be a whole number (lmforge {target})")
        value = int(value)
    t.set(target, value, key)


def _section(t: Translation, data: dict, key: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{t.source}: {key} must be an object of keys, got {type(value).__name__}")
    return value


def translate_deepspeed(data: dict[str, Any], source: str, world_size: int | None = None) -> Translation:
    """The lmforge keys a ds_config maps to; `world_size` (processes; None: 1) checks the batch sizes
    and lays out ZeRO stage 0."""
    t = Translation(source)
    world = _world(world_size)
    for key, value in data.items():
        if key in NO_COUNTERPART:
            t.skip(key, value, NO_COUNTERPART[key])
        elif key not in HANDLED:
            t.skip(key, value, "not a DeepSpeed key lmforge knows")
    _precision(t, data)
    _zero(t, _section(t, data, "zero_optimization"), world)
    _batch(t, data, world)
    if "gradient_clipping" in data:
        _num(t, "gradient_clipping", data["gradient_clipping"], "train.grad_clip")
    if "steps_per_print" in data:
        _num(t, "steps_per_print", data["steps_per_print"], "train.log_every", int)
    if "communication_data_type" in data:
        dtype = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}.get(
            str(data["communication_data_type"]).lower())
        if dtype:
            t.set("parallel.reduce_dtype", dtype, "communication_data_type")
        else:
            t.skip("communication_data_type", data["communication_data_type"],
                   "lmforge reduces gradients in fp32 or bf16 (parallel.reduce_dtype)")
    for tool, target in (("tensorboard", "logging.tensorboard"), ("wandb", "logging.wandb.enabled")):
        sec = _section(t, data, tool)
        for k, v in sec.items():
            if k == "enabled" and isinstance(v, bool):
                t.set(target, v, f"{tool}.enabled")
            elif tool == "wandb" and k == "project" and isinstance(v, str):
                t.set("logging.wandb.project", v, "wandb.project")
            else:
                t.skip(f"{tool}.{k}", v, "lmforge writes its logs into the run dir (run.dir)")
    _optimizer(t, _section(t, data, "optimizer"))
    _scheduler(t, _section(t, data, "scheduler"))
    return t


HANDLED = {
    "fp16", "bf16", "bfloat16", "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps", "gradient_clipping", "steps_per_print", "communication_data_type",
    "tensorboard", "wandb", "optimizer", "scheduler",
}


def _precision(t: Translation, data: dict) -> None:
    on = {}
    for name in ("fp16", "bf16", "bfloat16"):
        sec = _section(t, data, name)
        for k, v in sec.items():
            if k == "enabled":
                if v == "auto":
                    t.skip(f"{name}.enabled", v, AUTO.format(key="train.precision"))
                elif not isinstance(v, bool):
                    raise ConfigError(f"{t.source}: {name}.enabled={v!r} must be true, false or \"auto\"")
                elif v:
                    on[name] = True
            elif name == "fp16" and k in LOSS_SCALE:
                if LOSS_SCALE_DEFAULTS.get(k, object()) != v:
                    t.skip(f"fp16.{k}", v, LOSS_SCALE[k])
            elif name != "fp16" and k == "immediate_grad_update":
                t.skip(f"{name}.{k}", v, "lmforge applies the update once per step")
            else:
                t.skip(f"{name}.{k}", v, "not a DeepSpeed precision key lmforge knows")
    if "fp16" in on and ("bf16" in on or "bfloat16" in on):
        raise ConfigError(f"{t.source}: fp16.enabled and bf16.enabled are both true; a run has one "
                          "precision, enable one")
    if on:
        name = "fp16" if "fp16" in on else "bf16"
        t.set("train.precision", name, f"{'fp16' if name == 'fp16' else next(iter(on))}.enabled")


def _offload(t: Translation, key: str, sec: Any, stage: int | None) -> bool:
    if not isinstance(sec, dict):
        raise ConfigError(f"{t.source}: zero_optimization.{key} must be an object, got {type(sec).__name__}")
    device = sec.get("device", "none")
    for k, v in sec.items():
        if k != "device":
            t.skip(f"zero_optimization.{key}.{k}", v, "lmforge's FSDP offload takes no tuning keys")
    if device in (None, "none"):
        return False
    if device == "nvme":
        t.skip(f"zero_optimization.{key}.device", device, "lmforge has no NVMe offload")
        return False
    if device != "cpu":
        raise ConfigError(f"{t.source}: zero_optimization.{key}.device={device!r}: DeepSpeed takes cpu, nvme "
                          "or none")
    if stage in (None, 0) and key == "offload_optimizer":
        # no partitioning: every rank a replica, its optimizer state and update in host memory
        t.set("train.optimizer_offload", "cpu", f"zero_optimization.{key}.device")
        return False
    if stage != 3:
        t.skip(f"zero_optimization.{key}.device", device, "lmforge offloads the optimizer to CPU without "
               "partitioning (ZeRO stage 0: train.optimizer_offload=cpu) or with FSDP (stage 3, "
               "parallel.cpu_offload, which keeps params, grads and optimizer state there); not with "
               "stages 1-2, and parameters only with stage 3")
        return False
    return True


def _zero(t: Translation, zero: dict, world: int) -> None:
    stage = zero.get("stage")
    if stage is not None:
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ConfigError(f"{t.source}: zero_optimization.stage={stage!r}: DeepSpeed's stages are 0, 1, "
                              "2, 3")
        if stage == 0:  # plain data parallelism: every rank a replica
            t.set("parallel.dp_replicate", world, "zero_optimization.stage")
            t.set("parallel.dp_shard", 1, "zero_optimization.stage")
        else:
            t.set("parallel.zero", stage, "zero_optimization.stage")
    offload = False
    for key in ("offload_optimizer", "offload_param"):
        if key in zero:
            offload = _offload(t, key, zero[key], stage) or offload
    if offload:
        t.set("parallel.cpu_offload", True, "zero_optimization.offload_optimizer/offload_param")
    for k, v in zero.items():
        if k in ("stage", "offload_optimizer", "offload_param"):
            continue
        t.skip(f"zero_optimization.{k}", v, FSDP_TUNING if k in ZERO_TUNING else
               "not a zero_optimization key lmforge knows")


def _batch(t: Translation, data: dict, world: int) -> None:
    got, auto = {}, []
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key not in data:
            continue
        v = data[key]
        if v == "auto":
            auto.append(key)
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{t.source}: {key}={v!r} must be a whole number >= 1 or \"auto\"")
        else:
            got[key] = v
    tbs, micro, accum = (got.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                              "gradient_accumulation_steps"))
    if tbs is not None and micro is not None and accum is not None:
        if tbs != micro * accum * world:
            raise ConfigError(f"{t.source}: train_batch_size={tbs} but train_micro_batch_size_per_gpu="
                              f"{micro} x gradient_accumulation_steps={accum} x {world} processes = "
                              f"{micro * accum * world}; DeepSpeed requires them equal (fix one, or drop "
                              "train_batch_size)")
    elif tbs is not None and micro is not None:
        accum = _derive(t, tbs, micro * world, "gradient_accumulation_steps", "train_batch_size", world)
    elif tbs is not None and accum is not None:
        micro = _derive(t, tbs, accum * world, "train_micro_batch_size_per_gpu", "train_batch_size", world)
    elif tbs is not None:
        micro, accum = _derive(t, tbs, world, "train_micro_batch_size_per_gpu", "train_batch_size", world), 1
    micro_key, accum_key = "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
    if micro is not None:
        t.set("train.micro_batch_size", micro, micro_key if micro_key in got else "train_batch_size")
    if accum is not None:
        t.set("train.grad_accum_steps", accum, accum_key if accum_key in got else "train_batch_size")
    targets = {"train_batch_size": "micro x accumulation x world", micro_key: "train.micro_batch_size",
               accum_key: "train.grad_accum_steps"}
    for key in auto:
        derived = (key == micro_key and micro is not None) or (key == accum_key and accum is not None)
        t.skip(key, "auto", f"auto: derived from train_batch_size ({targets[key]})" if derived
               else AUTO.format(key=targets[key]))


def _derive(t: Translation, total: int, per: int, key: str, from_key: str, world: int) -> int:
    if total % per:
        raise ConfigError(f"{t.source}: {from_key}={total} is not a multiple of {per} (the other batch keys "
                          f"x {world} processes), so {key} cannot be derived; give all three")
    return total // per


def _optimizer(t: Translation, opt: dict) -> None:
    if not opt:
        return
    kind = opt.get("type")
    params = opt.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"{t.source}: optimizer.params must be an object, got {type(params).__name__}")
    for k, v in opt.items():
        if k not in ("type", "params"):
            t.skip(f"optimizer.{k}", v, "not a DeepSpeed optimizer key lmforge knows")
    name = OPTIMIZERS.get(str(kind).lower())
    if name is None:
        t.skip("optimizer.type", kind, NO_OPTIMIZER.format(t=kind))
        for k, v in params.items():
            t.skip(f"optimizer.params.{k}", v, f"belongs to optimizer {kind}, which did not map")
        return
    if name == "adamw" and params.get("adam_w_mode") is False:
        name = "adam"  # DeepSpeed's Adam with adam_w_mode false is L2-coupled Adam
    t.set("optim.name", name, "optimizer.type")
    betas = [None, None]
    for k, v in params.items():
        key = f"optimizer.params.{k}"
        if k == "lr":
            _num(t, key, v, "optim.lr")
        elif k == "weight_decay":
            _num(t, key, v, "optim.weight_decay")
        elif k == "eps" and name in ("adamw", "adam"):
            _num(t, key, v, "optim.eps")
        elif k == "betas" and name in ("adamw", "adam", "lion"):
            if v == "auto":
                t.skip(key, v, AUTO.format(key="optim.betas"))
            elif not (isinstance(v, list) and len(v) == 2):
                raise ConfigError(f"{t.source}: {key}={v!r} must be two numbers [beta1, beta2] (lmforge "
                                  "optim.betas)")
            else:
                betas = list(v)
        elif k == "momentum" and name == "sgd":
            _num(t, key, v, "optim.sgd.momentum")
        elif k == "nesterov" and name == "sgd":
            t.set("optim.sgd.nesterov", v, key)
        elif k in ("adam_w_mode", "torch_adam", "fused", "bias_correction", "amsgrad") and name in (
                "adamw", "adam"):
            if k == "amsgrad" and v:
                t.skip(key, v, "lmforge's AdamW has no AMSGrad")
            elif k == "bias_correction" and v is False:
                t.skip(key, v, "lmforge's Adam always corrects the bias")
            elif k in ("torch_adam", "fused"):
                t.skip(key, v, "kernel choice: lmforge picks torch's fused AdamW where the device has one")
        else:
            t.skip(key, v, f"lmforge's {name} takes no {k}")
    if betas != [None, None]:
        t.set("optim.betas", betas, "optimizer.params.betas")
    if name == "sgd" and "momentum" not in params:
        t.set("optim.sgd.momentum", 0.0, "optimizer.type")  # torch.optim.SGD's default, not lmforge's 0.9


def _scheduler(t: Translation, sch: dict) -> None:
    if not sch:
        return
    kind = sch.get("type")
    params = sch.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"{t.source}: scheduler.params must be an object, got {type(params).__name__}")
    for k, v in sch.items():
        if k not in ("type", "params"):
            t.skip(f"scheduler.{k}", v, "not a DeepSpeed scheduler key lmforge knows")
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        why = ("use `lmforge lr-find` for an lr range test" if kind == "LRRangeTest" else
               f"lmforge has no {kind} schedule (translated: WarmupLR, WarmupDecayLR, WarmupCosineLR)")
        t.skip("scheduler.type", kind, why)
        for k, v in params.items():
            t.skip(f"scheduler.params.{k}", v, f"belongs to scheduler {kind}, which did not map")
        return
    name = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}[kind]
    t.set("schedule.name", name, "scheduler.type")
    t.set("schedule.warmup_steps", 1000, "scheduler.type")  # DeepSpeed's default warmup_num_steps
    if kind == "WarmupDecayLR":
        t.set("schedule.min_lr_ratio", 0.0, "scheduler.type")  # decays to warmup_min_lr (default 0)
    if kind == "WarmupCosineLR":
        t.set("schedule.min_lr_ratio", 0.0001, "scheduler.type")  # DeepSpeed's default cos_min_ratio
    for k, v in params.items():
        key = f"scheduler.params.{k}"
        if k == "warmup_num_steps":
            _num(t, key, v, "schedule.warmup_steps", int)
        elif k == "total_num_steps" and kind != "WarmupLR":
            _num(t, key, v, "schedule.decay_steps", int)
        elif k == "warmup_max_lr" and kind != "WarmupCosineLR":
            if "optim.lr" in t.values and t.values["optim.lr"][0] != v:
                t.skip("optimizer.params.lr", t.values["optim.lr"][0], f"DeepSpeed's {kind} sets the peak lr "
                       "to scheduler.params.warmup_max_lr instead")
            _num(t, key, v, "optim.lr")  # DeepSpeed's Warmup(Decay)LR sets the peak lr, whatever optimizer.lr
        elif k == "cos_min_ratio" and kind == "WarmupCosineLR":
            _num(t, key, v, "schedule.min_lr_ratio")
        elif k == "warmup_type":
            if v != "linear":
                t.skip(key, v, "lmforge warms up linearly (DeepSpeed's default is log)")
        elif k in ("warmup_min_lr", "warmup_min_ratio"):
            if v not in (0, 0.0):
                t.skip(key, v, "lmforge warms up from 0")
        elif k == "last_batch_iteration":
            t.skip(key, v, "lmforge resumes the schedule from its checkpoint")
        else:
            t.skip(key, v, f"{kind} takes no {k}")
    if "warmup_type" not in params:  # the default of all three (deepspeed/runtime/lr_schedules.py)
        t.skip("scheduler.params.warmup_type", "log", "DeepSpeed's default log warm-up; lmforge warms up "
               "linearly")
    if kind == "WarmupDecayLR":
        lo, hi = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", 0.001)
        if "warmup_max_lr" not in params:
            t.set("optim.lr", 0.001, "scheduler.type")  # DeepSpeed's default warmup_max_lr
        if is_number(lo) and is_number(hi) and hi > 0 and lo:
            t.set("schedule.min_lr_ratio", lo / hi, "scheduler.params.warmup_min_lr")
    # WarmupLR without warmup_max_lr warms up to the optimizer's lr (DeepSpeed's lr_schedules.py today):
    # optim.lr stays what the optimizer section says
