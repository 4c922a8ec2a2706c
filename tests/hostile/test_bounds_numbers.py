"""Every number from outside is checked before work depends on it: CLI flags (one argparse type family),
config keys (no NaN or infinity anywhere in the tree), task-file numbers (one table of bounds), request
bodies, sweep grids and scaling plans."""

from __future__ import annotations

import argparse
import math
import time
import types
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from lmforge.cli import build_parser, main
from lmforge.cli.numbers import number
from lmforge.config import load_config
from lmforge.config.curate import _Step
from lmforge.config.section import Section
from lmforge.errors import ConfigError, LmforgeError
from lmforge.eval.tasks import BOUNDS, TaskError, load_task
from lmforge.utils.bounds import SEED, real, whole


def _actions(parser: argparse.ArgumentParser, path: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{path} {name}".strip())
        else:
            yield path, action


def test_every_numeric_flag_uses_the_bounded_type():
    plain = [f"{verb} {'/'.join(a.option_strings)}" for verb, a in _actions(build_parser())
             if a.type in (int, float)]
    assert not plain, f"numeric flags without a range: {plain}"


@pytest.mark.parametrize("argv, flag", [
    (["serve", "run", "--port", "70000"], "--port"),
    (["serve", "run", "--port", "-1"], "--port"),
    (["serve", "run", "--max-batch-size", "100000000"], "--max-batch-size"),
    (["serve", "run", "--prefix-cache-mb", "-1"], "--prefix-cache-mb"),
    (["serve", "run", "--prefix-cache-mb", "1e12"], "--prefix-cache-mb"),
    (["constitution", "run", "--temperature", "nan"], "--temperature"),
    (["constitution", "run", "--temperature", "inf"], "--temperature"),
    (["scaling", "plan", "--compute", "nan"], "--compute"),
    (["scaling", "plan", "--compute", "1e400"], "--compute"),
    (["scaling", "plan", "--tokens=-inf"], "--tokens"),
    (["eval", "run", "--limit", "nan"], "--limit"),
    (["eval", "run", "--seed", "1" + "0" * 30], "--seed"),
    (["export", "a", "b", "--max-shard-gb", "inf"], "--max-shard-gb"),
    (["prune", "a", "b", "--method", "magnitude", "--sparsity", "nan"], "--sparsity"),
    (["lr-find", "--max-lr", "inf"], "--max-lr"),
    (["sweep", "--random", "10000000000"], "--random"),
    (["tasks", "--n", "five"], "--n"),
])
def test_flags_refuse_nan_inf_and_out_of_range_values_with_exit_2(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: must be" in err and "Traceback" not in err


def test_the_flag_type_reads_numbers_and_names_the_range():
    port = number(whole(0, 65535))
    assert port("8000") == 8000
    with pytest.raises(argparse.ArgumentTypeError, match="whole number from 0 to 65,535, got '70000'"):
        port("70000")
    lr = number(real(0.0, 100.0, lo_open=True))
    assert lr("1e-3") == 1e-3
    for bad in ("nan", "inf", "-1", "0", "1e400", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"positive number <= 100"):
            lr(bad)


def test_bound_messages_name_the_key_and_the_range():
    with pytest.raises(LmforgeError, match=r"^repeats must be a whole number from 1 to 1,000, got 10+$"):
        whole(1, 1000).check(10**9, "repeats")
    with pytest.raises(LmforgeError, match=r"got a 41-digit number"):
        SEED.check(10**40, "seed")
    with pytest.raises(LmforgeError, match=r"in \[0, 1\), got nan"):
        real(0.0, 1.0, hi_open=True).check(math.nan, "x")
    with pytest.raises(LmforgeError, match=r"got bool True"):
        whole(0, 5).check(True, "x")
    assert real(0.0, 600.0, lo_open=True).check(600, "t") == 600


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _with(annotation, bad):
    """A value of `annotation`'s shape with `bad` where its floats go (None: no float in it)."""
    if annotation is float:
        return bad
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return next((v for v in (_with(a, bad) for a in args) if v is not None), None)
    if origin is tuple and float in args:
        return tuple(bad for _ in args)
    if origin is list and args[0] is float:
        return [bad]
    if origin is dict and args[1] is float:
        key = typing.get_args(args[0])[0] if typing.get_origin(args[0]) is typing.Literal else args[0](1)
        return {key: bad}
    return None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1e999"])
def test_no_config_key_takes_nan_or_infinity(bad):
    """Every float key of every section (the curate steps too, tuples and maps of floats too) refuses a
    non-finite value."""
    checked = 0
    for cls in [*_subclasses(Section), *_subclasses(_Step)]:
        for name, field in cls.model_fields.items():
            value = _with(field.annotation, bad)
            if value is None:
                continue
            with pytest.raises(ValidationError, match="finite"):
                cls.model_validate({name: value})
            checked += 1
    assert checked > 50  # the tree has that many float keys: the walk found them


def test_config_errors_name_the_key_for_non_finite_and_out_of_range_values():
    with pytest.raises(ConfigError, match=r"--set optim.lr: .*finite number"):
        load_config(None, ["optim.lr=.nan"])
    with pytest.raises(ConfigError, match=r"key 'train.max_time'.*finite number"):
        load_config(None, ["train.max_time=.inf"])
    with pytest.raises(ConfigError, match=r"key 'run.seed'.*less than or equal to 4294967295"):
        load_config(None, [f"run.seed={2**64}"])
    assert load_config(None, ["run.seed=4294967295"]).run.seed == 2**32 - 1


# -- task files ---------------------------------------------------------------------------------------
TASK = "task: t\ndataset_path: docs.jsonl\noutput_type: generate_until\ndoc_to_text: q\ndoc_to_target: a\n"


def _task(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "docs.jsonl").write_text('{"q": "1+1?", "a": "2"}\n')
    p = tmp_path / "t.yaml"
    p.write_text(TASK + extra)
    return p


PASS = "metric_list:\n  - {{metric: pass_at_k, test: 'assert True', {}}}\n"
FILTER = "filter_list:\n  - {{name: f, filter: [{{function: regex, {}}}]}}\n"


@pytest.mark.parametrize("extra, key", [
    ("repeats: 1000000000\n", "'repeats' must be a whole number from 1 to 1,000"),
    ("repeats: 0\n", "'repeats' must be"),
    ("num_fewshot: 100000\n", "'num_fewshot' must be"),
    ("chance: .nan\n", "'chance' must be"),
    ("generation_kwargs: {max_gen_toks: 1000000000000}\n", "'generation_kwargs.max_gen_toks' must be"),
    ("generation_kwargs: {do_sample: true, temperature: .nan}\n", "'generation_kwargs.temperature' must be"),
    ("generation_kwargs: {top_p: .nan}\n", "'generation_kwargs.top_p' must be"),
    ("generation_kwargs: {top_k: 10000000000000}\n", "'generation_kwargs.top_k' must be"),
    (PASS.format("memory_mb: 1.0e+30"), "pass_at_k.memory_mb must be a number in [64, 65,536]"),
    (PASS.format("memory_mb: 1e30"), "pass_at_k.memory_mb must be"),  # YAML 1.1 reads 1e30 as text
    (PASS.format("timeout_s: .inf"), "pass_at_k.timeout_s must be a positive number <= 600"),
    (PASS.format("timeout_s: .nan"), "pass_at_k.timeout_s must be"),
    (PASS.format("timeout_s: 0"), "pass_at_k.timeout_s must be"),
    (PASS.format("k: [1, 100000]"), "pass_at_k.k must be"),
    (FILTER.format("group_select: 99999"), "group_select must be"),
    (FILTER.format("fallback: 5"), "fallback must be a string"),
])
def test_task_file_numbers_are_bounded_at_load(tmp_path, extra, key):
    with pytest.raises(TaskError) as e:
        load_task(_task(tmp_path, extra))
    assert key in str(e.value) and str(tmp_path / "t.yaml") in str(e.value)


def test_task_file_numbers_inside_the_bounds_load(tmp_path):
    extra = "repeats: 1000\n" + PASS.format("k: [1, 10], timeout_s: 600, memory_mb: 64")
    t = load_task(_task(tmp_path, extra))
    assert t.repeats == 1000 and t.metrics["pass_at_k"]["timeout_s"] == 600
    assert set(BOUNDS) >= {"repeats", "pass_at_k.memory_mb", "pass_at_k.timeout_s"}


# -- sweep, scaling, serve ------------------------------------------------------------------------------
def test_a_huge_grid_is_refused_before_any_point_is_built():
    from lmforge.tools.sweep import MAX_SWEEP_POINTS, grid_points, parse_axis

    axes = [parse_axis(f"k{i}=" + ",".join(map(str, range(1000)))) for i in range(4)]  # 10^12 points
    t0 = time.perf_counter()
    with pytest.raises(LmforgeError, match=r"1,000,000,000,000 points; a sweep runs at most 10,000"):
        grid_points(axes)
    assert time.perf_counter() - t0 < 1.0
    assert len(grid_points(axes[:1])) == 1000 <= MAX_SWEEP_POINTS
    with pytest.raises(LmforgeError, match="--random must be a whole number from 1 to 10,000"):
        grid_points([parse_axis("optim.lr=1e-4..1e-2")], random_k=10**6)
    for spec in ("optim.lr=nan..1e-2", "optim.lr=1e-4..inf", "optim.lr=1e-4..1e999"):
        with pytest.raises(LmforgeError, match="finite numbers LOW < HIGH"):
            parse_axis(spec)


def test_a_plan_needs_finite_positive_numbers_all_the_way():
    from lmforge.tools.scaling import LAWS, make_plan

    law = LAWS["epoch"]
    for kw in ({"compute": math.nan}, {"compute": math.inf}, {"params": -1.0}, {"tokens": 0.0}):
        with pytest.raises(LmforgeError, match="must be a positive number"):
            make_plan(law, **kw)
    with pytest.raises(LmforgeError, match=r"--params 1e\+300 gives no finite plan under law epoch"):
        make_plan(law, params=1e300)  # the budget for 1e300 parameters overflows a float
    with pytest.raises(LmforgeError, match=r"--tokens 1e-300 gives no finite plan .*compute 0 FLOPs"):
        make_plan(law, tokens=1e-300)  # ... and for 1e-300 tokens underflows to 0
    assert make_plan(law, compute=1e30).steps > 0


def test_serve_binds_only_a_real_port_and_requests_refuse_nan():
    from lmforge.serve import bind
    from lmforge.serve.protocol import ChatCompletionRequest, CompletionRequest

    for port in (70000, -1, 2**16):
        with pytest.raises(LmforgeError, match="--port must be a whole number from 0 to 65,535"):
            bind("127.0.0.1", port)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for field in ("temperature", "top_p"):
        for bad in (math.nan, math.inf):
            with pytest.raises(ValidationError, match="finite number"):
                ChatCompletionRequest.model_validate({**body, field: bad})
    with pytest.raises(ValidationError, match="finite number"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": math.nan})
