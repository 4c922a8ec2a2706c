"""DeepSpeed ds_config -> lmforge keys (config/translate_deepspeed.py): each mapped key, each reason a key
does not map, and the contradictions DeepSpeed itself refuses."""

from __future__ import annotations

import pytest

from lmforge.config.translate import Translation, apply_translation, check_values
from lmforge.config.translate_deepspeed import translate_deepspeed
from lmforge.errors import ConfigError


def ds(data: dict, world: int = 1) -> Translation:
    return translate_deepspeed(data, "ds.json", world)


def values(t: Translation) -> dict:
    return {k: v for k, (v, _) in t.values.items()}


def why(t: Translation, key: str) -> str:
    hits = [w for k, _, w in t.unmapped if k == key]
    assert hits, f"{key} not in unmapped: {[k for k, _, _ in t.unmapped]}"
    return hits[0]


@pytest.mark.parametrize("stage,expect", [
    (1, {"parallel.zero": 1}), (2, {"parallel.zero": 2}), (3, {"parallel.zero": 3}),
    (0, {"parallel.dp_replicate": 4, "parallel.dp_shard": 1}),
])
def test_zero_stages_map_to_the_parallel_section(stage, expect):
    assert values(ds({"zero_optimization": {"stage": stage}}, world=4)) == expect


def test_offload_maps_with_stage_3_and_is_explained_without_it():
    t = ds({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "offload_param": {"device": "cpu"}}})
    assert values(t)["parallel.cpu_offload"] is True
    assert "no tuning keys" in why(t, "zero_optimization.offload_optimizer.pin_memory")
    t = ds({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert "parallel.cpu_offload" not in t.values
    assert "not with stages 1-2" in why(t, "zero_optimization.offload_optimizer.device")
    t = ds({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert values(t)["train.optimizer_offload"] == "cpu" and "parallel.cpu_offload" not in t.values
    t = ds({"zero_optimization": {"stage": 0, "offload_param": {"device": "cpu"}}})
    assert "parameters only with stage 3" in why(t, "zero_optimization.offload_param.device")
    t = ds({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert "no NVMe" in why(t, "zero_optimization.offload_param.device")
    t = ds({"zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_wat": 1}})
    assert "FSDP2 sizes its own" in why(t, "zero_optimization.overlap_comm")
    assert "not a zero_optimization key" in why(t, "zero_optimization.stage3_wat")


def test_precision_and_loss_scale_settings():
    t = ds({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 500,
                     "hysteresis": 2, "min_loss_scale": 1}})
    assert values(t) == {"train.precision": "fp16"}
    unmapped = {k for k, _, _ in t.unmapped}
    # DeepSpeed's defaults that equal what lmforge's scaler does are not listed; the others are, with why
    assert unmapped == {"fp16.loss_scale_window", "fp16.hysteresis"}
    assert "2000 clean steps" in why(t, "fp16.loss_scale_window")
    assert "always dynamic" in why(ds({"fp16": {"enabled": True, "loss_scale": 128}}), "fp16.loss_scale")
    assert values(ds({"bf16": {"enabled": True}})) == {"train.precision": "bf16"}
    assert values(ds({"bf16": {"enabled": False}})) == {}
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        ds({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_batch_sizes_clipping_and_logging():
    t = ds({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16,
            "gradient_clipping": 0.5, "steps_per_print": 7}, world=2)
    assert values(t) == {"train.micro_batch_size": 4, "train.grad_accum_steps": 2, "train.grad_clip": 0.5,
                         "train.log_every": 7}


def test_train_batch_size_derives_the_missing_key_as_deepspeed_does():
    t = ds({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": "auto"}, world=2)
    assert values(t) == {"train.micro_batch_size": 4, "train.grad_accum_steps": 4}
    assert "derived from train_batch_size" in why(t, "gradient_accumulation_steps")
    t = ds({"train_batch_size": 32, "gradient_accumulation_steps": 2}, world=2)
    assert values(t) == {"train.micro_batch_size": 8, "train.grad_accum_steps": 2}
    with pytest.raises(ConfigError, match="not a multiple of 6"):
        ds({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3}, world=2)


def test_inconsistent_batch_sizes_are_a_contradiction():
    with pytest.raises(ConfigError, match=r"train_batch_size=32 but .*= 16; DeepSpeed requires them equal"):
        ds({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
           world=2)


def test_auto_values_are_left_to_lmforge_and_said():
    t = ds({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}})
    assert values(t) == {"optim.name": "adamw"}
    assert "auto: left to lmforge's default (train.micro_batch_size)" in why(
        t, "train_micro_batch_size_per_gpu")
    assert "train.grad_clip" in why(t, "gradient_clipping")
    assert "optim.lr" in why(t, "optimizer.params.lr")


@pytest.mark.parametrize("params,name", [({}, "adamw"), ({"adam_w_mode": False}, "adam")])
def test_adam_is_decoupled_unless_adam_w_mode_is_false(params, name):
    t = ds({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.9], "eps": 1e-6,
                                                     "weight_decay": 0.01, **params}}})
    assert values(t) == {"optim.name": name, "optim.lr": 1e-3, "optim.betas": [0.8, 0.9], "optim.eps": 1e-6,
                         "optim.weight_decay": 0.01}


def test_other_optimizers():
    assert values(ds({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})) == {
        "optim.name": "sgd", "optim.lr": 0.1, "optim.sgd.momentum": 0.0}  # torch SGD's default momentum
    assert values(ds({"optimizer": {"type": "Lion", "params": {"betas": [0.9, 0.99]}}})) == {
        "optim.name": "lion", "optim.betas": [0.9, 0.99]}
    t = ds({"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3}}})
    assert t.values == {} and "lmforge has no OneBitLamb" in why(t, "optimizer.type")
    assert "did not map" in why(t, "optimizer.params.lr")
    assert "AMSGrad" in why(ds({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}),
                            "optimizer.params.amsgrad")


def test_schedulers():
    t = ds({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 2e-3,
                                                         "warmup_min_lr": 1e-5}}})
    assert values(t) == {"schedule.name": "constant", "schedule.warmup_steps": 10, "optim.lr": 2e-3}
    assert "from 0" in why(t, "scheduler.params.warmup_min_lr")
    assert "log" in why(t, "scheduler.params.warmup_type")  # DeepSpeed's default warm-up is log
    t = ds({"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 10, "warmup_max_lr": 1e-3, "warmup_min_lr": 1e-4,
        "warmup_type": "linear"}}})
    assert values(t) == {"schedule.name": "linear", "schedule.warmup_steps": 10, "schedule.min_lr_ratio":
                         pytest.approx(0.1), "schedule.decay_steps": 100, "optim.lr": 1e-3}
    t = ds({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 5,
                                                               "cos_min_ratio": 0.05}}})
    assert values(t) == {"optim.name": "adamw", "optim.lr": 5e-4, "schedule.name": "cosine",
                         "schedule.warmup_steps": 5, "schedule.min_lr_ratio": 0.05,
                         "schedule.decay_steps": 100}
    t = ds({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}})
    assert t.values == {} and "no OneCycle schedule" in why(t, "scheduler.type")
    assert "lr-find" in why(ds({"scheduler": {"type": "LRRangeTest"}}), "scheduler.type")


def test_warmup_max_lr_replaces_the_optimizer_lr_and_says_so():
    t = ds({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}})
    assert values(t)["optim.lr"] == 1e-3
    assert "warmup_max_lr instead" in why(t, "optimizer.params.lr")


def test_unknown_and_machinery_keys_are_listed_not_crashed_on():
    t = ds({"wall_clock_breakdown": True, "flops_profiler": {"enabled": True}, "my_own_key": [1, 2],
            "tensorboard": {"enabled": True, "output_path": "tb/"},
            "wandb": {"enabled": True, "project": "p"}})
    assert values(t) == {"logging.tensorboard": True, "logging.wandb.enabled": True,
                         "logging.wandb.project": "p"}
    assert "not a DeepSpeed key lmforge knows" in why(t, "my_own_key")
    assert "timers" in why(t, "wall_clock_breakdown")
    assert "run dir" in why(t, "tensorboard.output_path")


@pytest.mark.parametrize("data,match", [
    ({"zero_optimization": {"stage": 4}}, "stages are 0, 1, 2, 3"),
    ({"zero_optimization": []}, "zero_optimization must be an object"),
    ({"gradient_clipping": "lots"}, "gradient_clipping='lots' is not a number"),
    ({"train_micro_batch_size_per_gpu": 0}, "must be a whole number >= 1"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "must be two numbers"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "cpu, nvme or none"),
])
def test_bad_values_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        ds(data)


def test_a_value_lmforge_refuses_names_the_json_key_and_the_lmforge_key():
    t = ds({"gradient_clipping": -1.0, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}})
    with pytest.raises(ConfigError) as e:
        check_values(t)
    msg = str(e.value)
    assert "ds.json: gradient_clipping -> lmforge train.grad_clip=-1.0" in msg
    assert "optimizer.params.betas -> lmforge optim.betas=[0.9, 1.5]" in msg


def test_applied_under_a_config_a_contradiction_is_an_error_and_agreement_is_not(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("train:\n  grad_clip: 1.0\n  max_steps: 3\n")
    t = ds({"gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2})
    cfg = apply_translation(t, str(cfg_file), ["train.log_every=2"])
    assert (cfg.train.grad_clip, cfg.train.micro_batch_size, cfg.train.max_steps, cfg.train.log_every) == (
        1.0, 2, 3, 2)
    with pytest.raises(ConfigError, match=r"run.yaml:2: train.grad_clip=1.0 contradicts ds.json: "
                                          r"gradient_clipping \(lmforge train.grad_clip=0.5\)"):
        apply_translation(ds({"gradient_clipping": 0.5}), str(cfg_file), [])
    with pytest.raises(ConfigError,
                       match=r"--set train.micro_batch_size: train.micro_batch_size=4 contradicts"):
        apply_translation(t, str(cfg_file), ["train.micro_batch_size=4"])


def test_empty_sections_and_whole_sections_given_with_set_are_judged_key_by_key(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("logging: {}\noptim: null\n")
    t = ds({"tensorboard": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    cfg = apply_translation(t, str(cfg_file), ["optim={lr: 0.001, weight_decay: 0.0}"])
    assert (cfg.logging.tensorboard, cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay) == (
        True, "adamw", 1e-3, 0.0)
    with pytest.raises(ConfigError, match=r"--set optim: optim.lr=0.002 contradicts"):
        apply_translation(t, str(cfg_file), ["optim={lr: 0.002}"])


def test_defaults_as_deepspeeds_lr_schedules_has_them():
    """deepspeed/runtime/lr_schedules.py: every Warmup* scheduler's warmup_type defaults to log, and WarmupLR
    without warmup_max_lr warms up to the optimizer's lr (not to 0.001, as WarmupDecayLR's default is)."""
    t = ds({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}})
    assert "log" in why(t, "scheduler.params.warmup_type")
    assert values(t)["schedule.min_lr_ratio"] == 0.0001  # cos_min_ratio's default
    t = ds({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}})
    assert values(t)["optim.lr"] == 5e-4
    assert values(ds({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50}}}))[
        "optim.lr"] == 0.001
