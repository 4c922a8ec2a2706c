"""`lmforge eval RUN --tasks evil.yaml` end to end, where the task file's pass@k `test` field is the attack
(that field IS code): nothing escapes; without a working sandbox the eval is refused before a model is
loaded, naming the missing piece, unless the user says --unsafe-code-exec (and the output says so)."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.eval import sandbox
from lmforge.eval.sandbox import check_isolation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from caselib import build_workspace  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

ESCAPE = """
import os, subprocess, sys, glob, sysconfig, importlib.machinery, importlib.util
marker = {marker!r}
try:
    open(marker + ".direct", "w").write("x")
except BaseException:
    pass
try:
    path = glob.glob(os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload", "_posixsubprocess*"))[0]
    name = "evil._posixsubprocess"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    subprocess._fork_exec = importlib.util.module_from_spec(spec).fork_exec
    late = "import time; time.sleep(1.5); open(%r, 'w').write('x')" % (marker + ".late")
    subprocess.Popen([sys.executable, "-c", late, {token!r}], start_new_session=True)
except BaseException:
    pass
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return build_workspace(tmp_path_factory.mktemp("sandbox_cli")) / "run"


def evil_task(tmp_path: Path) -> tuple[Path, Path, str]:
    marker, token = tmp_path / "PWNED", uuid.uuid4().hex
    rows = [{"prompt": "def f():\n    return 1\n# ", "test": ESCAPE.format(marker=str(marker), token=token)}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tmp_path / "evil.yaml"
    task.write_text(
        "dataset_path: docs.jsonl\ntask: evil\noutput_type: generate_until\ndoc_to_text: prompt\n"
        'doc_to_target: test\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\n'
        "repeats: 2\nmetric_list:\n  - metric: pass_at_k\n    k: [1]\n    test: test\n    timeout_s: 5\n"
    )
    return task, marker, token


def _unavailable(monkeypatch):
    monkeypatch.setattr(sandbox.isolation, "bwrap_path", lambda: None)
    check_isolation.cache_clear()


def test_an_evil_task_file_cannot_escape_through_lmforge_eval(run_dir, tmp_path, capsys, code_sandbox):
    task, marker, _ = evil_task(tmp_path)
    assert main(["eval", str(run_dir), "--tasks", str(task), "--no-contamination"]) == 0
    time.sleep(2.5)  # past the late writer's delay
    assert not list(tmp_path.glob("PWNED*"))
    out = capsys.readouterr().out
    assert "model-written code runs under bubblewrap" in out
    res = json.loads(next(run_dir.glob("eval_harness_step_*.json")).read_text())
    assert res["code_execution"].startswith("bubblewrap")
    assert res["tasks"]["evil"]["metrics"]["pass@1"] == 0.0
    samples = next(run_dir.glob("eval_harness_step_*.samples.jsonl")).read_text()
    assert "forbidden" in samples  # the audit hook stopped it first and said so


def test_without_the_sandbox_pass_at_k_is_refused_before_any_model_loads(
    run_dir, tmp_path, capsys, monkeypatch
):
    task, _, _ = evil_task(tmp_path)
    _unavailable(monkeypatch)
    loaded = []
    monkeypatch.setattr("lmforge.eval.open_run.load_run", lambda *a, **k: loaded.append(a))
    assert main(["eval", str(run_dir), "--tasks", str(task), "--no-contamination"]) == 2
    err = capsys.readouterr().err
    assert "lmforge eval: error: evil: pass@k runs model-written code" in err
    assert "bubblewrap (`bwrap`) is not installed" in err and "apt-get install bubblewrap" in err
    assert "--unsafe-code-exec" in err and "Traceback" not in err and not loaded


def test_unsafe_code_exec_runs_with_the_hook_only_and_says_so(run_dir, tmp_path, capsys, monkeypatch):
    task, marker, _ = evil_task(tmp_path)
    _unavailable(monkeypatch)
    argv = ["eval", str(run_dir), "--tasks", str(task), "--no-contamination", "--unsafe-code-exec"]
    assert main(argv) == 0
    assert "warning: model-written code runs under UNSAFE" in capsys.readouterr().out
    res = json.loads(next(run_dir.glob("eval_harness_step_*.json")).read_text())
    assert res["code_execution"].startswith("UNSAFE")
    assert not marker.with_suffix(".direct").exists()  # the hook still refused the plain write


def test_unsafe_code_exec_is_refused_where_no_code_runs(run_dir, capsys):
    assert main(["eval", str(run_dir), "--unsafe-code-exec"]) == 2
    assert "--unsafe-code-exec applies to --tasks" in capsys.readouterr().err


def test_training_refuses_pass_at_k_eval_tasks_without_the_sandbox(run_dir, tmp_path, capsys, monkeypatch):
    task, _, _ = evil_task(tmp_path)
    _unavailable(monkeypatch)
    cfg = run_dir / "config.yaml"
    sets = ["--set", f"run.dir={tmp_path / 'new'}", "--set", f"train.eval_tasks=[{task}]"]
    assert main(["train", "-c", str(cfg), *sets]) == 2
    err = capsys.readouterr().err
    assert "Training runs such code only in the sandbox" in err and not (tmp_path / "new").exists()

