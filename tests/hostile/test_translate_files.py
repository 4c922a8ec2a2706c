"""A ds_config.json or TrainingArguments file from elsewhere is read within a budget: a file that is not one
object, bad JSON, megabytes, deep nesting, thousands of keys, an alias bomb or bytes that are not UTF-8 are
refused with one line naming the file (exit 2), and nothing is written."""

from __future__ import annotations

import json
import time

import pytest

from lmforge.cli import main
from lmforge.utils.safe_yaml import MAX_BYTES

BAD = {
    "list.json": ("[1, 2, 3]", "must hold one object of keys, got list"),
    "number.json": ("42", "got int"),
    "broken.json": ('{"zero_optimization": {"stage": 2,\n}', "broken.json:2: invalid JSON"),
    "deep.json": ('{"a": ' * 200 + "1" + "}" * 200, "nest too deep"),
    "huge.json": ('{"a": "' + "x" * (MAX_BYTES + 10) + '"}', "bytes of YAML"),
    "wide.json": (json.dumps({f"k{i}": i for i in range(3000)}), "more than 2,000 keys"),
    "bomb.yaml": ("a: &b0 [x, x]\n" + "".join(f"b{i}: &b{i} [*b{i - 1}, *b{i - 1}]\n" for i in range(1, 40)),
                  "expands to more than 100,000 values"),
    "latin1.json": (b'{"k": "\xe9"}', "cannot read"),
    "tagged.yaml": ("x: !!python/object:os.system [ls]\n", "invalid YAML"),
}


@pytest.mark.parametrize("flag", ["--from-deepspeed", "--from-hf-args"])
@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_file_is_one_line_naming_it(tmp_path, capsys, flag, name):
    text, match = BAD[name]
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    t0 = time.perf_counter()
    assert main(["config", flag, str(path)]) == 2
    assert time.perf_counter() - t0 < 5
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("lmforge config: error: ") and str(path) in err and match in err, err
    assert "Traceback" not in err


def test_a_missing_file_is_named(tmp_path, capsys):
    assert main(["config", "--from-deepspeed", str(tmp_path / "nope.json")]) == 2
    assert f"DeepSpeed config file not found: {tmp_path / 'nope.json'}" in capsys.readouterr().err


def test_train_refuses_a_bad_file_before_any_work(tmp_path, capsys):
    (tmp_path / "ds.json").write_text("[]")
    run = tmp_path / "run"
    assert main(["train", "--deepspeed", str(tmp_path / "ds.json"), "--set", f"run.dir={run}"]) == 2
    assert "must hold one object" in capsys.readouterr().err
    assert not run.exists()


def test_odd_values_inside_an_object_are_listed_or_refused_never_crash(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": {"nested": [1]}, "params": {"lr": [1]}},
                                "scheduler": "WarmupLR", "zero_optimization": {"stage": True}}))
    assert main(["config", "--from-deepspeed", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


WEIRD = ["x", [1], {"a": 1}, -1, True, 0.5, None, float("inf"), "auto", 0]
HF_KEYS = ["per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
           "adam_beta1", "adam_epsilon", "max_grad_norm", "num_train_epochs", "max_steps",
           "lr_scheduler_type",
           "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "logging_steps", "logging_strategy",
           "eval_strategy", "eval_steps", "save_strategy", "save_steps", "save_total_limit", "seed", "bf16",
           "fp16", "tf32", "gradient_checkpointing", "torch_compile", "optim", "output_dir", "run_name",
           "report_to", "ddp_timeout", "deepspeed", "push_to_hub"]
DS_BASE = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
           "gradient_clipping": 1.0, "steps_per_print": 10,
           "fp16": {"enabled": True, "loss_scale_window": 10},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3, "warmup_min_lr": 0,
                                                             "warmup_num_steps": 10, "total_num_steps": 100}},
           "tensorboard": {"enabled": True}, "communication_data_type": "bf16"}


def _paths(d, pre=()):
    for k, v in d.items():
        yield pre + (k,)
        if isinstance(v, dict):
            yield from _paths(v, pre + (k,))


def test_a_wrong_type_anywhere_is_an_error_or_listed_never_a_crash():
    import copy

    from lmforge.config.translate import check_values
    from lmforge.config.translate_deepspeed import translate_deepspeed
    from lmforge.config.translate_hf import translate_hf_args
    from lmforge.errors import ConfigError

    accepted = []

    def judge(fn, data):
        try:
            check_values(fn(data))
            accepted.append(data)
        except ConfigError:
            pass  # any other exception fails the test

    base = {"learning_rate": 1e-3, "max_steps": 100, "lr_scheduler_type": "polynomial",
            "lr_scheduler_kwargs": {"lr_end": 1e-5}, "eval_strategy": "steps",
            "deepspeed": {k: v for k, v in DS_BASE.items() if k != "scheduler"}}
    for key in HF_KEYS:
        for w in WEIRD:
            judge(lambda d: translate_hf_args(d, "a.json", 1, 100), {**base, key: w})
    assert len(accepted) > 100  # the base is valid: each key's odd values were judged on their own
    for path in _paths(DS_BASE):
        for w in WEIRD:
            data = copy.deepcopy(DS_BASE)
            node = data
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = w
            judge(lambda d: translate_deepspeed(d, "d.json", 1), data)
    assert len(accepted) > 200
