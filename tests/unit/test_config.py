"""Config errors name the file, line, key, bad value and valid choices; overrides apply; round trips."""

from __future__ import annotations

import pytest
import yaml

from lmforge.config import Config, dump_config, load_config
from lmforge.errors import ConfigError


def write(tmp_path, text: str, name: str = "run.yaml"):
    p = tmp_path / name
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


def assert_documented(cls):
    for name, field in cls.model_fields.items():
        assert field.description, f"{cls.__name__}.{name} has no description"
        ann = field.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            assert_documented(ann)


def test_every_field_is_documented():
    assert_documented(Config)


def test_every_optimizer_field_is_documented():
    import typing

    from lmforge.config.optim import OPTIMIZER_CONFIGS, OptimConfig

    members = {a for a in typing.get_args(typing.get_args(OptimConfig)[0])}
    assert members == set(OPTIMIZER_CONFIGS.values())
    for cls in members:
        assert_documented(cls)


def test_each_optimizer_takes_its_own_keys_only(tmp_path):
    cfg = load_config(overrides=["optim.name=muon", "optim.muon.lr=0.05", "optim.betas=[0.8, 0.9]"])
    assert cfg.optim.muon.lr == 0.05 and cfg.optim.betas == (0.8, 0.9) and cfg.optim.lr == 3e-4
    with pytest.raises(
        ConfigError,
        match=r"--set optim.betas: unknown key 'optim.betas'; valid keys: lr, name, param_groups, sgd"
    ):
        load_config(overrides=["optim.name=sgd", "optim.betas=[0.9, 0.9]"])
    p = write(tmp_path, "optim:\n  name: sophia\n  muon:\n    lr: 0.1\n")
    with pytest.raises(
        ConfigError,
        match=rf"{p}:3: unknown key 'optim.muon'; valid keys: betas, eps, lr, name, param_groups, "
        "sophia, weight_decay",
    ):
        load_config(p)
    with pytest.raises(
        ConfigError,
        match=r"--set optim.muon.momentun: unknown key 'optim.muon.momentun' \(did "
        r"you mean 'momentum'\?\); valid keys: lr, momentum, nesterov, ns_steps",
    ):
        load_config(overrides=["optim.name=muon", "optim.muon.momentun=3"])
    with pytest.raises(ConfigError, match=r"optim.sgd.nesterov needs optim.sgd.momentum > 0"):
        load_config(overrides=["optim.name=sgd", "optim.sgd.momentum=0", "optim.sgd.nesterov=true"])
    with pytest.raises(ConfigError, match=r"does not match any of the expected tags: 'adamw', 'adam', 'sgd'"):
        load_config(overrides=["optim.name=adagrad"])


def test_flat_optim_keys_still_work_with_a_deprecation_note(tmp_path):
    """Configs from before the per-optimizer sections (and every config.yaml a run saved then, which
    lists all optimizers' keys) load: the chosen optimizer's keys move, the others are dropped."""
    from lmforge.config.load import dump_config
    from lmforge.errors import LmforgeDeprecationWarning

    p = write(
        tmp_path,
        "optim:\n  name: muon\n  lr: 0.001\n  muon_lr: 0.03\n  muon_ns_steps: 4\n  sophia_rho: 0.1\n"
        "  momentum: 0.5\n",
    )
    with pytest.warns(LmforgeDeprecationWarning) as caught:
        cfg = load_config(p)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert (
        msg.startswith(f"{p}:1: flat optim keys are deprecated") and "optim.muon_lr -> optim.muon.lr" in msg
    )
    assert (
        "optim.muon_ns_steps -> optim.muon.ns_steps" in msg and "ignored" in msg and "optim.sophia_rho" in msg
    )
    assert cfg.optim.name == "muon" and cfg.optim.lr == 0.001 and cfg.optim.muon.lr == 0.03
    assert cfg.optim.muon.ns_steps == 4 and cfg.optim.muon.momentum == 0.95
    again = write(tmp_path, dump_config(cfg), "again.yaml")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's form: no note
        assert load_config(again) == cfg
    with pytest.warns(
        LmforgeDeprecationWarning, match=r"--set optim: .*optim.momentum -> optim.sgd.momentum"
    ):
        assert load_config(overrides=["optim.name=sgd", "optim.momentum=0.5"]).optim.sgd.momentum == 0.5


def test_cli_prints_the_deprecation_as_one_line(capsys):
    import warnings

    from lmforge.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("default")  # as outside the test suite: shown, not raised
        assert main(["config", "--set", "optim.name=sophia", "--set", "optim.hessian_every=3"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lmforge config: warning: --set optim: flat optim keys are deprecated; they still work in this "
        "release: optim.hessian_every -> optim.sophia.hessian_every (print the current form with: "
        "lmforge config -c FILE)"
    ]


def test_a_resolved_config_is_immutable():
    cfg = Config()
    with pytest.raises(Exception, match="frozen"):
        cfg.train.max_steps = 3
    with pytest.raises(Exception, match="frozen"):
        cfg.optim.lr = 1.0
