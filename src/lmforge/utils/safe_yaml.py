"""YAML from a user or a file, read with a budget: every config, task file, constitution and `--set` value
goes through `load_yaml`.

PyYAML's safe loaders build no objects from tags, but two things still scale far past the text:
- aliases: `b: [*a, *a]` repeated 30 times is a few hundred bytes whose expansion has 2^30 nodes. The
  loader itself shares the repeated objects, so reading is cheap, and then whoever walks the result
  (validation, a search for `!function`, json.dumps) hangs or runs out of memory. The node graph is
  therefore measured before anything is built: its size with every alias expanded, counted in time linear
  in the text (each node's expanded size is summed once);
- size and depth: the pure-Python parser takes seconds per megabyte, its scanner slows with the square
  of the flow nesting (`[[[[...]]]]`) and its composer recurses once per nesting level. Text above
  MAX_BYTES, flow nesting past MAX_FLOW_DEPTH and block nesting deeper than Python's stack are refused
  with a clear error instead.
A value the safe constructors cannot build (2001-02-30 as a date) is a YAML error at its line.
Limits: real configs and task files are a few kilobytes with a few hundred nodes.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from lmforge.errors import LmforgeError

MAX_BYTES = 1 << 20  # 1 MiB of YAML text; the parser reads about 0.25 MB/s on a slow core
MAX_NODES = 100_000  # scalars, sequences and mappings, each alias counted as everything it stands for
MAX_FLOW_DEPTH = 64  # open [ / { at once: yaml's scanner slows with the square of that depth


class SafeLoader(yaml.SafeLoader):
    """yaml's safe loader, with a value its constructors refuse (a date such as 2001-02-30, for which they
    raise ValueError) reported as a YAML error at the value's line."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {node.value!r}: {e}", node.start_mark
            ) from None


def check_nesting(text: str, source: str, error: type[LmforgeError] = LmforgeError) -> None:
    """`error` if `text` opens more than MAX_FLOW_DEPTH [ or { without closing them: yaml's scanner takes
    time that grows with the square of that depth (1,000 levels: seconds; 5,000: half a minute), before
    its composer would run out of stack. Brackets inside quotes count too (a scanner that skipped quotes
    could be fooled by a stray one); no config or task file holds 64 open brackets in a string."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "[{":
            depth += 1
            if depth > MAX_FLOW_DEPTH:
                line = text.count("\n", 0, i) + 1
                raise error(f"{source}:{line}: invalid YAML: the [ ] / {{ }} brackets nest too deep (more "
                            f"than {MAX_FLOW_DEPTH} levels; a config or task file needs a few)")
        elif ch in "]}":
            depth = max(0, depth - 1)


def expanded_size(node: yaml.Node, limit: int) -> int:
    """Nodes of `node`'s graph with every alias expanded, counting stops once past `limit`; a graph that
    contains itself (`&a [*a]`) counts as past it."""
    sizes: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:  # post-order without recursion: children first, then their parent
        n, children_done = stack.pop()
        if id(n) in sizes:
            continue
        kids = _children(n)
        if not children_done:
            if id(n) in entered:  # reached again from below itself: a cycle
                return limit + 1
            entered.add(id(n))
            stack.append((n, True))
            stack.extend((k, False) for k in kids if id(k) not in sizes)
            continue
        sizes[id(n)] = min(limit + 1, 1 + sum(sizes[id(k)] for k in kids))
    return sizes[id(node)]


def _children(n: yaml.Node) -> list[yaml.Node]:
    if isinstance(n, yaml.SequenceNode):
        return list(n.value)
    if isinstance(n, yaml.MappingNode):
        return [x for pair in n.value for x in pair]
    return []


def compose_yaml(text: str, source: str, loader: type = SafeLoader, *,
                 error: type[LmforgeError] = LmforgeError) -> tuple[Any, yaml.Node | None]:
    """(the loader that composed it, the node graph of `text`) once the text and its expansion are within
    the limits; yaml.YAMLError for text that is not YAML (callers report its line as they do now)."""
    if len(text) > MAX_BYTES:
        raise error(f"{source}: {len(text):,} characters of YAML; at most {MAX_BYTES:,} are read (a config "
                    "or task file is a few kilobytes)")
    check_nesting(text, source, error)
    ld = loader(text)
    try:
        node = ld.get_single_node()
    except RecursionError:
        ld.dispose()
        raise error(f"{source}: the YAML nests too deep to read; flatten it") from None
    if node is not None and expanded_size(node, MAX_NODES) > MAX_NODES:
        ld.dispose()
        raise error(f"{source}: the YAML expands to more than {MAX_NODES:,} values through its anchors and "
                    "aliases (&name / *name), or refers to itself: refused as an alias bomb; write the "
                    "values out or use fewer aliases")
    return ld, node


def read_yaml_text(path: str | os.PathLike, error: type[LmforgeError] = LmforgeError) -> str:
    """The UTF-8 text of a YAML file, refused past MAX_BYTES without reading the rest (OSError and
    UnicodeDecodeError as `Path.read_text` raises them)."""
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise error(f"{path}: more than {MAX_BYTES:,} bytes of YAML; a config or task file is a few "
                    "kilobytes")
    return data.decode("utf-8")


def load_yaml(text: str, source: str, loader: type = SafeLoader, *,
              error: type[LmforgeError] = LmforgeError) -> Any:
    """`yaml.load(text, loader)` within the limits of the module doc; `source` names the text in errors
    (a file, `--set key`), `error` is the LmforgeError subclass raised for a refused document."""
    ld, node = compose_yaml(text, source, loader, error=error)
    try:
        return None if node is None else ld.construct_document(node)
    except RecursionError:
        raise error(f"{source}: the YAML nests too deep to read; flatten it") from None
    finally:
        ld.dispose()
