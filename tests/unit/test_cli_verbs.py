"""The CLI is a table of verbs (lmforge.cli.verbs): each verb's help, arguments and handler live side by side
in one module, `lmforge --help` lists exactly the table, and the modules stay small enough to read."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.cli.verbs import VERBS, table

VERBS_DIR = Path(__file__).resolve().parents[2] / "src" / "lmforge" / "cli" / "verbs"
CLI_DIR = VERBS_DIR.parent


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return out.getvalue()


def _listed(text: str) -> list[str]:
    """The verbs a help text lists: its lines '    name  help' (wrapped help lines are indented deeper)."""
    return [m.group(1) for m in re.finditer(r"^    ([a-z][a-z-]*)(?: |$)", text, re.M)]


def test_lmforge_help_lists_the_verb_table_in_order():
    rows = table()
    assert [r.name for r in rows] == [v.name for v in VERBS]
    listed = _listed(_help(["--help"]).split("positional arguments:")[1])
    assert listed == [r.name for r in rows]
    for r in rows:  # the one-line help of the table is what --help shows, and each parser is the verb's
        assert r.help and r.parser.prog == f"lmforge {r.name}"
        assert " ".join(r.help.split()[:4]) in " ".join(_help(["--help"]).split())


def test_eval_lists_its_modes_and_each_mode_has_its_own_parser():
    (ev,) = [r for r in table() if r.name == "eval"]
    assert [m.name for m in ev.modes] == [f"eval {m}" for m in
                                          ("loss", "data", "tasks", "compare", "exact", "redteam")]
    text = _help(["eval", "--help"])
    for m in ev.modes:
        assert f"  {m.name.split()[1]:<8} {m.help}" in text
        assert m.parser.prog == f"lmforge {m.name}"
        assert _help(m.name.split() + ["--help"]).startswith(f"usage: lmforge {m.name} ")
    # a mode takes only its own flags: the data mode's --stride is no flag of the tasks mode
    assert "--stride" in _help(["eval", "data", "--help"])
    assert "--stride" not in _help(["eval", "tasks", "--help"])


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]


def test_verb_modules_stay_small():
    modules = sorted(VERBS_DIR.glob("*.py"))
    assert len(modules) >= 8
    for path in [*modules, *CLI_DIR.glob("*.py")]:
        lines = path.read_text().count("\n")
        assert lines <= (300 if path.parent == VERBS_DIR else 600), f"{path.name}: {lines} lines"
        for fn in _functions(ast.parse(path.read_text())):
            n = fn.end_lineno - fn.lineno + 1
            assert n <= 100, f"{path.name}:{fn.lineno} {getattr(fn, 'name', 'lambda')}: {n} lines"


def test_lmforge_help_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom lmforge.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['--help'])\n"
            "print(','.join(m for m in ('torch', 'numpy', 'pydantic', 'rich', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""  # heavy imports wait inside the handlers
