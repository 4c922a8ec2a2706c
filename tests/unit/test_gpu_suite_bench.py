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


def _row_in_process(name: str, out: Path) -> dict:
    """The row's tiny command run in this process (no second torch import): the bench's JSON."""
    import importlib

    row = next(r for r in gpu_suite.ROWS if r.name == name)
    args = [a.replace("{json}", str(out)) for a in row.tiny]
    assert importlib.import_module(args[0].removesuffix(".py")).main(args[1:]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow  # 10-30 s: a benchmark's own tiny run (the skip/report logic stays in the default tier)
def test_the_quant_row_times_bf16_int8_int4_and_transformers_on_the_same_weights(tmp_path):
    result = _row_in_process("quant", tmp_path / "quant.json")
    assert result["machine"]["max_logit_diff"] <= 1e-4  # the two implementations are the same model
    for batch in ("1", "2"):
        sides = result["results"][batch]
        assert set(sides) == {"bf16", "int8", "int4", "transformers"}
        assert all(s["tok_s"] > 0 for s in sides.values())
        assert sides["transformers"]["agree_bf16"] == int(batch)  # fp32 on the tiny preset: same tokens
    nbytes = result["weight_bytes"]
    assert nbytes["int4"] < nbytes["int8"] < nbytes["bf16"]  # (lmforge's also holds its rope tables)


@pytest.mark.slow  # flex attention compiled on a CPU: ~20-40 s
def test_the_prefix_row_runs_flex_equal_to_the_dense_mask_through_the_model(tmp_path):
    result = _row_in_process("prefix", tmp_path / "prefix.json")
    assert result["dtype"] == "fp32" and set(result["ms_per_step"]) == {"mask", "flex"}
    # a CPU runs flex forward only (torch has no flex backward there): the GPU row compares the gradients
    assert result["loss_diff"] <= 1e-5 and result["grad_max_diff"] is None, result
    assert all(ms > 0 for ms in result["ms_per_step"].values())


@pytest.mark.slow  # a server process and its imports: ~30-50 s on a loaded 2-core machine
def test_the_serve_load_row_serves_over_http_and_batches_transformers_at_each_concurrency(tmp_path):
    rc, report = _suite(tmp_path, "--only", "serve_load")
    row = report["rows"]["serve_load"]
    assert rc == 0 and row["status"] == "ok", row
    result = row["result"]
    for level in ("1", "4"):
        sides = result["results"][level]
        for side in ("lmforge", "transformers"):
            assert sides[side]["tok_s"] > 0 and sides[side]["p95"] >= sides[side]["p50"] > 0
            # every reply is max_tokens long: the end-of-text row is zeroed, so no reply stops early
            assert sides[side]["rounds"][0]["tokens"] == sides[side]["requests"] * 8
        assert result["agree"][level] == sides["lmforge"]["requests"]  # fp32 greedy: the same text


def test_a_row_is_skipped_with_the_reason_its_check_gives(tmp_path, monkeypatch):
    gated = gpu_suite.Row("gated", "a row whose feature is missing", 1, ["gpu_suite.py"], ["gpu_suite.py"],
                          check=lambda: "lmforge train has no --budget")
    monkeypatch.setattr(gpu_suite, "ROWS", [gated])
    assert gpu_suite.main(["--tiny", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "suite.json").read_text())["rows"]["gated"]
    assert row["status"] == "skipped" and row["why"] == "lmforge train has no --budget"


def _fake_budget_run(seconds: float, bpb: float | None):
    """subprocess.run standing in for `lmforge train --budget`: writes what a planned run leaves."""
    def run(cmd, cwd=None, **_):
        assert cmd[3:6] == ["train", "--budget", "20s"] and 'data.sources=["builtin:python"]' in cmd
        run_dir = Path(next(a for a in cmd if a.startswith("run.dir=")).split("=", 1)[1])
        run_dir.mkdir(parents=True)
        choices = [{"key": "model.d_model", "value": 64, "why": "rule"},
                   {"key": "model.n_layers", "value": 2, "why": "rule"},
                   {"key": "optim.lr", "value": 0.004, "why": "rule"}]
        (run_dir / "plan.json").write_text(json.dumps({"budget_s": 20.0, "choices": choices}))
        lines = [{"step": 5, "loss": 5.0}] + ([{"step": 9, "val_loss": 3.1, "val_bpb": bpb}] if bpb else [])
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        clock[0] += seconds
        return subprocess.CompletedProcess(cmd, 0, stderr="")

    clock = [0.0]
    return run, clock


@pytest.mark.parametrize("seconds,bpb,rc", [(19.0, 2.5, 0), (22.0, 2.5, 1), (19.0, None, 1)])
def test_the_planner_row_reports_bpb_shape_and_wall_time_against_the_budget(tmp_path, monkeypatch, seconds,
                                                                           bpb, rc):
    run, clock = _fake_budget_run(seconds, bpb)
    monkeypatch.setattr(gpu_suite.subprocess, "run", run)
    monkeypatch.setattr(gpu_suite.time, "monotonic", lambda: clock[0])
    out = tmp_path / "planner.json"
    assert gpu_suite.planner_row(out, "20s") == rc  # over budget + 5% (22 s of 20) or no evaluation: failed
    got = json.loads(out.read_text())
    assert got["val_bpb"] == bpb and got["wall_s"] == seconds and got["budget_s"] == 20.0
    assert got["within_budget"] == (seconds <= 21.0)
    assert got["chosen"] == {"model.d_model": 64, "model.n_layers": 2, "optim.lr": 0.004}


def test_the_planner_row_keeps_the_planners_refusal(tmp_path, monkeypatch):
    def refuse(cmd, cwd=None, **_):
        err = ("planning: ...\nlmforge train: error: --budget 20s is too small for any model on this "
               "machine; the smallest budget that would work is 39s\n")
        return subprocess.CompletedProcess(cmd, 2, stderr=err)

    monkeypatch.setattr(gpu_suite.subprocess, "run", refuse)
    assert gpu_suite.planner_row(tmp_path / "p.json", "20s") == 1
    got = json.loads((tmp_path / "p.json").read_text())
    assert got["rc"] == 2 and got["val_bpb"] is None and got["error"].endswith("would work is 39s")


@pytest.mark.slow  # a real `lmforge train --budget 90s` once the flag exists
def test_the_planner_row_runs_a_tiny_budget_or_says_the_flag_is_missing(tmp_path):
    rc, report = _suite(tmp_path, "--only", "planner")
    row = report["rows"]["planner"]
    if row["status"] == "skipped":
        assert row["why"] == "lmforge train has no --budget"
        return
    if "too small for any model on this machine" in ((row["result"] or {}).get("error") or ""):
        pytest.skip(f"this machine is too busy for the tiny budget: {row['result']['error']}")
    assert rc == 0 and row["status"] == "ok", row
    assert row["result"]["val_bpb"] > 0 and row["result"]["chosen"]
    assert row["result"]["within_budget"], row["result"]
