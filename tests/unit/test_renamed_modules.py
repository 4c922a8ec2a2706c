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
    import lmforge.api.dashboard
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


EXPORT_ALIASES = textwrap.dedent("""
    import warnings
    warnings.simplefilter("always")
    import lmforge.finetune.export as old_hf
    from lmforge.finetune import kquants
    from lmforge.finetune.gguf import _choose, export_gguf
    from lmforge.finetune.gguf_arch import families
    import lmforge.finetune.gguf_arch.llama
    from lmforge.finetune.gguf_vocab import read_vocab
    from lmforge.finetune.ollama import modelfile_text
    import lmforge.export.gguf as gguf, lmforge.export.gguf_arch as arch, lmforge.export.hf as hf
    import lmforge.export.gguf_vocab as vocab, lmforge.export.kquants as kq, lmforge.export.ollama as ollama
    assert old_hf is hf and kquants is kq and (_choose, export_gguf) == (gguf._choose, gguf.export_gguf)
    assert families is arch.families and read_vocab is vocab.read_vocab
    assert modelfile_text is ollama.modelfile_text
    assert lmforge.finetune.gguf_arch.llama is arch.llama is families()["llama"]
    assert arch.__spec__.name == "lmforge.export.gguf_arch"
    assert arch.llama.__name__ == "lmforge.export.gguf_arch.llama"
    print("ok")
""")


def test_the_exporters_old_paths_are_the_export_package():
    """finetune/export.py and the GGUF writers moved to lmforge.export (a run of any kind is exported, not
    only a fine-tuned one); each old path is the new module, gguf_arch's submodules included."""
    r = subprocess.run([sys.executable, "-c", EXPORT_ALIASES], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    warned = sorted(line.split("DeprecationWarning: ")[1].split(" is renamed")[0]
                    for line in r.stderr.splitlines() if "DeprecationWarning" in line)
    old = ("export", "gguf", "gguf_arch", "gguf_vocab", "kquants", "ollama")
    assert warned == [f"lmforge.finetune.{m}" for m in old], r.stderr


def test_the_warning_names_the_line_that_imports_the_old_path():
    """Python shows a DeprecationWarning by default only where __main__ triggers it: the warning points past
    the alias and the import system at the importing line, so a script's author sees it with no flags."""
    r = subprocess.run([sys.executable, "-c", "import lmforge.finetune.ollama"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("<string>:1: DeprecationWarning: lmforge.finetune.ollama is renamed "
                               "lmforge.export.ollama"), r.stderr
