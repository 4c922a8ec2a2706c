"""The documentation site: it builds with strict warnings, its generated config reference is current,
every CLI verb and config section has a page or reference entry, its runnable blocks run, and the
README stays a front page.

The build needs the `docs` extra (mkdocs, mkdocs-material; scripts/test.sh installs it with the test
extra); without it the build test is skipped and says what to install.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"
sys.path.insert(0, str(DOCS / "_tools"))

import gen_config_reference  # noqa: E402  (docs/_tools is not a package)

# A fenced block right after this comment is executed by test_runnable_blocks (python: exec'd; bash:
# run with `lmforge` meaning `python -m lmforge` of this checkout), in a temporary directory that has
# the repo's configs/.
RUNNABLE = re.compile(r"<!-- runnable -->\s*```(python|bash)\n(.*?)```", re.S)


def _pages() -> dict[str, str]:
    return {p.relative_to(DOCS).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(DOCS.rglob("*.md")) if "_tools" not in p.parts}


def test_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, a missing anchor, a page left out of the nav or a nav
    entry without a page fails (mkdocs.yml's validation turns each into a warning, strict into an error)."""
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError as e:
        pytest.skip(f"mkdocs cannot be imported ({e}): pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
           "-d", str(tmp_path / "site")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_config_reference_is_current():
    """docs/reference/config.md is what the generator writes from today's schema (regenerate it with
    `python docs/_tools/gen_config_reference.py` after changing a config key)."""
    committed = (DOCS / "reference" / "config.md").read_text(encoding="utf-8")
    assert committed == gen_config_reference.render(), (
        "docs/reference/config.md is stale: run python docs/_tools/gen_config_reference.py")


def test_config_reference_names_every_key():
    """Every key of every section, nested ones included, has a row in the reference."""
    from lmforge.config import Config

    page = (DOCS / "reference" / "config.md").read_text(encoding="utf-8")
    missing = []

    def walk(path: str, model) -> None:
        for key, field in model.model_fields.items():
            if f"| `{key}` |" not in page:
                missing.append(f"{path}.{key}")
            for sub in gen_config_reference._models_in(field.annotation):
                walk(f"{path}.{key}", sub)

    for key, field in Config.model_fields.items():
        assert f"## `{key}`" in page, f"config section {key!r} has no heading in docs/reference/config.md"
        for sub in gen_config_reference._models_in(field.annotation):
            walk(key, sub)
    assert not missing, missing


def _verbs() -> list[str]:
    from lmforge import cli

    parser = cli.build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert actions, "lmforge.cli.build_parser() has no subcommands"
    return sorted(actions[0].choices)


def test_every_verb_has_a_docs_entry():
    """Each verb of `lmforge --help` has a row in docs/reference/cli.md's verb table, linking to the
    page that explains it, and the verb table names no verb the CLI lacks."""
    page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `lmforge ([a-z-]+)` \| \[[^]]+\]\(([^)#]+)", page, re.M))
    verbs = _verbs()
    assert sorted(set(verbs) - set(rows)) == [], "verbs without a row in docs/reference/cli.md"
    assert sorted(set(rows) - set(verbs)) == [], "rows for verbs the CLI does not have"
    for verb, target in rows.items():
        assert (DOCS / "reference" / target).resolve().is_file(), f"{verb}: {target} is not a page"
        assert f"lmforge {verb}" in (DOCS / "reference" / target).resolve().read_text(encoding="utf-8"), (
            f"the page for `lmforge {verb}` ({target}) never mentions it")
    from lmforge.cli.verbs import RENAMED

    for old, new in RENAMED.items():  # a renamed verb's old name is no row, but the page says what it became
        assert old not in rows and new in rows, (old, new)
        assert re.search(rf"`lmforge {old}` is now `lmforge {new}`", " ".join(page.split())), (
            f"docs/reference/cli.md does not say that `lmforge {old}` is now `lmforge {new}`")


def test_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (REPO / link).is_file(), f"README links to {link}, which does not exist"
    # No table row a reader has to scroll sideways for a kilobyte to read.
    for page, body in {"README.md": text, **_pages()}.items():
        if page == "reference/config.md":
            continue  # one row per key, generated
        longest = max(body.splitlines(), key=len)
        assert len(longest) <= 600, f"{page}: a {len(longest)}-character line: {longest[:80]}..."


def _runnable() -> list[tuple[str, str, str]]:
    found = []
    for page, body in {"README.md": README.read_text(encoding="utf-8"), **_pages()}.items():
        found += [(page, lang, code) for lang, code in RUNNABLE.findall(body)]
    return found


def test_there_are_runnable_blocks():
    assert len(_runnable()) >= 2, "the docs lost their runnable examples"


@pytest.mark.parametrize("page,lang,code", _runnable(),
                         ids=[f"{page}-{i}" for i, (page, _, _) in enumerate(_runnable())])
def test_runnable_blocks(page, lang, code, tmp_path, monkeypatch):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    if lang == "python":
        monkeypatch.chdir(tmp_path)
        exec(compile(code, page, "exec"), {"__name__": "__docs__"})
        return
    shim = tmp_path / "bin" / "lmforge"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m lmforge "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{page}:\n{code}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
