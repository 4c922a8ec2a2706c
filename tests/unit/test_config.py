"""Config errors name the file, line, key, bad value and valid choices; overrides apply; round trips."""

from __future__ import annotations

import pytest
import yaml

from lmforge.config import Config, dump_config, load_config
from lmforge.errors import ConfigError


def write(tmp_path, text: str):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.train.max_steps == 1000 and cfg.optim.name == "adamw"
    assert cfg.seq_len == cfg.model.max_seq_len


def test_unknown_key_names_file_line_and_suggests(tmp_path):
    p = write(tmp_path, "run:\n  dir: runs/x\ntrain:\n  max_step: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}:4" in msg
    assert "train.max_step" in msg and "did you mean 'max_steps'" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trian'.*did you mean 'train'"):
        load_config(write(tmp_path, "trian:\n  max_steps: 5\n"))


def test_wrong_type_and_choices(tmp_path):
    p = write(tmp_path, "train:\n  max_steps: lots\n  precision: bf17\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}:2" in msg and "'lots'" in msg and "train.max_steps" in msg
    assert f"{p}:3" in msg and "'bf17'" in msg and "'fp32'" in msg and "'bf16'" in msg


def test_out_of_range(tmp_path):
    with pytest.raises(ConfigError, match=r"optim.lr.*-0.1.*greater than 0"):
        load_config(write(tmp_path, "optim:\n  lr: -0.1\n"))


def test_cross_field_errors_name_keys():
    with pytest.raises(ConfigError, match="n_heads=6 must be a multiple of n_kv_heads=4"):
        load_config(overrides=["model.n_heads=6", "model.n_kv_heads=4", "model.d_model=48"])
    with pytest.raises(ConfigError, match="train.seq_len=999 exceeds model.max_seq_len=256"):
        load_config(overrides=["train.seq_len=999"])


def test_overrides_parse_yaml_values_and_win(tmp_path):
    p = write(tmp_path, "train:\n  max_steps: 5\n")
    cfg = load_config(p, ["train.max_steps=7", "optim.betas=[0.8, 0.9]", "model.sliding_window=null",
                          "run.name=hello world"])
    assert cfg.train.max_steps == 7
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.run.name == "hello world"


def test_override_errors():
    with pytest.raises(ConfigError, match=r"--set train.max_steps: .*'x'"):
        load_config(overrides=["train.max_steps=x"])
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        load_config(overrides=["optim.lrr=1"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(overrides=["train.max_steps"])


def test_preset_fills_and_explicit_keys_win():
    cfg = load_config(overrides=["model.preset=debug", "model.n_layers=3"])
    assert cfg.model.d_model == 64 and cfg.model.n_layers == 3
    with pytest.raises(ConfigError, match="unknown preset 'huge'.*valid presets"):
        load_config(overrides=["model.preset=huge"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=["model.preset=debug", "train.max_steps=3"])
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_config(cfg))
    again = load_config(p)
    assert again == cfg
    assert yaml.safe_load(p.read_text())["model"]["d_model"] == 64


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"run.yaml:3: invalid YAML"):
        load_config(write(tmp_path, "train:\n  max_steps: 5\n bad: 1\nrun:\n  dir: x\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_every_field_is_documented():
    def walk(cls):
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann)

    walk(Config)
