"""Modules renamed after what they hold (issue 33) keep their old import paths for one release: the old path
gives the new module's very objects, and says once that it is deprecated."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

API_ALIAS = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("always")
    import lmforge.api
    # the alias imports nothing of the job server until a submodule is asked for
    assert "lmforge.jobserver.app" not in sys.modules and "fastapi" not in sys.modules
    import lmforge.api.app
    import lmforge.jobserver.app
    assert lmforge.api.app is lmforge.jobserver.app
    assert lmforge.jobserver.app.__spec__.name == "lmforge.jobserver.app"
    from lmforge.api.store import Store
    from lmforge.jobserver.store import Store as NewStore
    assert Store is NewStore
    from lmforge.api import procs, runner
    assert procs.__name__ == "lmforge.jobserver.procs" and runner.__name__ == "lmforge.jobserver.runner"
    from lmforge.api.server import server_process
    from lmforge.api.routes.jobs import jobs_router
    import lmforge.api.routes.auth
    assert lmforge.api.routes.auth is sys.modules["lmforge.jobserver.routes.auth"]
    static = lmforge.api.dashboard.STATIC
    assert static.name == "static" and (static / "index.html").is_file()
    try:
        import lmforge.api.no_such_module
    except ModuleNotFoundError as e:
        assert e.name == "lmforge.api.no_such_module", e.name
    else:
        raise AssertionError("a module that exists under neither name was imported")
    try:
        from lmforge.api import no_such_name
    except ImportError:
        pass
    else:
        raise AssertionError("a name that is no module was imported")
    print("ok")
""")


def test_lmforge_api_is_an_alias_of_jobserver():
    pytest.importorskip("fastapi")
    r = subprocess.run([sys.executable, "-c", API_ALIAS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    warned = [line for line in r.stderr.splitlines() if "DeprecationWarning" in line]
    assert len(warned) == 1 and "lmforge.api is renamed lmforge.jobserver" in warned[0], r.stderr


def test_eval_entry_is_open_run(monkeypatch):
    import importlib

    import lmforge.eval.open_run as open_run

    monkeypatch.delitem(sys.modules, "lmforge.eval.entry", raising=False)
    with pytest.warns(DeprecationWarning, match="lmforge.eval.entry is renamed lmforge.eval.open_run"):
        entry = importlib.import_module("lmforge.eval.entry")
    assert entry is open_run
    from lmforge.eval.entry import chat_template_of, evaluate, generate_text, load_run

    assert (evaluate, generate_text, load_run, chat_template_of) == (
        open_run.evaluate, open_run.generate_text, open_run.load_run, open_run.chat_template_of)
