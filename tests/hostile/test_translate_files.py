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
