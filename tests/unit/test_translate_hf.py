"""Hugging Face TrainingArguments -> lmforge keys (config/translate_hf.py): each mapped field, each reason a
field does not map, fractions of the run, and the DeepSpeed file it names."""

from __future__ import annotations

import json

import pytest

from lmforge.config.translate import Translation, check_values
from lmforge.config.translate_hf import translate_hf_args
from lmforge.errors import ConfigError


def hf(data: dict, max_steps: int | None = 1000) -> Translation:
    return translate_hf_args(data, "args.json", 1, max_steps)


def values(t: Translation) -> dict:
    return {k: v for k, (v, _) in t.values.items()}


def why(t: Translation, key: str) -> str:
    hits = [w for k, _, w in t.unmapped if k == key]
    assert hits, f"{key} not in unmapped: {[k for k, _, _ in t.unmapped]}"
    return hits[0]


def test_the_core_fields_map():
    t = hf({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3, "learning_rate": 2e-4,
            "weight_decay": 0.01, "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-6,
            "max_grad_norm": 0.5, "max_steps": 200, "seed": 7, "output_dir": "out/x", "run_name": "x",
            "gradient_checkpointing": True, "torch_compile": True, "ddp_timeout": 900})
    assert values(t) == {
        "train.micro_batch_size": 4, "train.grad_accum_steps": 3, "optim.lr": 2e-4,
        "optim.weight_decay": 0.01,
        "optim.betas": [0.8, 0.99], "optim.eps": 1e-6, "train.grad_clip": 0.5, "train.max_steps": 200,
        "run.seed": 7, "run.dir": "out/x", "run.name": "x", "train.activation_checkpointing": "full",
        "train.compile": True, "parallel.timeout_s": 900}
    check_values(t)  # lmforge's schema takes them all


def test_whole_epochs_map_to_train_epochs_and_leave_fractions_of_the_run_unresolved():
    t = hf({"num_train_epochs": 3.0, "max_steps": -1, "warmup_ratio": 0.1, "eval_steps": 0.5,
            "eval_strategy": "steps", "logging_steps": 5})
    assert values(t) == {"train.epochs": 3, "train.log_every": 5}
    assert "not known" in why(t, "warmup_ratio") and "not known" in why(t, "eval_steps")
    check_values(t)
    assert "max_steps overrides it" in why(hf({"num_train_epochs": 3.0, "max_steps": 10}), "num_train_epochs")
    assert values(hf({"num_train_epochs": 3.0, "max_steps": 10})) == {"train.max_steps": 10}


def test_fractional_epochs_do_not_map_and_say_why():
    t = hf({"num_train_epochs": 2.5, "max_steps": -1, "warmup_ratio": 0.1})
    assert "train.epochs" not in values(t)
    assert "whole passes" in why(t, "num_train_epochs") and "train by epochs" in why(t, "max_steps")
    assert values(t)["schedule.warmup_steps"] == 100  # the config's train.max_steps (1000) counts the run


@pytest.mark.parametrize("kind,expect", [
    ("linear", {"schedule.name": "linear", "schedule.min_lr_ratio": 0.0}),
    ("cosine", {"schedule.name": "cosine", "schedule.min_lr_ratio": 0.0}),
    ("constant", {"schedule.name": "constant"}),
    ("constant_with_warmup", {"schedule.name": "constant"}),
    ("inverse_sqrt", {"schedule.name": "inverse_sqrt"}),
])
def test_schedules_decay_as_hf_does(kind, expect):
    got = values(hf({"lr_scheduler_type": kind, "warmup_steps": 0}))
    assert got == {"schedule.warmup_steps": 0, **expect}


def test_schedule_kwargs_and_the_ones_that_do_not_map():
    t = hf({"lr_scheduler_type": "cosine_with_min_lr", "learning_rate": 1e-3,
            "lr_scheduler_kwargs": {"min_lr": 1e-4}})
    assert values(t)["schedule.min_lr_ratio"] == pytest.approx(0.1)
    t = hf({"lr_scheduler_type": "polynomial", "learning_rate": 1e-3, "lr_scheduler_kwargs": {"power": 2.0}})
    assert values(t)["schedule.power"] == 2.0 and values(t)["schedule.min_lr_ratio"] == pytest.approx(1e-4)
    t = hf({"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {"num_decay_steps": 50}})
    assert values(t) == {"schedule.warmup_steps": 0, "schedule.name": "wsd", "schedule.cooldown_steps": 50,
                         "schedule.min_lr_ratio": 0.0, "schedule.decay_shape": "cosine"}
    with pytest.raises(ConfigError, match="needs lr_scheduler_kwargs.num_decay_steps"):
        hf({"lr_scheduler_type": "warmup_stable_decay"})
    t = hf({"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": '{"num_cycles": 3}'})
    assert "no restarting cosine" in why(t, "lr_scheduler_type")
    assert "did not map" in why(t, "lr_scheduler_kwargs.num_cycles")
    assert "plateau" in why(hf({"lr_scheduler_type": "reduce_lr_on_plateau"}), "lr_scheduler_type")


def test_warmup_fractions_are_of_the_run():
    assert values(hf({"warmup_steps": 0.1, "max_steps": 200}))["schedule.warmup_steps"] == 20
    assert values(hf({"warmup_ratio": 0.05}, max_steps=30))["schedule.warmup_steps"] == 2  # ceil(1.5)
    assert values(hf({"warmup_steps": 25}))["schedule.warmup_steps"] == 25
    assert "not known" in why(hf({"warmup_steps": 0.1}, max_steps=None), "warmup_steps")


def test_intervals():
    t = hf({"logging_steps": 5, "eval_strategy": "steps", "eval_steps": 0.25, "save_strategy": "steps",
            "save_steps": 50, "save_total_limit": 2, "max_steps": 100})
    assert values(t) == {"train.max_steps": 100, "train.log_every": 5, "train.eval_every": 25,
                         "checkpoint.every": 50, "checkpoint.keep_last": 2}
    t = hf({"logging_steps": 10, "eval_strategy": "steps"})  # eval_steps defaults to logging_steps
    assert values(t)["train.eval_every"] == 10
    t = hf({"eval_strategy": "no", "save_strategy": "no"})
    assert values(t) == {"train.eval_every": 0, "checkpoint.every": 0, "checkpoint.save_final": False}
    assert "once when training ends" in why(t, "eval_strategy")
    assert "no epochs" in why(hf({"eval_strategy": "epoch"}), "eval_strategy")
    assert "no epochs" not in why(hf({"save_strategy": "epoch"}), "save_strategy")


def test_precision():
    assert values(hf({"bf16": True, "fp16": False})) == {"train.precision": "bf16"}
    assert values(hf({"bf16": False, "fp16": True})) == {"train.precision": "fp16"}
    assert values(hf({"bf16": False, "fp16": False})) == {"train.precision": "fp32"}  # the Trainer's fp32
    with pytest.raises(ConfigError, match="bf16 and fp16 are both true"):
        hf({"bf16": True, "fp16": True})
    assert values(hf({"tf32": True})) == {"train.tf32": True}
    assert values(hf({"tf32": False})) == {"train.tf32": False} and values(hf({"tf32": None})) == {}
    with pytest.raises(ConfigError, match="tf32='yes' must be true, false or null"):
        hf({"tf32": "yes"})


@pytest.mark.parametrize("optim,expect", [
    ("adamw_torch", {"optim.name": "adamw", "optim.fused": False}),
    ("adamw_torch_fused", {"optim.name": "adamw", "optim.fused": True}),
    ("adafactor", {"optim.name": "adafactor"}),
    ("sgd", {"optim.name": "sgd", "optim.sgd.momentum": 0.0}),
    ("adamw_bnb_8bit", {"optim.name": "adamw8bit"}),
])
def test_optimizers(optim, expect):
    assert values(hf({"optim": optim})) == expect


def test_an_optimizer_lmforge_lacks_and_adam_keys_it_does_not_use():
    t = hf({"optim": "galore_adamw", "adam_beta1": 0.9})
    assert "lmforge has no galore_adamw" in why(t, "optim")
    t = hf({"optim": "sgd", "adam_beta1": 0.9, "adam_epsilon": 1e-8})
    assert "does not use it" in why(t, "adam_beta1") and "does not use it" in why(t, "adam_epsilon")


def test_report_to_and_other_fields():
    t = hf({"report_to": ["tensorboard", "wandb", "comet_ml"], "push_to_hub": True,
            "dataloader_num_workers": 4, "my_field": 1})
    assert values(t) == {"logging.tensorboard": True, "logging.wandb.enabled": True}
    assert "TensorBoard, MLflow and W&B" in why(t, "report_to")
    assert "Hub" in why(t, "push_to_hub") and "loaders" in why(t, "dataloader_num_workers")
    assert "no lmforge counterpart" in why(t, "my_field")


def test_the_deepspeed_file_it_names_is_translated_too(tmp_path):
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                                   "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}))
    t = hf({"per_device_train_batch_size": 4, "max_grad_norm": 0.3, "bf16": True, "deepspeed": str(ds_file)})
    assert values(t) == {"train.micro_batch_size": 4, "train.grad_clip": 0.3, "train.precision": "bf16",
                         "parallel.zero": 2}
    ds_file.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    with pytest.raises(ConfigError, match=r"ds.json: train_micro_batch_size_per_gpu=2 contradicts args.json: "
                                          r"per_device_train_batch_size=4"):
        hf({"per_device_train_batch_size": 4, "deepspeed": str(ds_file)})
    t = hf({"deepspeed": {"zero_optimization": {"stage": 3}}})
    assert values(t) == {"parallel.zero": 3}


def test_a_value_lmforge_refuses_names_both_keys():
    with pytest.raises(ConfigError, match=r"args.json: per_device_train_batch_size -> lmforge "
                                          r"train.micro_batch_size=0"):
        check_values(hf({"per_device_train_batch_size": 0}))
    with pytest.raises(ConfigError, match=r"learning_rate='fast' is not a number"):
        hf({"learning_rate": "fast"})
