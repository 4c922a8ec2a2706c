"""`lmforge config --from-deepspeed / --from-hf-args` print the translated config (stdout, so it can be
saved) and the keys that did not map (stderr); `lmforge train --deepspeed` trains with the translation,
warning once per key that did not map and refusing a contradiction before any work."""

from __future__ import annotations

import json

import yaml

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config


def sets(overrides: list[str]) -> list[str]:
    return sum((["--set", o] for o in overrides), [])


DS = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0, "bf16": {"enabled": False}, "fp16": {"enabled": False},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "wall_clock_breakdown": True,
}


def test_config_from_deepspeed_prints_a_config_lmforge_reads_back(tmp_path, capsys):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(DS))
    assert main(["config", "--from-deepspeed", str(ds)]) == 0
    out, err = capsys.readouterr()
    saved = tmp_path / "run.yaml"
    saved.write_text(out)
    cfg = load_config(saved)
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.parallel.zero, cfg.optim.lr) == (
        4, 4, 2, 3e-3)
    assert f"{ds}: 9 lmforge keys set, 3 keys not translated" in err
    for key in ("wall_clock_breakdown", "zero_optimization.overlap_comm", "gradient_accumulation_steps"):
        assert key in err


def test_config_from_hf_args_under_a_config(tmp_path, capsys):
    args = tmp_path / "args.yaml"  # a YAML of TrainingArguments fields is read too
    args.write_text(yaml.safe_dump({"per_device_train_batch_size": 2, "learning_rate": 1e-3, "max_steps": 7,
                                    "warmup_steps": 0.5, "lr_scheduler_type": "linear", "push_to_hub": True}))
    assert main(["config", "-c", str(TINY), "--from-hf-args", str(args), "--set", "run.name=hf"]) == 2
    err = capsys.readouterr().err  # tiny.yaml sets its own micro-batch (line 27)
    assert "tiny.yaml:27: train.micro_batch_size=8 contradicts" in err
    assert "per_device_train_batch_size" in err
    args.write_text(yaml.safe_dump({"per_device_train_batch_size": 2, "max_steps": 7, "warmup_steps": 0.5,
                                    "lr_scheduler_type": "constant_with_warmup", "push_to_hub": True}))
    cfg_file = tmp_path / "base.yaml"
    cfg_file.write_text("run:\n  name: mine\n")
    assert main(["config", "-c", str(cfg_file), "--from-hf-args", str(args)]) == 0
    out, err = capsys.readouterr()
    cfg = yaml.safe_load(out)
    assert cfg["run"]["name"] == "mine" and cfg["train"]["micro_batch_size"] == 2
    assert (cfg["schedule"]["name"], cfg["schedule"]["warmup_steps"], cfg["train"]["max_steps"]) == (
        "constant", 4, 7)
    assert "push_to_hub" in err and "Hub upload" in err


def test_train_deepspeed_runs_with_the_translation(tmp_path, shared_data_dir, capsys):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({**DS, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
                              "gradient_accumulation_steps": 2, "steps_per_print": 1}))
    run = tmp_path / "run"
    argv = ["train", "-c", str(TINY), "--deepspeed", str(ds),
            *sets(tiny_overrides(run, shared_data_dir, "train.max_steps=3", "checkpoint.every=0"))]
    assert main(argv) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("lmforge train: warning:")]
    assert len(warnings) == 2, err  # wall_clock_breakdown and overlap_comm; false/empty values ask nothing
    assert any("wall_clock_breakdown=True not translated: DeepSpeed's timers" in w for w in warnings)
    saved = load_config(run / "config.yaml")
    assert (saved.parallel.zero, saved.train.precision) == (2, "fp32")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in steps) == 3


def test_train_deepspeed_contradiction_is_refused_before_any_work(tmp_path, capsys):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"gradient_clipping": 0.5}))
    run = tmp_path / "run"
    assert main(["train", "-c", str(TINY), "--deepspeed", str(ds), "--set", f"run.dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge train: error: ") and err.count("\n") == 1
    assert "train.grad_clip=1.0 contradicts" in err and "gradient_clipping" in err
    assert not run.exists()


def test_train_deepspeed_with_a_budget_is_refused():
    import argparse

    import pytest

    from lmforge.cli.verbs.training import _train_translated
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match="--budget plans the whole run itself"):
        _train_translated(argparse.Namespace(deepspeed="ds.json", budget="5m", config=None, set=[],
                                             resume=False, verb="train"))
