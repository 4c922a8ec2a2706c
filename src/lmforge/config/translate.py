"""What the DeepSpeed and Trainer-argument translators share: reading a file from elsewhere within a budget,
the Translation they produce (lmforge keys with the source key each came from, and every key that did not
map with its reason), and applying one under a user's config.

The tables themselves live in translate_deepspeed.py and translate_hf.py, one module per source, so a
reader can audit each mapping in one place. Nothing here imports torch.

Applying a translation under a config: a key the user set explicitly (in -c FILE or with --set) and the
translation also sets is a contradiction and an error naming both, unless both give the same value; the
user removes one. Keys the user left at their default take the translated value. Every translated value is
validated by lmforge's own schema, and a bad one is reported with the source key and the lmforge key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lmforge.errors import ConfigError
from lmforge.utils.safe_yaml import MAX_FLOW_DEPTH, check_nesting, read_yaml_text

MAX_KEYS = 2_000  # keys in all levels of one file: a ds_config or TrainingArguments dump has ~150


@dataclass
class Translation:
    """lmforge dotted key -> (value, the source key it came from), and the source keys that did not map."""

    source: str  # the file (or "<name>") the keys came from
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)  # (source key, value, why)

    def set(self, key: str, value: Any, source_key: str) -> None:
        self.values[key] = (value, source_key)

    def skip(self, source_key: str, value: Any, why: str) -> None:
        self.unmapped.append((source_key, value, why))

    def merge(self, other: Translation) -> None:
        """Take `other`'s keys too; the same lmforge key with two different values is a contradiction."""
        for key, (value, src) in other.values.items():
            if key in self.values and self.values[key][0] != value:
                mine, my_src = self.values[key]
                raise ConfigError(f"{other.source}: {src}={value!r} contradicts {self.source}: {my_src}="
                                  f"{mine!r} (both set lmforge {key}); make them agree or remove one")
            if key not in self.values:
                self.values[key] = (value, f"{src} ({other.source})")
        self.unmapped.extend((f"{k} ({other.source})", v, why) for k, v, why in other.unmapped)


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool): what a numeric source key must hold."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON (or YAML) file holding one object, read within a budget: at most safe_yaml.MAX_BYTES, nesting
    at most MAX_FLOW_DEPTH, at most MAX_KEYS keys; anything else is a ConfigError naming the file."""
    from lmforge.config.load import parse_yaml_text, read_text

    p = Path(path)
    text = read_text(p, what)
    if p.suffix.lower() in (".yaml", ".yml"):

        data = parse_yaml_text(text, str(p))
    else:
        check_nesting(text, str(p), ConfigError)  # json recurses once per level: bound it first
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{e.lineno}: invalid JSON: {e.msg} (a {what} file is one JSON object; "
                              "a .yaml/.yml file is read as YAML)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: a {what} file must hold one object of keys, got "
                          f"{type(data).__name__}")
    if _count_keys(data) > MAX_KEYS:
        raise ConfigError(f"{p}: more than {MAX_KEYS:,} keys; a {what} file has a few hundred at most")
    return data


def _count_keys(node: Any, depth: int = 0) -> int:
    if depth > MAX_FLOW_DEPTH:  # YAML block nesting is not counted by check_nesting
        raise ConfigError(f"keys nest deeper than {MAX_FLOW_DEPTH} levels")
    if isinstance(node, dict):
        return len(node) + sum(_count_keys(v, depth + 1) for v in node.values())
    if isinstance(node, list):
        return sum(_count_keys(v, depth + 1) for v in node)
    return 0


def _nested(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in values.items():
        node = out
        *parents, last = dotted.split(".")
        for k in parents:
            if not isinstance(node.get(k), dict):  # absent, or a `section: null` the value replaces
                node[k] = {}
            node = node[k]
        node[last] = value
    return out


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def check_values(t: Translation) -> None:
    """Validate the translated keys alone with lmforge's schema; a bad one names its source key."""
    from lmforge.config.load import _untag
    from lmforge.config.schema import Config

    try:
        Config.model_validate(_nested({k: v for k, (v, _) in t.values.items()}))
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = tuple(str(p) for p in err["loc"] if not str(p).startswith("function-")
                        and p != "tagged-union")
            dotted = ".".join(_untag(loc)[0])
            hits = [k for k in t.values if k == dotted or k.startswith(dotted + ".")] or [
                k for k in t.values if dotted.startswith(k + ".")]
            # A section's own check (loc = the section) names its key in the message: keep that one.
            hits = [k for k in hits if k in err["msg"]] or hits
            src = ", ".join(t.values[k][1] for k in hits) or "(derived)"
            shown = ", ".join(f"{k}={t.values[k][0]!r}" for k in hits) or dotted
            msgs.append(f"{t.source}: {src} -> lmforge {shown}: {err['msg'].removeprefix('Value error, ')}")
        raise ConfigError("the translated config is invalid:\n  " + "\n  ".join(msgs)) from None


def apply_translation(t: Translation, config_path: str | None, overrides: list[str] | tuple[str, ...]):
    """The Config of -c FILE and --set with `t` under them: contradictions with the user's explicit keys
    are errors (see the module doc). Returns the validated Config."""
    from lmforge.config.load import _key_lines, _parse_yaml, config_from_dict, parse_override

    check_values(t)
    data: dict[str, Any] = {}
    lines: dict[tuple[str, ...], int] = {}
    source = "<defaults>"
    if config_path is not None:
        data = _parse_yaml(Path(config_path))
        lines = _key_lines(config_path, read_yaml_text(config_path, ConfigError))
        source = str(config_path)
    explicit = {k: (v, f"{source}:{lines.get(tuple(k.split('.')), '?')}") for k, v in _flat(data).items()}
    for item in overrides:
        key, value = parse_override(item)
        flat = _flat(value, key + ".") if isinstance(value, dict) else {key: value}
        explicit.update({k: (v, f"--set {key}") for k, v in flat.items()})
    explicit = {k: v for k, v in explicit.items() if v[0] != {}}  # an empty section sets nothing
    for key, (value, src) in t.values.items():
        for mine in (key, *(k for k in explicit if k.startswith(key + ".") or key.startswith(k + "."))):
            if mine != key and key.startswith(mine + ".") and explicit[mine][0] is None:
                continue  # `section: null` holds no key of its own
            if mine in explicit and explicit[mine][0] != value:
                where, had = explicit[mine][1], explicit[mine][0]
                raise ConfigError(f"{where}: {mine}={had!r} contradicts {t.source}: {src} (lmforge "
                                  f"{key}={value!r}); remove one of them or make them agree")
    merged = _nested({**_flat(data), **{k: v for k, (v, _) in t.values.items()}})
    return config_from_dict(merged, overrides, source, lines)


def is_empty(value: Any) -> bool:
    """A value that asks for nothing (unset, off, empty): such keys share one row and are not warned about."""
    return value is None or value is False or value in ("", "no", "none", 0) or value == [] or value == {}


def unmapped_table(t: Translation):
    """A rich Table of the keys that did not map and why (None when every key mapped). The keys whose value
    asks for nothing (null, false, 0, empty) share the last row, named."""
    if not t.unmapped:
        return None
    from rich.table import Table

    table = Table(title=f"not translated ({len(t.unmapped)} keys)", show_header=True)
    table.add_column("key", overflow="fold")
    table.add_column("value", overflow="fold")
    table.add_column("why")
    empty = []
    for key, value, why in t.unmapped:
        if is_empty(value):
            empty.append(key)
            continue
        shown = json.dumps(value, default=str)
        table.add_row(key, shown if len(shown) <= 40 else shown[:37] + "...", why)
    if empty:
        table.add_row(", ".join(empty), "null / false / 0 / empty", "asks for nothing: nothing to translate")
    return table
