"""Hugging Face TrainingArguments (a JSON as `TrainingArguments.to_json_string()` writes it, or a YAML of the
same fields) -> lmforge config keys, with every field that does not map and why.

Semantics are TrainingArguments' documented ones (transformers/training_args.py, optimization.py):
- HF's schedules decay to 0 (linear, cosine) or to lr_end (polynomial); lmforge decays to
  schedule.min_lr_ratio x lr, so the translation sets that ratio. The warm-up is linear from 0 in both.
- warmup_steps, logging_steps, eval_steps and save_steps below 1 are fractions of the total steps (HF
  rounds up); warmup_ratio is the older name of the fraction. The total is max_steps; when the
  arguments train by epochs (max_steps <= 0) num_train_epochs maps to train.epochs, lmforge derives the
  steps from the data at the start of the run, and such fractions are listed as not mapped (a fractional
  num_train_epochs does not map: lmforge trains whole passes; the config's train.max_steps counts then).
- "adamw_torch" / "adamw_torch_fused" are torch's AdamW, "sgd" torch's SGD (no momentum), "adafactor" HF's
  Adafactor with relative_step=False, scale_parameter=False, warmup_init=False (lmforge's defaults too).
- weight_decay: HF skips biases and LayerNorm weights; lmforge also skips embeddings.
- A field absent from the file keeps lmforge's default, not TrainingArguments' (to_json_string() writes
  every field, so a dump is translated whole).
- deepspeed (a path or an object) is translated too (translate_deepspeed.py); its "auto" values are the
  ones set here, and a DeepSpeed value that differs from the one here is a contradiction, as in HF's Trainer.
"""

from __future__ import annotations

import math
from typing import Any

from lmforge.config.translate import Translation, is_number, read_mapping
from lmforge.config.translate_deepspeed import translate_deepspeed
from lmforge.errors import ConfigError

# lr_scheduler_type -> (schedule.name, min_lr_ratio); the ratio None is taken from lr_scheduler_kwargs.
SCHEDULES: dict[str, tuple[str, float | None]] = {
    "linear": ("linear", 0.0), "cosine": ("cosine", 0.0), "constant": ("constant", None),
    "constant_with_warmup": ("constant", None), "inverse_sqrt": ("inverse_sqrt", None),
    "polynomial": ("polynomial", None), "cosine_with_min_lr": ("cosine", None),
    "warmup_stable_decay": ("wsd", None),
}
NO_SCHEDULE = {
    "cosine_with_restarts": "lmforge has no restarting cosine (one cosine: lr_scheduler_type=cosine)",
    "reduce_lr_on_plateau": "lmforge's schedules are fixed in advance; it has no plateau schedule",
    "cosine_warmup_with_min_lr": "lmforge warms up from 0 (cosine_with_min_lr maps)",
    "greedy": "lmforge has no greedy lr schedule",
}

# optim -> (optim.name, extra lmforge keys)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw_torch": ("adamw", {"optim.fused": False}), "adamw_torch_fused": ("adamw", {"optim.fused": True}),
    "adamw_hf": ("adamw", {}), "adamw_bnb_8bit": ("adamw8bit", {}), "adamw_8bit": ("adamw8bit", {}),
    "adamw_torch_8bit": ("adamw8bit", {"optim.adamw8bit.backend": "torch"}),
    "lion_32bit": ("lion", {}), "adafactor": ("adafactor", {}), "sgd": ("sgd", {"optim.sgd.momentum": 0.0}),
}

# TrainingArguments fields with no lmforge counterpart that matters to a run, by prefix -> why.
NO_COUNTERPART_PREFIX = {
    "hub_": "Hub upload: `lmforge export` writes an HF model dir", "push_to_hub": "Hub upload: `lmforge "
    "export` writes an HF model dir", "dataloader_": "lmforge's loaders read memory-mapped shards in the "
    "training process", "ddp_": "lmforge sets up DDP/FSDP itself (parallel.*)", "fsdp": "use parallel.* "
    "(parallel.zero=3 is FSDP2)", "eval_": "evaluation details: lmforge validates with train.eval_batches",
    "per_device_eval_batch_size": "lmforge's validation uses train.micro_batch_size",
    "logging_": "lmforge writes metrics.jsonl into run.dir", "save_": "lmforge checkpoints are DCP "
    "(checkpoint.*)", "torch_compile_": "lmforge compiles with torch.compile's defaults (train.compile)",
    "use_": "a Trainer device or kernel switch lmforge chooses itself", "label_": "model-side label settings",
}
NO_COUNTERPART = {
    "label_smoothing_factor": "lmforge's cross-entropy has no label smoothing",
    "neftune_noise_alpha": "lmforge has no NEFTune embedding noise",
    "data_seed": "lmforge's data order follows run.seed",
    "use_cpu": "set train.device: cpu",
}
DEFAULT_REASON = "no lmforge counterpart (a Trainer setting)"


def _ratio_steps(t: Translation, key: str, value: Any, total: int | None, target: str, *,
                 zero_ok: bool) -> None:
    if not is_number(value) or value < 0:
        raise ConfigError(f"{t.source}: {key}={value!r} must be a number >= 0 (lmforge {target})")
    if 0 < value < 1:  # a fraction of the total steps, rounded up (TrainingArguments' rule)
        if total is None:
            t.skip(key, value, "a fraction of the total steps, which are not known (max_steps=-1)")
            return
        value = math.ceil(total * value)
    if value == 0 and not zero_ok:
        t.skip(key, value, "0 is not a step interval")
        return
    t.set(target, int(value), key)


def translate_hf_args(data: dict[str, Any], source: str, world_size: int | None = None,
                      max_steps: int | None = None) -> Translation:
    """The lmforge keys a TrainingArguments dump maps to. `max_steps` (the lmforge config's
    train.max_steps) resolves fractions of the run when the arguments train by epochs."""
    t = Translation(source)
    d = dict(data)
    handled: set[str] = set()

    def take(key: str) -> Any:
        handled.add(key)
        return d.get(key)

    def number(key: str, target: str, kind: type = float) -> None:
        v = take(key)
        if v is None:
            return
        if not is_number(v) or (kind is int and v != int(v)):
            raise ConfigError(f"{source}: {key}={v!r} is not a {'whole ' if kind is int else ''}number "
                              f"(lmforge {target})")
        t.set(target, int(v) if kind is int else v, key)

    number("per_device_train_batch_size", "train.micro_batch_size", int)
    number("gradient_accumulation_steps", "train.grad_accum_steps", int)
    number("learning_rate", "optim.lr")
    number("weight_decay", "optim.weight_decay")
    number("seed", "run.seed", int)
    steps = take("max_steps")
    total = max_steps
    if steps is not None and not (is_number(steps) and steps == int(steps)):
        raise ConfigError(f"{source}: max_steps={steps!r} is not a whole number (lmforge train.max_steps)")
    if steps is not None and steps > 0:
        steps = int(steps)
        t.set("train.max_steps", steps, "max_steps")
        total = steps
    epochs = take("num_train_epochs")
    whole = epochs is not None and is_number(epochs) and epochs >= 1 and epochs == int(epochs)
    if steps is not None and steps > 0:
        if epochs is not None:
            t.skip("num_train_epochs", epochs, "max_steps overrides it (TrainingArguments' rule)")
    elif whole:
        # max_steps <= 0 (or absent): TrainingArguments trains num_train_epochs passes. lmforge derives
        # train.max_steps from train.epochs once the data is loaded, so fractions of the run given in
        # steps (warmup_ratio, eval_steps < 1, ...) cannot be resolved here.
        t.set("train.epochs", int(epochs), "num_train_epochs")
        total = None
    else:
        if steps is not None:
            t.skip("max_steps", steps, "-1: train by epochs (num_train_epochs), but no whole number of "
                   f"epochs is given; train.max_steps ({max_steps}) counts the run")
        if epochs is not None:
            t.skip("num_train_epochs", epochs, "lmforge trains whole passes (train.epochs, a whole number "
                   f">= 1): set train.epochs, or train.max_steps ({max_steps}) counts the run")
    number("max_grad_norm", "train.grad_clip")  # 0 turns clipping off in both
    _optimizer(t, d, take)
    _schedule(t, d, take, total)
    _precision(t, d, take)
    _intervals(t, d, take, total)
    for key in ("gradient_checkpointing", "activation_checkpointing"):  # transformers 5 renamed it
        gc = take(key)
        if gc is not None:
            t.set("train.activation_checkpointing", "full" if gc else "none", key)
    number("ddp_timeout", "parallel.timeout_s", int)
    if take("torch_compile") is not None:
        t.set("train.compile", bool(d["torch_compile"]), "torch_compile")
    for key, target in (("output_dir", "run.dir"), ("run_name", "run.name")):
        if take(key) is not None:
            t.set(target, str(d[key]), key)
    _report_to(t, take("report_to"))
    ds = take("deepspeed")
    for key, value in d.items():
        if key in handled:
            continue
        why = NO_COUNTERPART.get(key) or next(
            (w for p, w in NO_COUNTERPART_PREFIX.items() if key.startswith(p)), DEFAULT_REASON)
        t.skip(key, value, why)
    if ds:
        if isinstance(ds, str):
            ds_t = translate_deepspeed(read_mapping(ds, "DeepSpeed config"), ds, world_size)
        elif isinstance(ds, dict):
            ds_t = translate_deepspeed(ds, f"{source}: deepspeed", world_size)
        else:
            raise ConfigError(f"{source}: deepspeed={ds!r} must be a path to a ds_config.json or an object")
        t.merge(ds_t)
    return t


def _optimizer(t: Translation, d: dict, take) -> None:
    opt = take("optim")
    name = None
    if opt is not None:
        if str(opt) not in OPTIMIZERS:
            t.skip("optim", opt, f"lmforge has no {opt} (translated: {', '.join(OPTIMIZERS)})")
        else:
            name, extra = OPTIMIZERS[str(opt)]
            t.set("optim.name", name, "optim")
            for k, v in extra.items():
                t.set(k, v, "optim")
    b1, b2, eps = take("adam_beta1"), take("adam_beta2"), take("adam_epsilon")
    if take("optim_args"):
        t.skip("optim_args", d["optim_args"], "extra optimizer arguments: set lmforge's optim.* keys")
    if name in (None, "adamw", "adamw8bit", "lion"):  # betas belong to the Adam family and Lion
        if b1 is not None or b2 is not None:
            t.set("optim.betas", [0.9 if b1 is None else b1, 0.999 if b2 is None else b2],
                  "adam_beta1/adam_beta2")
        if eps is not None and name != "lion":
            t.set("optim.eps", eps, "adam_epsilon")
        elif eps is not None:
            t.skip("adam_epsilon", eps, "lmforge's lion takes no eps")
    else:
        for k, v in (("adam_beta1", b1), ("adam_beta2", b2), ("adam_epsilon", eps)):
            if v is not None:
                t.skip(k, v, f"optim={opt} does not use it")


def _schedule(t: Translation, d: dict, take, total: int | None) -> None:
    kind = take("lr_scheduler_type")
    kwargs = take("lr_scheduler_kwargs") or {}
    if isinstance(kwargs, str):
        import json

        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            raise ConfigError(f"{t.source}: lr_scheduler_kwargs={kwargs!r} is not a JSON object") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{t.source}: lr_scheduler_kwargs must be an object, got {type(kwargs).__name__}")
    warm = take("warmup_steps")
    ratio = take("warmup_ratio")
    if warm:
        _ratio_steps(t, "warmup_steps", warm, total, "schedule.warmup_steps", zero_ok=True)
    elif ratio:
        if is_number(ratio) and ratio >= 1:
            raise ConfigError(f"{t.source}: warmup_ratio={ratio!r} must be below 1 (a fraction of the run)")
        _ratio_steps(t, "warmup_ratio", ratio, total, "schedule.warmup_steps", zero_ok=True)
    elif kind is not None or warm is not None:
        t.set("schedule.warmup_steps", 0, "warmup_steps")  # HF's default is none; lmforge's is 100
    if kind is None:
        return
    if not isinstance(kind, str):
        raise ConfigError(f"{t.source}: lr_scheduler_type={kind!r} is not a scheduler name")
    if kind not in SCHEDULES:
        t.skip("lr_scheduler_type", kind, NO_SCHEDULE.get(kind, f"lmforge has no {kind} schedule"))
        for k, v in kwargs.items():
            t.skip(f"lr_scheduler_kwargs.{k}", v, f"belongs to {kind}, which did not map")
        return
    name, floor = SCHEDULES[kind]
    t.set("schedule.name", name, "lr_scheduler_type")
    if kind == "constant":
        t.set("schedule.warmup_steps", 0, "lr_scheduler_type")  # HF's constant never warms up
    if floor is not None:
        t.set("schedule.min_lr_ratio", floor, "lr_scheduler_type")
    lr = d.get("learning_rate", 5e-5)
    if not (is_number(lr) and lr > 0):  # HF's absolute lr floors become ratios of it
        raise ConfigError(f"{t.source}: learning_rate={lr!r} must be a number above 0 (lmforge optim.lr)")
    for k, v in kwargs.items():
        key = f"lr_scheduler_kwargs.{k}"
        if not (is_number(v) or (k == "decay_type" and isinstance(v, str))):
            raise ConfigError(f"{t.source}: {key}={v!r} is not a number")
        if kind == "polynomial" and k == "power":
            t.set("schedule.power", v, key)
        elif kind == "polynomial" and k == "lr_end":
            t.set("schedule.min_lr_ratio", v / lr, key)
        elif kind == "cosine_with_min_lr" and k == "min_lr":
            t.set("schedule.min_lr_ratio", v / lr, key)
        elif kind in ("cosine_with_min_lr", "warmup_stable_decay") and k in ("min_lr_rate", "min_lr_ratio"):
            t.set("schedule.min_lr_ratio", v, key)
        elif kind == "inverse_sqrt" and k == "timescale":
            t.set("schedule.timescale_steps", v, key)
        elif kind == "warmup_stable_decay" and k == "num_decay_steps":
            t.set("schedule.cooldown_steps", v, key)
        elif kind == "warmup_stable_decay" and k == "decay_type" and v in ("linear", "cosine", "1-sqrt"):
            t.set("schedule.decay_shape", v, key)
        elif kind == "cosine_with_min_lr" and k == "num_cycles" and v == 0.5:
            pass  # half a cosine: lmforge's cosine
        else:
            t.skip(key, v, f"lmforge's {name} schedule has no counterpart of {k}")
    if kind == "polynomial" and "lr_end" not in kwargs:
        t.set("schedule.min_lr_ratio", min(1.0, 1e-7 / lr), "lr_scheduler_type")  # HF's default lr_end
    if kind == "warmup_stable_decay":
        if "num_decay_steps" not in kwargs:
            raise ConfigError(f"{t.source}: lr_scheduler_type=warmup_stable_decay needs lr_scheduler_kwargs."
                              "num_decay_steps (as HF's get_wsd_schedule does)")
        if "min_lr_ratio" not in kwargs and "min_lr_rate" not in kwargs:
            t.set("schedule.min_lr_ratio", 0.0, "lr_scheduler_type")
        if "decay_type" not in kwargs:
            t.set("schedule.decay_shape", "cosine", "lr_scheduler_type")  # get_wsd_schedule's default


def _precision(t: Translation, d: dict, take) -> None:
    bf16, fp16 = take("bf16"), take("fp16")
    if bf16 and fp16:
        raise ConfigError(f"{t.source}: bf16 and fp16 are both true; a run has one precision, set one")
    if bf16 or fp16:
        t.set("train.precision", "bf16" if bf16 else "fp16", "bf16" if bf16 else "fp16")
    elif bf16 is False and fp16 is False:
        t.set("train.precision", "fp32", "bf16/fp16")  # the Trainer then trains in fp32
    tf32 = take("tf32")
    if isinstance(tf32, bool):  # None: torch's default, in both
        t.set("train.tf32", tf32, "tf32")
    elif tf32 is not None:
        raise ConfigError(f"{t.source}: tf32={tf32!r} must be true, false or null (lmforge train.tf32)")
    for key in ("bf16_full_eval", "fp16_full_eval", "half_precision_backend", "fp16_opt_level"):
        v = take(key)
        if v not in (None, False, "auto", "O1"):
            t.skip(key, v, "lmforge evaluates and trains in train.precision (autocast)")


def _intervals(t: Translation, d: dict, take, total: int | None) -> None:
    log_strategy = take("logging_strategy") or "steps"
    log = take("logging_steps")
    if log_strategy == "steps" and log is not None:
        _ratio_steps(t, "logging_steps", log, total, "train.log_every", zero_ok=False)
    elif log is not None:
        t.skip("logging_steps", log, f"logging_strategy={log_strategy}: lmforge logs every train.log_every "
               "steps")
    ev = take("eval_strategy") or take("evaluation_strategy")
    eval_steps = take("eval_steps")
    if ev is None:  # HF's default "no": eval_steps alone does nothing
        if eval_steps is not None:
            t.skip("eval_steps", eval_steps, "eval_strategy is not steps, so the Trainer does not use it")
    elif ev == "steps":
        every = eval_steps if eval_steps is not None else log
        if every is not None:
            _ratio_steps(t, "eval_steps" if eval_steps is not None else "logging_steps", every, total,
                         "train.eval_every", zero_ok=False)
    elif ev == "no":
        t.set("train.eval_every", 0, "eval_strategy")
        t.skip("eval_strategy", ev, "lmforge still validates once when training ends (train.eval_every=0)")
    else:
        t.skip("eval_strategy", ev, "lmforge evaluates every train.eval_every steps; it has no epochs")
    save = take("save_strategy") or "steps"
    save_steps = take("save_steps")
    if save == "steps" and save_steps is not None:
        _ratio_steps(t, "save_steps", save_steps, total, "checkpoint.every", zero_ok=False)
    elif save == "no":
        t.set("checkpoint.every", 0, "save_strategy")
        t.set("checkpoint.save_final", False, "save_strategy")
    elif save != "steps":
        t.skip("save_strategy", save, "lmforge saves every checkpoint.every steps (checkpoint.keep_best "
               "keeps the best)")
    limit = take("save_total_limit")
    if is_number(limit) and limit >= 1 and limit == int(limit):
        t.set("checkpoint.keep_last", int(limit), "save_total_limit")
    elif limit is not None:
        t.skip("save_total_limit", limit, "lmforge keeps the last checkpoint.keep_last (>= 1)")


def _report_to(t: Translation, value: Any) -> None:
    targets = {"tensorboard": "logging.tensorboard", "wandb": "logging.wandb.enabled",
               "mlflow": "logging.mlflow.enabled"}
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    if value is not None and not isinstance(value, (str, list)):
        t.skip("report_to", value, "not a reporter name or a list of them")
    for n in names:
        if n in targets:
            t.set(targets[n], True, "report_to")
        elif n not in ("none", "all"):
            t.skip("report_to", n, "lmforge reports to TensorBoard, MLflow and W&B (logging.*)")
