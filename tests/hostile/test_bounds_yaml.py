"""YAML from users is read within a budget: an alias bomb, a self-referencing anchor, nesting deeper than
the parser can follow, or megabytes of text are refused at once with a clear error, in configs, `--set`
values, task files, constitutions, recovery configs and sweep grids alike (one loader: utils/safe_yaml)."""

from __future__ import annotations

import resource
import time

import pytest
import yaml

from lmforge.config import load_config
from lmforge.errors import ConfigError, DataError, LmforgeError
from lmforge.eval.tasks import TaskError, load_task
from lmforge.tools.constitution import load_constitution
from lmforge.tools.sweep import parse_axis
from lmforge.utils.safe_yaml import MAX_BYTES, MAX_NODES, expanded_size, load_yaml


def bomb(levels: int) -> str:
    """A flow list whose last item stands for 2^levels values, in a few bytes per level."""
    return "[&b0 [x, x], " + ", ".join(f"&b{i} [*b{i - 1}, *b{i - 1}]" for i in range(1, levels + 1)) + "]"


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_an_alias_bomb_is_refused_quickly_in_bounded_memory():
    before = _peak_mb()
    t0 = time.perf_counter()
    with pytest.raises(LmforgeError, match=r"b.yaml: the YAML expands to more than 100,000 values"):
        load_yaml(f"run: {{name: {bomb(60)}}}", "b.yaml")
    assert time.perf_counter() - t0 < 1.0
    assert _peak_mb() - before < 100


def test_expansion_is_counted_not_performed():
    node = yaml.compose(f"a: {bomb(200)}")  # 2^200 values: only a count could ever finish
    assert expanded_size(node, MAX_NODES) == MAX_NODES + 1
    # the map, key a and [1, 2] (3 nodes), key b and a list holding [1, 2] twice
    small = yaml.compose("a: &x [1, 2]\nb: [*x, *x]")
    assert expanded_size(small, MAX_NODES) == 1 + (1 + 3) + (1 + 1 + 2 * 3)


def test_ordinary_anchors_still_work_and_keep_their_meaning():
    text = "train: {max_steps: 3, eval_every: &n 3}\ncheckpoint: {every: *n}\n"
    assert load_yaml(text, "x") == yaml.safe_load(text)
    assert load_yaml(bomb(10), "x") == yaml.safe_load(bomb(10))  # 2^10: far inside the budget


@pytest.mark.parametrize("text, message", [
    ("&a [*a]", "refers to itself"),
    ("a: &a {b: *a}", "refers to itself"),
    ("[" * 5000 + "]" * 5000, "nest too deep"),
    ("x" * (MAX_BYTES + 1), "characters of YAML"),
])
def test_self_reference_depth_and_size_are_refused(text, message):
    with pytest.raises(LmforgeError, match=message):
        load_yaml(text, "x")


def test_syntax_errors_stay_yaml_errors_with_their_line():
    with pytest.raises(yaml.YAMLError) as e:
        load_yaml("a: 1\nb: [1, 2\n", "x")
    assert e.value.problem_mark.line >= 1


def test_every_reader_of_user_yaml_uses_the_budget(tmp_path):
    b = tmp_path / "b.yaml"
    b.write_text(f"run: {{name: {bomb(40)}}}\n")
    with pytest.raises(ConfigError, match="alias"):
        load_config(b)
    with pytest.raises(ConfigError, match=r"--set run.name: the YAML expands"):
        load_config(None, [f"run.name={bomb(40)}"])
    (tmp_path / "c.yaml").write_text(f"principles:\n  - {{name: {bomb(40)}, critique: c, revision: r}}\n")
    with pytest.raises(DataError, match="alias"):
        load_constitution(tmp_path / "c.yaml")
    (tmp_path / "docs.jsonl").write_text('{"q": "x", "a": "y"}\n')
    (tmp_path / "t.yaml").write_text(f"task: t\ndataset_path: docs.jsonl\ndoc_to_text: q\ndoc_to_target: a\n"
                                     f"metadata: {bomb(40)}\n")
    with pytest.raises(TaskError, match="alias"):
        load_task(tmp_path / "t.yaml")
    # a grid value is split at commas: a block-style bomb needs none
    block = "b0: &b0\n- x\n- x\n" + "".join(f"b{i}: &b{i}\n- *b{i - 1}\n- *b{i - 1}\n" for i in range(1, 41))
    with pytest.raises(LmforgeError, match="alias"):
        parse_axis(f"run.name={block}")
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * MAX_BYTES + "\n")
    with pytest.raises(ConfigError, match="more than 1,048,576 bytes of YAML"):
        load_config(big)


def test_a_task_file_still_refuses_python_code(tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"q": "x", "a": "y"}\n')
    (tmp_path / "t.yaml").write_text("task: t\ndataset_path: docs.jsonl\ndoc_to_text: !function m.f\n"
                                     "doc_to_target: a\n")
    with pytest.raises(TaskError, match="runs no code"):
        load_task(tmp_path / "t.yaml")


def test_a_document_whose_choices_nest_without_end_is_a_clear_error(tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"q": "x", "a": 0}\n')
    (tmp_path / "t.yaml").write_text("task: t\ndataset_path: docs.jsonl\noutput_type: multiple_choice\n"
                                     "doc_to_text: q\ndoc_to_target: a\ndoc_to_choice: '{{ c }}'\n")
    task = load_task(tmp_path / "t.yaml")
    for text in ("-" * 1_000_000 + "1", "[" * 100_000 + "]" * 100_000):
        with pytest.raises(TaskError, match="not a list literal"):
            task.choices({"q": "x", "a": 0, "c": text}, "docs.jsonl:1")
