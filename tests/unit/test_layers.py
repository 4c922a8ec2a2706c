"""The package graph: every `import` in src/lmforge points down the declared layers, and no modules
import each other in a circle. Lazy imports inside functions count for both (they are dependencies
all the same); imports under `if TYPE_CHECKING:` count for the direction only, since they never run
(a callback module may name the Trainer type it is handed).

Run as a script to print the graph's summary: python tests/unit/test_layers.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = "lmforge"

# Lowest first. A package may import itself and any package of a strictly lower layer; packages on
# the same layer (models and data) do not import each other. design.md draws the same picture.
LAYERS: list[tuple[str, ...]] = [
    ("_version", "errors"),
    ("utils",),
    ("config",),
    ("metrics",),
    ("models", "data"),
    ("engine",),
    ("optim",),
    ("parallel",),
    ("checkpoint",),
    ("finetune",),
    ("assembly", "export"),
    ("eval",),
    ("train",),
    ("tools", "compress"),
    ("serve", "jobserver", "api"),  # api: jobserver's old name, an import alias for one release
    ("cli",),
    ("__main__", "__init__"),
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}

# Old import paths of renamed modules, each a file whose one statement is lmforge.utils.renamed(__name__,
# NEW): the new module by a string, which the graph cannot see. They go after one release; until then
# nothing in src/ may import them (test_nothing_imports_a_renamed_path).
RENAMED = {
    "lmforge.api": "lmforge.jobserver",
    "lmforge.eval.entry": "lmforge.eval.open_run",
    "lmforge.finetune.export": "lmforge.export.hf",
    "lmforge.finetune.gguf": "lmforge.export.gguf",
    "lmforge.finetune.gguf_arch": "lmforge.export.gguf_arch",
    "lmforge.finetune.gguf_vocab": "lmforge.export.gguf_vocab",
    "lmforge.finetune.kquants": "lmforge.export.kquants",
    "lmforge.finetune.ollama": "lmforge.export.ollama",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or [PKG]
    return ".".join(parts)


def top(module: str) -> str:
    """The layer unit of a module: lmforge.engine.step -> engine; lmforge (the package) -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_only_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports_of(path: Path, module: str, runtime_only: bool = False) -> list[tuple[str, int]]:
    """(imported lmforge module, line) for every import statement anywhere in the file (with
    runtime_only, not those under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip = _type_only_lines(tree) if runtime_only else set()
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == PKG]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PKG:
                continue
            # `from lmforge.x import y` imports the module lmforge.x.y when that is a module.
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append((sub if _is_module(sub) else target, node.lineno))
    return found


def _is_module(name: str) -> bool:
    p = SRC.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def graph(runtime_only: bool = False) -> dict[str, list[tuple[str, int]]]:
    out = {}
    for path in sorted(SRC.joinpath(PKG).rglob("*.py")):
        mod = module_name(path)
        out[mod] = sorted({(t, line) for t, line in imports_of(path, mod, runtime_only) if t != mod})
    return out


def upward_imports(g) -> list[str]:
    bad = []
    for mod, deps in g.items():
        src_layer = LAYER_OF.get(top(mod))
        for dep, line in deps:
            a, b = top(mod), top(dep)
            if a == b:
                continue
            dst_layer = LAYER_OF.get(b)
            if src_layer is None or dst_layer is None:
                bad.append(f"{mod}:{line} -> {dep}: package {a if src_layer is None else b} is in no layer")
            elif dst_layer >= src_layer:
                bad.append(f"{mod}:{line} -> {dep} ({a}, layer {src_layer} -> {b}, layer {dst_layer})")
    return bad


def cycles(g) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _ in g.get(v, []):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    # deep enough for the graph, and put back: a later test (a YAML nesting bound) reads the limit
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in g:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_every_package_is_in_a_layer():
    packages = {top(m) for m in graph()}
    assert packages <= set(LAYER_OF), sorted(packages - set(LAYER_OF))


def test_no_import_points_up_the_layers():
    bad = upward_imports(graph())
    assert not bad, "imports pointing up the layers:\n  " + "\n  ".join(bad)


def test_no_import_cycles():
    found = cycles(graph(runtime_only=True))
    assert not found, "modules importing each other in a circle:\n  " + "\n  ".join(
        " <-> ".join(c) for c in found
    )


def test_nothing_imports_a_renamed_path():
    """src/ uses the new names, and each old path is only an alias: one renamed() call naming its new
    module, and no other import."""
    g = graph()
    users = [f"{mod}:{line} -> {dep}" for mod, deps in g.items() for dep, line in deps
             if mod not in RENAMED and any(dep == old or dep.startswith(old + ".") for old in RENAMED)]
    assert not users, "imports of renamed (deprecated) paths:\n  " + "\n  ".join(users)
    for old, new in RENAMED.items():
        path = SRC.joinpath(*old.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        calls = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
        assert len(calls) == 1 and calls[0].startswith(f"renamed(__name__, '{new}'"), (old, calls)
        assert [d for d, _ in g[old]] == ["lmforge.utils.renamed"], (old, g[old])


def test_the_checks_can_fail():
    """A planted upward import and a planted cycle are both caught."""
    g = {"lmforge.models.x": [("lmforge.train.trainer", 1)], "lmforge.train.trainer": [],
         "lmforge.engine.a": [("lmforge.engine.b", 1)], "lmforge.engine.b": [("lmforge.engine.a", 2)]}
    assert upward_imports(g) == ["lmforge.models.x:1 -> lmforge.train.trainer (models, layer 4 -> train, "
                                 "layer 12)"]
    assert cycles(g) == [["lmforge.engine.a", "lmforge.engine.b"]]


if __name__ == "__main__":
    g = graph()
    up, cyc = upward_imports(g), cycles(graph(runtime_only=True))
    edges = sum(len(v) for v in g.values())
    print(
        f"{len(g)} modules, {edges} imports of lmforge modules; {len(up)} upward imports, {len(cyc)} cycles"
    )
    for line in up:
        print("  up:", line)
    for c in cyc:
        print("  cycle:", " <-> ".join(c))
