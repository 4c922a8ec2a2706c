"""Reading a task file (lm-evaluation-harness's YAML, with `include`) into a checked `Task`: every problem
is a TaskError naming the file and the key; `!function` entries and Python hooks are refused."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lmforge.eval.tasks.errors import TaskError
from lmforge.eval.tasks.filters import parse_filters
from lmforge.eval.tasks.metrics import parse_metrics
from lmforge.eval.tasks.spec import (
    BOUNDS,
    CODE_KEYS,
    IGNORED_KEYS,
    KNOWN_KEYS,
    MAX_INCLUDE_DEPTH,
    OUTPUT_TYPES,
    Task,
)
from lmforge.utils.safe_yaml import load_yaml, read_yaml_text


class _Function:
    """A `!function` node: refused when the task is checked (lmforge runs no code from task files)."""

    def __init__(self, name: str) -> None:
        self.name = name


class _TaskLoader(yaml.SafeLoader):
    pass


_TaskLoader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))


def load_task(path: str | Path, num_fewshot: int | None = None) -> Task:
    """A task file, checked: every problem is a TaskError naming the file and the key."""
    path = Path(path)
    raw = _read_yaml(path, depth=0, seen=())
    _refuse_code(raw, path, ())
    unknown = sorted(set(raw) - KNOWN_KEYS - IGNORED_KEYS - CODE_KEYS)
    if unknown:
        raise TaskError(
            f"{path}: unknown key(s) {', '.join(unknown)} (lmforge reads the common subset of "
            f"lm-evaluation-harness task files: {', '.join(sorted(KNOWN_KEYS))})"
        )
    for key in sorted(CODE_KEYS & set(raw)):
        raise TaskError(
            f"{path}: key '{key}' needs Python code or media, which lmforge does not run from "
            "task files; prepare the documents as a file instead"
        )
    keys = _Keys(path, raw)
    need, bounded = keys.need, keys.bounded
    name = need("task", (str,), path.stem)
    output_type = need("output_type", (str,), "generate_until")
    if output_type not in OUTPUT_TYPES:
        raise TaskError(f"{path}: output_type '{output_type}' is not one of {', '.join(OUTPUT_TYPES)}")
    doc_to_choice = need("doc_to_choice", (str, list, dict), None)
    if output_type == "multiple_choice" and doc_to_choice is None:
        raise TaskError(f"{path}: key 'doc_to_choice' is missing (a multiple_choice task needs its choices)")
    if isinstance(doc_to_choice, list) and not doc_to_choice:
        raise TaskError(f"{path}: key 'doc_to_choice' is an empty list")
    doc_to_text = need("doc_to_text", (str, int), None if output_type == "loglikelihood_rolling" else ...)
    doc_to_target = need("doc_to_target", (str, int, list))
    splits = _splits(raw, path)
    eval_split, fewshot_split = _eval_and_fewshot_split(keys, splits)
    fewshot_config = need("fewshot_config", (dict,), {})
    sampler = fewshot_config.get("sampler", "default")
    if sampler not in ("default", "first_n"):
        raise TaskError(f"{path}: fewshot_config.sampler '{sampler}' is not supported (default or first_n)")
    generation = _generation(keys)
    repeats = bounded("repeats", need("repeats", (int,), 1))
    nf = bounded("num_fewshot", need("num_fewshot", (int,), 0) if num_fewshot is None else num_fewshot)
    chance = need("chance", (int, float), None)
    chance = None if chance is None else bounded("chance", chance)
    return Task(
        name=name,
        path=path,
        output_type=output_type,
        doc_to_text=doc_to_text,
        doc_to_target=doc_to_target,
        doc_to_choice=doc_to_choice,
        target_delimiter=need("target_delimiter", (str,), " "),
        fewshot_delimiter=need("fewshot_delimiter", (str,), "\n\n"),
        description=need("description", (str,), ""),
        num_fewshot=nf,
        sampler=sampler,
        splits=splits,
        eval_split=eval_split,
        fewshot_split=fewshot_split,
        **generation,
        repeats=repeats,
        metrics=parse_metrics(raw.get("metric_list"), output_type, path),
        filters=parse_filters(raw.get("filter_list"), path),
        chance=None if chance is None else float(chance),
    )


class _Keys:
    """A task file's keys, read with their types and bounds checked (errors name the file and key)."""

    def __init__(self, path: Path, raw: dict) -> None:
        self.path, self.raw = path, raw

    def need(self, key: str, kinds: tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.raw or self.raw[key] is None:
            if default is ...:
                raise TaskError(f"{self.path}: key '{key}' is missing")
            return default
        value = self.raw[key]
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            names = " or ".join(k.__name__ for k in kinds)
            raise TaskError(f"{self.path}: key '{key}' must be {names} (got {type(value).__name__})")
        return value

    def bounded(self, key: str, value: Any) -> Any:
        return BOUNDS[key].check(value, f"{self.path}: key '{key}'", TaskError)


def _eval_and_fewshot_split(keys: _Keys, splits: dict[str, list[Path]]) -> tuple[str, str]:
    """The split evaluated (test_split, else validation_split, else the only one) and the one few-shot
    examples come from (fewshot_split, else training, validation, then the evaluated split)."""
    path = keys.path
    split_keys = {
        k: keys.need(k, (str,), None)
        for k in ("test_split", "validation_split", "training_split", "fewshot_split")
    }
    for key, split in split_keys.items():
        if split is not None and split not in splits:
            raise TaskError(
                f"{path}: key '{key}' names split '{split}', but the data has only "
                f"{', '.join(sorted(splits))}"
            )
    eval_split = split_keys["test_split"] or split_keys["validation_split"]
    if eval_split is None:
        if len(splits) != 1:
            raise TaskError(
                f"{path}: key 'test_split' is missing (the data has splits {', '.join(sorted(splits))})"
            )
        eval_split = next(iter(splits))
    fewshot_split = (
        split_keys["fewshot_split"]
        or split_keys["training_split"]
        or split_keys["validation_split"]
        or eval_split
    )
    return eval_split, fewshot_split


def _generation(keys: _Keys) -> dict[str, Any]:
    """generation_kwargs, checked: the Task's until, max_gen_toks, temperature, top_k and top_p."""
    path, bounded = keys.path, keys.bounded
    gen = keys.need("generation_kwargs", (dict,), {})
    until = gen.get("until", [])
    until = [until] if isinstance(until, str) else until
    if not isinstance(until, list) or not all(isinstance(u, str) for u in until):
        raise TaskError(f"{path}: generation_kwargs.until must be a string or a list of strings")
    max_gen_toks = bounded("generation_kwargs.max_gen_toks", gen.get("max_gen_toks", 256))
    unknown_gen = sorted(set(gen) - {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"})
    if unknown_gen:
        raise TaskError(
            f"{path}: generation_kwargs has unknown key(s) {', '.join(unknown_gen)} (until, "
            "max_gen_toks, do_sample, temperature, top_k, top_p)"
        )
    temperature = 0.0
    if gen.get("do_sample"):  # as transformers: sampling only when asked for, at temperature 1 by default
        temperature = bounded("generation_kwargs.temperature", gen.get("temperature", 1.0))
    top_k, top_p = gen.get("top_k"), gen.get("top_p")
    top_k = None if top_k is None else bounded("generation_kwargs.top_k", top_k)
    top_p = None if top_p is None else bounded("generation_kwargs.top_p", top_p)
    return {
        "until": until,
        "max_gen_toks": max_gen_toks,
        "temperature": float(temperature),
        "top_k": top_k or None,
        "top_p": None if top_p is None else float(top_p),
    }


def _read_yaml(path: Path, depth: int, seen: tuple[Path, ...]) -> dict:
    if depth > MAX_INCLUDE_DEPTH:
        raise TaskError(f"{path}: includes nest deeper than {MAX_INCLUDE_DEPTH} files")
    try:
        resolved = path.resolve()
    except OSError as e:
        raise TaskError(f"{path}: cannot read the task file ({e.strerror or e})") from None
    if resolved in seen:
        raise TaskError(f"{path}: includes itself (through {' -> '.join(map(str, seen))})")
    if not path.is_file():
        raise TaskError(f"{path}: no such task file")
    try:
        raw = load_yaml(read_yaml_text(path, TaskError), str(path), _TaskLoader, error=TaskError)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise TaskError(f"{path}{at}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(raw, dict):
        raise TaskError(
            f"{path}: a task file is a YAML mapping of keys (task, dataset_path, doc_to_text, ...)"
        )
    include = raw.pop("include", None)
    if include is None:
        return raw
    if not isinstance(include, str):
        raise TaskError(f"{path}: key 'include' must be a file name")
    base = _read_yaml(_beside(path, include), depth + 1, (*seen, resolved))
    return {**base, **raw}


def _beside(path: Path, name: str) -> Path:
    p = Path(name)
    return p if p.is_absolute() else path.parent / p


def _refuse_code(value: Any, path: Path, keys: tuple[str, ...]) -> None:
    if isinstance(value, _Function):
        where = ".".join(keys) or "(top level)"
        raise TaskError(
            f"{path}: key '{where}' is `!function {value.name}` (Python code): lmforge runs no "
            "code from task files; use a field name or a Jinja template"
        )
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_code(v, path, (*keys, str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_code(v, path, (*keys, str(i)))


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


def _splits(raw: dict, path: Path) -> dict[str, list[Path]]:
    """Split name -> data files: dataset_kwargs.data_files (a file, a list, or {split: files}) under a
    dataset_path of json / parquet / arrow, or dataset_path itself a file (split 'test') or a dir of
    <split>.<ext> files / a saved datasets dir with one subdir per split. Relative paths are taken from
    the task file's dir when they exist there, else from the current dir."""
    dataset_path = raw.get("dataset_path")
    kwargs = raw.get("dataset_kwargs") or {}
    if not isinstance(dataset_path, str) or not dataset_path:
        raise TaskError(
            f"{path}: key 'dataset_path' is missing (a local file or dir, or json / parquet "
            "with dataset_kwargs.data_files)"
        )
    if not isinstance(kwargs, dict):
        raise TaskError(f"{path}: key 'dataset_kwargs' must be a mapping")

    def local(name: Any, key: str) -> Path:
        if not isinstance(name, str) or not name:
            raise TaskError(f"{path}: key '{key}' must be a file path")
        p = Path(name).expanduser()
        if not p.is_absolute():
            here = path.parent / p
            p = here if here.exists() or not p.exists() else p
        return p

    if dataset_path in ("json", "parquet", "arrow", "csv"):
        if dataset_path == "csv":
            raise TaskError(
                f"{path}: dataset_path csv is not supported; convert the documents to JSONL or Parquet"
            )
        files = kwargs.get("data_files")
        if files is None:
            raise TaskError(f"{path}: dataset_path '{dataset_path}' needs dataset_kwargs.data_files")
        if isinstance(files, dict):
            return {
                str(split): [
                    local(f, f"dataset_kwargs.data_files.{split}")
                    for f in (v if isinstance(v, list) else [v])
                ]
                for split, v in files.items()
            }
        files = files if isinstance(files, list) else [files]
        return {"train": [local(f, "dataset_kwargs.data_files") for f in files]}  # datasets' name for it
    p = local(dataset_path, "dataset_path")
    if p.is_file():
        return {"test": [p]}
    if p.is_dir():
        found: dict[str, list[Path]] = {}
        for child in sorted(p.iterdir()):
            if child.is_file() and child.suffix.lower() in DATA_SUFFIXES:
                found.setdefault(child.stem, []).append(child)
            elif child.is_dir() and any(f.suffix == ".arrow" for f in child.iterdir()):
                found.setdefault(child.name, []).append(child)
        if found:
            return found
        raise TaskError(f"{path}: dataset_path {p} holds no <split>.jsonl / .parquet files or split dirs")
    hub = (
        ""
        if p.exists()
        else (
            " (lmforge reads local data only: nothing is downloaded; give a file or dir)"
            if "/" in dataset_path and not dataset_path.startswith((".", "/"))
            else ""
        )
    )
    raise TaskError(f"{path}: dataset_path {dataset_path!r} is not a file or dir{hub}")



def discover(item: str, bundle_dir: Path | None = None) -> list[Path]:
    """Task files named by one --tasks item: a .yaml file, a dir of them, or a shipped task's name."""
    p = Path(item)
    if p.suffix.lower() in (".yaml", ".yml"):
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in (".yaml", ".yml"))
        if not files:
            raise TaskError(f"{p}: no task files (.yaml) in this dir")
        return files
    raise TaskError(f"{item}: not a task file (.yaml) or a dir of them")


def load_tasks(items: Sequence[str], num_fewshot: int | None = None) -> list[Task]:
    tasks: list[Task] = []
    for item in items:
        tasks.extend(load_task(f, num_fewshot) for f in discover(item))
    names = [t.name for t in tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise TaskError(f"two task files share the task name(s) {', '.join(dup)}")
    return tasks
