"""bench/gpu_suite.py, the one command for every GPU measurement, runs on a CPU at tiny shapes: a row runs
its bench in its own process and keeps the bench's JSON, a row that needs CUDA is skipped and says so, the
budget skips what does not fit, --update keeps the rows a rerun does not run, and the shell wrapper sets
up the environment and runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_suite  # noqa: E402  (bench/ is not a package)


def _suite(out: Path, *args: str) -> tuple[int, dict]:
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_suite.sh"), "--tiny", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, json.loads((out / "suite.json").read_text())


# slow tier: the llama row's bench runs end to end in the default tier already
# (test_gpu_throughput_bench.py::test_tiny_rows_run_and_both_sides_compute_the_same_function), and the
# suite's own logic (gpu_suite.sh, rows, budget, failures) in the two tests below
@pytest.mark.slow
def test_a_row_runs_its_bench_and_cuda_rows_are_skipped_with_the_reason(tmp_path):
    rc, report = _suite(tmp_path, "--only", "llama,packed")
    assert rc == 0
    llama, packed = report["rows"]["llama"], report["rows"]["packed"]
    assert llama["status"] == "ok", llama
    assert llama["result"]["rows"]["llama"]["ratio"] > 0  # the bench's own JSON, kept whole
    assert "gpu_throughput.py" in llama["command"]
    assert packed == {**packed, "status": "skipped", "why": "needs CUDA"}
    md = (tmp_path / "suite.md").read_text()
    assert "| llama |" in md and "| packed |" in md and "## llama" in md

    # A rerun of one row keeps the others (and says when each ran).
    rc, again = _suite(tmp_path, "--only", "packed", "--update")
    assert rc == 0 and list(again["rows"]) == ["llama", "packed"]
    assert again["rows"]["llama"]["result"] == llama["result"]


def test_cuda_rows_are_skipped_with_the_reason_and_update_keeps_the_others(tmp_path):
    """The default tier's check of what the slow test above also checks, without running a bench."""
    assert gpu_suite.main(["--tiny", "--only", "packed", "--out", str(tmp_path)]) == 0
    packed = json.loads((tmp_path / "suite.json").read_text())["rows"]["packed"]
    assert packed == {**packed, "status": "skipped", "why": "needs CUDA"}
    assert "| packed |" in (tmp_path / "suite.md").read_text()
    assert gpu_suite.main(["--tiny", "--only", "qlora", "--update", "--out", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "suite.json").read_text())["rows"]
    assert list(again) == ["packed", "qlora"] and again["packed"] == packed


def test_the_budget_skips_rows_that_do_not_fit(tmp_path):
    rc, report = _suite(tmp_path, "--only", "gpt2,resume", "--budget", "5")
    assert rc == 0
    for row in report["rows"].values():
        assert row["status"] == "skipped" and row["why"].startswith("budget:"), row


def test_a_failing_row_fails_the_suite_and_keeps_its_log(tmp_path, monkeypatch):
    broken = gpu_suite.Row("broken", "a bench that exits 1", 1, ["gpu_suite.py", "--no-such-flag"],
                           ["gpu_suite.py", "--no-such-flag"])
    monkeypatch.setattr(gpu_suite, "ROWS", [broken])
    assert gpu_suite.main(["--tiny", "--out", str(tmp_path)]) == 1
    row = json.loads((tmp_path / "suite.json").read_text())["rows"]["broken"]
    assert row["status"] == "failed" and row["rc"] == 2 and "--no-such-flag" in row["summary"]


def test_merge_keeps_old_rows_and_replaces_rerun_ones():
    old = {"rows": {"a": {"status": "ok", "seconds": 3}, "b": {"status": "failed", "seconds": 1}}}
    new = {"rows": {"b": {"status": "ok", "seconds": 2}}, "device": "x"}
    merged = gpu_suite.merge(old, new)
    assert merged["rows"] == {"a": {"status": "ok", "seconds": 3}, "b": {"status": "ok", "seconds": 2}}
    assert merged["seconds"] == 5 and merged["device"] == "x"
