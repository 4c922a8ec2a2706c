"""scripts/demo.sh tells the user where its evaluations went: each report's path as it is written, and
every one of them in its closing lines. The script runs here against a stand-in `lmforge` (a shell
script writing the files the real verbs write), so the test takes a second, not the demo's minutes."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

STUB = """#!/usr/bin/env bash
run="$STUB_RUN"
case "$1" in
  config) printf 'run:\\n  dir: %s\\n' "$run" ;;
  train) rm -rf "$run"; mkdir -p "$run"; echo "trained" ;;
  eval)
    if [ "${2:-}" = "tasks" ]; then
      stem="$run/eval_harness_step_00000004"
      touch "$stem.json" "$stem.samples.jsonl" "$run/eval_report_step_00000004.md"
      echo "report:  $run/eval_report_step_00000004.md"
    else
      touch "$run/eval_val_step_00000004.json"
      echo "results: $run/eval_val_step_00000004.json"
    fi ;;
  generate) echo "def f" ;;
esac
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_demo_prints_and_lists_its_eval_reports(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    # scripts/_env.sh reuses a venv whose install stamp matches pyproject.toml: nothing is installed.
    stamp = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
    (venv / ".lmforge-install-stamp-eval").write_text(stamp + "\n")
    for name, body in (("python", f'#!/usr/bin/env bash\nexec "{sys.executable}" "$@"\n'), ("lmforge", STUB)):
        (venv / "bin" / name).write_text(body)
        (venv / "bin" / name).chmod(0o755)
    run = tmp_path / "runs" / "demo"
    env = {**os.environ, "LMFORGE_VENV": str(venv), "STUB_RUN": str(run)}
    done = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # the loss evaluation's file is printed after it is written, before the task evaluation runs
    assert lines.index(f"results: {run}/eval_val_step_00000004.json") < lines.index(
        f"report:  {run}/eval_report_step_00000004.md"
    )
    reports = [f"{run}/eval_harness_step_00000004.json", f"{run}/eval_val_step_00000004.json",
               f"{run}/eval_report_step_00000004.md"]
    assert lines[-4:] == ["[lmforge] eval reports (3):"] + [f"  {r}" for r in reports]
