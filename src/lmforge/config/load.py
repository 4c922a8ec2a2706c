"""YAML <-> Config, `--set a.b=c` overrides, and error messages that name file, line, key and choices."""

from __future__ import annotations

import difflib
import os
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from lmforge.config.schema import Config
from lmforge.errors import ConfigError, LmforgeDeprecationWarning
from lmforge.utils import safe_yaml
from lmforge.utils.safe_yaml import compose_yaml, load_yaml, read_yaml_text


def _key_lines(path: str, text: str) -> dict[tuple[str, ...], int]:
    """Map every dotted key path in a YAML mapping document to its 1-based line number."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = prefix + (str(k.value),)
                lines[key] = k.start_mark.line + 1
                walk(v, key)

    try:  # the text was read by load_yaml already: its size and expansion are within bounds
        ld, root = compose_yaml(text, path, error=ConfigError)
        ld.dispose()
    except (yaml.YAMLError, ConfigError):
        return lines
    if root is not None:
        walk(root, ())
    return lines


def check_nesting(text: str, where: str) -> None:
    """ConfigError for flow nesting too deep for yaml's scanner (utils/safe_yaml.py), before it reads."""
    safe_yaml.check_nesting(text, where, ConfigError)


def parse_yaml_text(text: str, where: str) -> Any:
    """The YAML document `text` read within utils/safe_yaml.py's budget (safe tags only), or ConfigError
    naming `where`, the line and the problem: bad syntax, a tag such as !!python/object, a value yaml
    cannot build, nesting too deep, an alias bomb, a text too long."""
    try:
        return load_yaml(text, where, error=ConfigError)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark else where
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{at}: invalid YAML: {problem}") from None


def read_text(path: Path, what: str) -> str:
    """The text of a `what` file (a config, a DeepSpeed config, ...), size-bounded; a missing or unreadable
    file is a ConfigError naming it."""
    try:
        return read_yaml_text(path, ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} file {path}: {e}") from None


def _parse_yaml(path: Path) -> dict[str, Any]:
    text = read_text(path, "config")
    data = parse_yaml_text(text, str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _tagged_members(annotation: Any) -> dict[str, type[BaseModel]]:
    """tag -> class of a discriminated union of sections keyed by `name` (the optim section)."""
    members = {}
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel) and "name" in arg.model_fields:
            members[arg.model_fields["name"].default] = arg
    return members


def _section_model(model_cls: type[BaseModel], keys: tuple[str, ...],
                   tags: dict[tuple[str, ...], str] | None = None) -> type[BaseModel] | None:
    """The pydantic class at a dotted path inside Config, or None if the path leaves the tree. A
    union of sections resolves to the member `tags[path]` names."""
    cls: type[BaseModel] = model_cls
    for i, k in enumerate(keys):
        field = cls.model_fields.get(k)
        if field is None:
            return None
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            member = _tagged_members(ann).get((tags or {}).get(keys[: i + 1], ""))
            if member is None:
                return None
            ann = member
        cls = ann
    return cls


def _untag(loc: tuple[str, ...]) -> tuple[tuple[str, ...], dict[tuple[str, ...], str]]:
    """pydantic puts a discriminated union's tag into an error's location ('optim', 'muon', 'lr');
    the user's key has none ('optim', 'lr'). Returns the user's location and the tags found."""
    cls: type[BaseModel] | None = Config
    out: list[str] = []
    tags: dict[tuple[str, ...], str] = {}
    i = 0
    while i < len(loc):
        out.append(loc[i])
        field = cls.model_fields.get(loc[i]) if cls is not None else None
        nxt = None
        if field is not None:
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                nxt = ann
            else:
                members = _tagged_members(ann)
                if i + 1 < len(loc) and loc[i + 1] in members:
                    tags[tuple(out)] = loc[i + 1]
                    nxt = members[loc[i + 1]]
                    i += 1
        cls = nxt
        i += 1
    return tuple(out), tags


def _suggest(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; valid keys: {', '.join(sorted(choices))}"


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    parent_keys: tuple[str, ...] = ()
    node = data
    for i, k in enumerate(keys):
        cls = _section_model(Config, parent_keys)
        if cls is not None and k not in cls.model_fields:
            where = ".".join(parent_keys) or "the top level"
            raise ConfigError(
                f"--set {dotted}: unknown key {'.'.join(keys[: i + 1])!r} in {where}"
                + _suggest(k, list(cls.model_fields))
            )
        if i == len(keys) - 1:
            node[k] = value
            return
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {'.'.join(keys[: i + 1])} is a value, not a section")
        node = child
        parent_keys += (k,)


def parse_override(item: str) -> tuple[str, Any]:
    """'train.max_steps=10' -> ('train.max_steps', 10); the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.max_steps=100")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = load_yaml(raw, f"--set {key}", error=ConfigError) if raw.strip() else None
    except yaml.YAMLError:  # not YAML after all (or a date that is no date): the text
        value = raw
    return key, value


def _format_error(err: dict[str, Any], source: str, lines: dict[tuple[str, ...], int],
                  overridden: set[str]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    # Drop pydantic's internal validator names from the location.
    loc = tuple(p for p in loc if not p.startswith("function-") and p not in {"tagged-union"})
    loc, tags = _untag(loc)
    dotted = ".".join(loc)
    where = source
    if dotted in overridden or any(
        dotted.startswith(o + ".") or o.startswith(dotted + ".") for o in overridden
    ):
        where = f"--set {dotted}"
    else:
        for n in range(len(loc), 0, -1):
            if loc[:n] in lines:
                where = f"{source}:{lines[loc[:n]]}"
                break
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _section_model(Config, loc[:-1], tags)
        valid = _suggest(loc[-1], list(parent.model_fields)) if parent else ""
        return f"{where}: unknown key {dotted!r}{valid}"
    msg = err["msg"].removeprefix("Value error, ")
    key = f"key {dotted!r}" if dotted else "config"
    if "input" in err and kind not in {"missing"} and not isinstance(err["input"], dict):
        return f"{where}: {key}: bad value {err['input']!r}: {msg}"
    return f"{where}: {key}: {msg}"


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or start from defaults), apply `--set` overrides, validate.

    Raises ConfigError naming the file and line (or the override), the key, the bad value
    and the valid choices.
    """
    data: dict[str, Any] = {}
    lines: dict[tuple[str, ...], int] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        data = _parse_yaml(p)
        lines = _key_lines(str(p), read_yaml_text(p, ConfigError))
        source = str(p)
    return config_from_dict(data, overrides, source, lines)


def config_from_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (),
                     source: str = "<config>", lines: dict[tuple[str, ...], int] | None = None) -> Config:
    """Apply `--set` overrides to a raw mapping and validate it."""
    data = dict(data)
    overridden: set[str] = set()
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
        overridden.add(key)
    return validate_config(data, source=source, lines=lines, overridden=overridden)


def validate_config(data: dict[str, Any], source: str = "<config>",
                    lines: dict[tuple[str, ...], int] | None = None,
                    overridden: set[str] | None = None) -> Config:
    """Validate a raw mapping into a Config, with readable errors. Deprecation notes from the
    schema (old key forms it still reads) are re-issued naming the file and line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cfg = Config.model_validate(data)
        except ValidationError as e:
            msgs = [_format_error(err, source, lines or {}, overridden or set()) for err in e.errors()]
            head = "invalid config" if len(msgs) == 1 else f"invalid config ({len(msgs)} problems)"
            raise ConfigError(head + ":\n  " + "\n  ".join(msgs)) from None
    for w in caught:
        if issubclass(w.category, LmforgeDeprecationWarning):
            line = (lines or {}).get(("optim",))
            set_here = any(o.startswith("optim.") for o in overridden or ())
            where = "--set optim" if set_here else f"{source}:{line}" if line else source
            warnings.warn(LmforgeDeprecationWarning(f"{where}: {w.message}"), stacklevel=2)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (tuples become lists)."""
    return cfg.model_dump(mode="json")


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config atomically."""
    from lmforge.utils.io import atomic_write_text

    atomic_write_text(path, dump_config(cfg))


def as_config(config: Config | str | Path | dict | None) -> Config:
    """A Config from a Config, a YAML path, a dict of sections, or None (the defaults)."""
    if config is None or isinstance(config, Config):
        return config or Config()
    if isinstance(config, (str, Path)):
        return load_config(config)
    if isinstance(config, dict):
        return config_from_dict(config, source="<config dict>")
    raise ConfigError(f"config: expected a Config, a YAML path or a dict, got {type(config).__name__}")
