"""Which config keys name files, and what a run does with them: the one classification of path keys.

Every string-typed key of the schema is here, either in PATH_KEYS (with its role) or in NOT_PATHS;
tests/unit/test_config_paths.py walks the whole schema (sections, optional sections, unions and lists
of sections) and fails on a string key that is in neither, so a new path key cannot be forgotten.

- an *input* is read by the run: run.overwrite may never delete it, a run may not write into it, and
  the job server confines it to what the submitting user may read (checkpoint/run_dir.py,
  jobserver/confine.py);
- an *output* is written by the run (run.dir, the caches and stores it fills): the job server keeps it
  inside the user's own jobs.

A value may also be a name rather than a path (builtin:python, sft.template's auto), or carry a prefix
before its path (hf:<dir>, file:<dir>); `PathKey.split` tells them apart, so every caller reads a value
the same way.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from pydantic import BaseModel

INPUT, OUTPUT = "input", "output"


@dataclass(frozen=True)
class PathKey:
    """How one key's values name files."""

    role: str  # INPUT or OUTPUT
    names: tuple[str, ...] = ()  # whole values that name something built in, not a file (exact: a
    # "builtin:x" that is not one of them is read as a path by the readers, so it is one here too)
    path_prefixes: tuple[str, ...] = ()  # prefixes written before a path (hf:<dir>, file:<dir>)
    services: bool = False  # may also be the URL of a service (an MLflow tracking server)
    reused: bool = False  # an output an existing copy of which the run only reads (prepared data)

    def split(self, value: str) -> tuple[str, str] | None:
        """(prefix, path) of a value naming a file or dir, None for a built-in name or a service URL."""
        if value in self.names:
            return None
        if self.services and is_service_url(value):
            return None
        for prefix in self.path_prefixes:
            if value.startswith(prefix):
                return prefix, value[len(prefix):]
        return "", value


def is_service_url(value: str) -> bool:
    """A URL of something other than the local file system (http://host, databricks://...)."""
    scheme, sep, _ = value.partition("://")
    return bool(sep) and scheme.lower() != "file"


_DATA = PathKey(INPUT, names=("builtin:python",))
_FILES = PathKey(INPUT)

PATH_KEYS: dict[str, PathKey] = {
    "data.sources": _DATA,
    "data.sources.path": _DATA,  # a weighted entry {path, weight, name}
    "data.val_sources": _DATA,
    "data.tokenizer.path": _FILES,
    "model.init_from": _FILES,  # also the reference model of dpo / rl
    "train.eval_tasks": PathKey(INPUT, names=("builtin:code",)),
    "sft.data": _FILES,
    "sft.val_data": _FILES,
    "sft.template": PathKey(INPUT, names=("auto", "chatml")),
    "preference.data": _FILES,
    "preference.val_data": _FILES,
    "rl.data": _FILES,
    "rl.val_data": _FILES,
    "rl.reward_model": _FILES,
    "distill.teacher": _FILES,
    "distill.topk_cache": _FILES,
    "gkd.teacher": _FILES,
    "classify.data": _FILES,
    "classify.val_data": _FILES,
    "token_classify.data": _FILES,
    "token_classify.val_data": _FILES,
    "qa.data": _FILES,
    "qa.val_data": _FILES,
    "seq2seq.data": _FILES,
    "seq2seq.val_data": _FILES,
    "finetune.init_adapter": _FILES,
    "curate.inputs": PathKey(INPUT, names=("builtin:python",), path_prefixes=("hf:",)),
    "curate.steps.blocklist_files": _FILES,
    "curate.steps.eval_files": _FILES,
    "run.dir": PathKey(OUTPUT),
    "data.dir": PathKey(OUTPUT, reused=True),
    "curate.output_dir": PathKey(OUTPUT),
    "logging.wandb.dir": PathKey(OUTPUT),
    "logging.mlflow.tracking_uri": PathKey(OUTPUT, path_prefixes=("file://", "file:"), services=True),
}

NOT_PATHS: frozenset[str] = frozenset({
    "run.name", "data.text_key", "model.preset", "model.quant.targets", "finetune.targets",
    "generate.prompt", "curate.text_key", "curate.id_key", "curate.steps.blocklist",
    "curate.steps.phone_regions", "curate.steps.languages", "logging.mlflow.experiment",
    "logging.mlflow.run_name", "logging.wandb.project", "logging.wandb.entity", "logging.wandb.run_name",
    "sft.template_kwargs", "model.hf_model_type", "optim.param_groups.match",
    "classify.text_field", "classify.text_pair_field", "classify.label_field",
    "token_classify.tokens_field", "token_classify.tags_field", "token_classify.label_names",
    "qa.context_field", "qa.question_field", "qa.answers_field",
    "seq2seq.input_field", "seq2seq.target_field",
    "data.sources.name",
})


# -- the schema's string keys -------------------------------------------------------------------------
def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The config sections an annotation holds: itself, a member of a union, or the items of a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [s for arg in typing.get_args(annotation) for s in _sections(arg)]


def _is_text(annotation: Any) -> bool:
    """True if a value of this type can be free text: str or a path, alone or inside a union, list or dict
    (a Literal's fixed choices are not free text)."""
    if annotation in (str, Path, PurePath):
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return False
    return any(_is_text(arg) for arg in typing.get_args(annotation))


def string_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema whose value is free text. A list of sections contributes its
    items' keys without an index (curate.steps.eval_files)."""
    if model is None:
        from lmforge.config.schema import Config

        model = Config
    found: list[str] = []
    for name, field in model.model_fields.items():
        key = prefix + name
        subs = _sections(field.annotation)
        for sub in subs:
            found += [k for k in string_keys(sub, key + ".") if k not in found]
        if _is_text(field.annotation):  # text itself, also beside sections (data.sources)
            found.append(key)
    return found


# -- the values of a config -----------------------------------------------------------------------------
def map_paths(data: dict[str, Any], fn: Callable[[str, PathKey, str], str]) -> dict[str, Any]:
    """`data` (a config as plain dicts and lists, e.g. Config.model_dump()) with every string value of every
    path key replaced by `fn(key, spec, value)` (`spec.split(value)` tells a path from a name)."""

    def walk(node: Any, key: str) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{key}.{k}" if key else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, key) for v in node]
        spec = PATH_KEYS.get(key)
        if spec is None or not isinstance(node, str):
            return node
        return fn(key, spec, node)

    return walk(data, "")


def path_values(cfg: Any, role: str | None = None) -> Iterator[tuple[str, Path]]:
    """(key, path) of every file a config names (with `role`, only inputs or only outputs), in schema order.
    Empty values are left out (they name nothing)."""
    found: list[tuple[str, Path]] = []

    def collect(key: str, spec: PathKey, value: str) -> str:
        split = spec.split(value)
        if split is not None and split[1] and (role is None or spec.role == role):
            found.append((key, Path(split[1])))
        return value

    map_paths(cfg.model_dump(mode="python"), collect)
    return iter(found)


def input_paths(cfg: Any) -> tuple[tuple[str, Path], ...]:
    """(key, path) of every file or dir the run reads: what run.overwrite may never delete."""
    return tuple(path_values(cfg, INPUT))
