"""`lmforge eval RUN --tasks ...` end to end: the shipped code tasks put a trained model above chance
and an untrained one at chance; results JSON, samples, markdown report and reliability diagrams are
written; broken task files and documents are clear errors (exit 2) and a generation that never stops
is bounded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.errors import LmforgeError
from lmforge.eval.bundle import build_bundle
from lmforge.eval.open_run import load_run
from lmforge.eval.scorer import Scorer
from lmforge.eval.tasks import load_task, run_task
from lmforge.models import build_model
from lmforge.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "debug" / "tiny.yaml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The tiny recipe on this Python's stdlib with room for eight lines of code: 120 steps."""
    root = tmp_path_factory.mktemp("evaltasks")
    cfg = load_config(
        TINY,
        [
            f"run.dir={root / 'run'}",
            f"data.dir={root / 'data'}",
            "logging.progress=none",
            "train.max_steps=120",
            "train.eval_every=120",
            "checkpoint.every=60",
            "model.max_seq_len=256",
            "data.tokenizer.vocab_size=1024",
            "train.threads=2",
        ],
    )
    Trainer(cfg).fit()
    return root / "run"


def test_trained_model_above_chance_untrained_at_chance(trained, tmp_path):
    build_bundle(tmp_path / "tasks")
    task = load_task(tmp_path / "tasks" / "code_word_order.yaml")
    run = load_run(trained)
    torch.manual_seed(0)
    untrained = build_model(run.model.cfg, torch.device("cpu"))  # the same shape, initial weights
    ours = run_task(task, Scorer(run.model, run.tokenizer))
    base = run_task(task, Scorer(untrained, run.tokenizer))
    assert ours.n_docs == base.n_docs == 200
    assert ours.chance["acc"] == 0.25
    # Trained: far above chance (measured 0.665, the bound ~0.42; 0.74 after 200 steps); untrained: within
    # three standard errors of it (measured 0.270).
    print(f"acc trained {ours.metrics['acc']:.3f}, untrained {base.metrics['acc']:.3f}")
    assert ours.metrics["acc"] > 0.25 + 5 * ours.stderr["acc"]
    assert abs(base.metrics["acc"] - 0.25) < 3 * base.stderr["acc"]


def test_cli_writes_results_samples_and_report(trained, capsys, code_sandbox):
    assert main(["eval", str(trained), "--tasks", "builtin:code", "--limit", "12"]) == 0
    out = capsys.readouterr().out
    assert "code_word_order" in out and "bits_per_byte" in out
    res = json.loads((trained / "eval_harness_step_00000120.json").read_text())
    assert set(res["tasks"]) == {
        "code_next_line",
        "code_word_order",
        "code_line_completion",
        "code_bpb",
        "code_functions",
    }
    assert set(res["tasks"]["code_functions"]["metrics"]) == {"pass@1", "pass@5"}
    assert res["tasks"]["code_word_order"]["n_docs"] == 12
    assert 0.0 <= res["tasks"]["code_word_order"]["calibration"]["ece"] <= 1.0
    samples = (trained / "eval_harness_step_00000120.samples.jsonl").read_text().splitlines()
    assert len(samples) == 12 * 5  # five tasks of 12 documents (code_bpb: chunks)
    report = (trained / "eval_report_step_00000120.md").read_text()
    assert "| code_word_order | multiple_choice | 0 | 12 | acc |" in report
    png = trained / "eval_report_step_00000120" / "code_word_order_reliability.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_task(tmp_path: Path, body: str, rows: list[dict] | None = None) -> Path:
    data = tmp_path / "docs.jsonl"
    rows = rows if rows is not None else [{"q": "x = 1", "choices": ["y = 2", "z = 3"], "label": 0}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tmp_path / "task.yaml"
    task.write_text(f"dataset_path: {data.name}\n" + body)
    return task


@pytest.mark.parametrize(
    "body,rows,message",
    [
        (
            "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: choices\n",
            None,
            r"task.yaml: key 'doc_to_target' is missing",
        ),
        (
            "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_target: label\ndoc_to_choice: choices\n",
            [{"q": "a", "choices": [], "label": 0}],
            r"docs.jsonl:1: the choice list is empty",
        ),
        (
            "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_target: label\ndoc_to_choice: choices\n",
            [{"q": "a", "choices": ["b", "c"], "label": 0}, {"q": "a", "choices": ["b"], "label": 3}],
            r"docs.jsonl:2: the target index 3 is outside the 1 choices",
        ),
        (
            "output_type: generate_until\ndoc_to_text: !function utils.doc_to_text\ndoc_to_target: label\n",
            None,
            r"key 'doc_to_text' is `!function utils.doc_to_text` \(Python code\): lmforge runs no code",
        ),
        (
            'output_type: multiple_choice\ndoc_to_text: "{{ missing }}"\ndoc_to_target: label\n'
            "doc_to_choice: choices\n",
            None,
            r"docs.jsonl:1: the template '\{\{ missing \}\}' does not render",
        ),
        (
            "output_type: ranking\ndoc_to_text: q\ndoc_to_target: label\n",
            None,
            r"output_type 'ranking' is not one of",
        ),
        (
            "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_target: label\ndoc_to_choice: choices\n"
            "process_docs: 1\n",
            None,
            r"key 'process_docs' needs Python code",
        ),
    ],
)
def test_bad_task_files_are_clear_errors(trained, tmp_path, capsys, body, rows, message):
    task = write_task(tmp_path, body, rows)
    assert main(["eval", str(trained), "--tasks", str(task)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert pytest.importorskip("re").search(message, err), err


def test_bad_yaml_names_the_line(trained, tmp_path, capsys):
    task = tmp_path / "t.yaml"
    task.write_text("task: t\ndataset_path: x.jsonl\ndoc_to_text: [unclosed\n")
    assert main(["eval", str(trained), "--tasks", str(task)]) == 2
    assert f"{task}:4: not valid YAML" in capsys.readouterr().err


def test_a_generation_that_never_stops_is_bounded(trained, tmp_path):
    task = write_task(
        tmp_path,
        "output_type: generate_until\ndoc_to_text: q\ndoc_to_target: a\n"
        'generation_kwargs:\n  until: ["NEVER-SEEN-STOP"]\n  max_gen_toks: 9\n',
        [{"q": "def f(x):\n    return", "a": " x"}] * 3,
    )
    run = load_run(trained)
    res = run_task(load_task(task), Scorer(run.model, run.tokenizer))
    for s in res.samples:
        assert 1 <= len(run.tokenizer.encode(s["response"])) <= 9 + 1  # decode/encode may merge differently
    assert res.metrics["exact_match"] in (0.0, 1 / 3, 2 / 3, 1.0)


def test_cli_prints_the_path_of_every_file_it_writes(trained, tmp_path, capsys):
    task = write_task(
        tmp_path,
        "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_target: label\ndoc_to_choice: choices\n",
        [{"q": "x = 1", "choices": ["y = 2", "z = 3"], "label": 0}] * 6,
    )
    assert main(["eval", str(trained), "--tasks", str(task), "--limit", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    stem = trained / "eval_harness_step_00000120"
    report = trained / "eval_report_step_00000120.md"
    assert f"results: {stem}.json" in lines
    assert f"samples: {stem}.samples.jsonl" in lines
    assert f"report:  {report} (reliability diagrams in {trained / 'eval_report_step_00000120'}/)" in lines
    assert (trained / "eval_report_step_00000120" / "task_reliability.png").is_file()
    assert "Few-shot seed 1234, first 3 documents per task." in report.read_text()  # not "3.0"


def test_all_checkpoints_give_curves_and_two_runs_a_comparison(trained, tmp_path, capsys):
    task = write_task(
        tmp_path,
        "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_target: label\ndoc_to_choice: choices\n",
        [{"q": "x = 1", "choices": ["y = 2", "z = 3"], "label": 0}] * 6,
    )
    assert main(["eval", str(trained), "--tasks", str(task), "--all-checkpoints"]) == 0
    curves = (trained / "eval_curves.md").read_text()
    assert "| task | metric | step 60 | step 120 |" in curves
    assert (trained / "eval_curves.png").read_bytes()[:4] == b"\x89PNG"
    older = trained / "checkpoints" / "step_00000060"
    out = tmp_path / "cmp.md"
    assert main(["eval", str(trained), str(older), "--tasks", str(task), "--compare-out", str(out)]) == 0
    table = out.read_text()
    assert "B - A" in table
    a = json.loads((trained / "eval_harness_step_00000120.json").read_text())["tasks"]["task"]["metrics"]
    b = json.loads((trained / "eval_harness_step_00000060.json").read_text())["tasks"]["task"]["metrics"]
    row = next(line for line in table.splitlines() if line.startswith("| task | acc |"))
    assert row.split(" | ")[4] == f"{100 * (b['acc'] - a['acc']):.2f}%"
    capsys.readouterr()
    assert main(["eval", str(trained), str(older)]) == 2  # two runs without --tasks: refused
    assert "compared with --tasks only" in capsys.readouterr().err


def test_train_eval_tasks_logs_task_scores(tiny_cfg, tmp_path):
    from lmforge.metrics.loggers import read_metrics

    task = write_task(
        tmp_path,
        "task: pick\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_target: label\n"
        "doc_to_choice: choices\n",
        [{"q": "The", "choices": [" module", " zzqx"], "label": 0}] * 5,
    )
    Trainer(tiny_cfg("train.max_steps=4", "train.eval_every=2", f"train.eval_tasks=[{task}]")).fit()
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert 0.0 <= r["task/pick/acc"] <= 1.0 and "task/pick/brier_score" in r


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_train_eval_tasks_checked_before_the_run_dir_is_touched(tiny_cfg, tmp_path):
    from lmforge.errors import LmforgeError

    Trainer(tiny_cfg("train.max_steps=2")).fit()
    before = snapshot(tmp_path / "run")
    bad = write_task(tmp_path, "output_type: multiple_choice\ndoc_to_text: q\n")  # no target, no choices
    with pytest.raises(LmforgeError, match="key 'doc_to_choice' is missing"):
        Trainer(tiny_cfg("train.max_steps=2", "run.overwrite=true", f"train.eval_tasks=[{bad}]"))
    assert snapshot(tmp_path / "run") == before


def test_eval_data_strided_perplexity_cli(trained, tmp_path, capsys):
    text = tmp_path / "held.jsonl"
    text.write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 30}) + "\n" for i in range(3))
    )
    assert main(["eval", str(trained), "--data", str(text), "--max-length", "128", "--stride", "64"]) == 0
    out = json.loads((trained / "eval_data_held.jsonl_step_00000120.json").read_text())
    assert out["documents"] == 3 and out["max_length"] == 128 and out["stride"] == 64
    assert 0 <= out["top1"] <= out["top5"] <= 1 and out["bpb"] > 0
    assert out["ppl"] == pytest.approx(math.exp(out["loss"]))
    assert (trained / "eval_data_held.jsonl_step_00000120_reliability.png").is_file()
    assert "top-5" in capsys.readouterr().out
    assert main(["eval", str(trained), "--data", str(text), "--stride", "999"]) == 2
    assert "stride must be between 1 and max_length" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    assert main(["eval", str(trained), "--data", str(bad)]) == 2
    assert f"{bad}:2" in capsys.readouterr().err


def test_report_flags_documents_copied_from_the_training_data(trained, tmp_path):
    from lmforge.checkpoint.runs import run_config
    from lmforge.eval.contamination import training_texts

    cfg, _ = run_config(trained)
    seen = next(t for t in training_texts(cfg) if len(t.split()) > 200)
    copied = " ".join(seen.split()[100:140])
    rows = [{"q": copied, "choices": ["a", "b"], "label": 0}] + [
        {
            "q": f"zebra {i} quartz violin meadow lantern orbit canyon whisper falcon ember tide harbor",
            "choices": ["a", "b"],
            "label": 1,
        }
        for i in range(3)
    ]
    task = write_task(
        tmp_path,
        "task: leak\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_target: label\n"
        "doc_to_choice: choices\n",
        rows,
    )
    assert main(["eval", str(trained), "--tasks", str(task)]) == 0
    res = json.loads((trained / "eval_harness_step_00000120.json").read_text())
    leak = res["contamination"]["tasks"]["leak"]
    assert (leak["checked"], leak["contaminated"], leak["contaminated_docs"]) == (4, 1, [0])
    assert "| leak | 4 | 1 | 25.0% |" in (trained / "eval_report_step_00000120.md").read_text()
    assert main(["eval", str(trained), "--tasks", str(task), "--no-contamination"]) == 0
    assert json.loads((trained / "eval_harness_step_00000120.json").read_text())["contamination"] is None


def test_pass_at_k_runs_sampled_completions_in_the_sandbox(trained, tmp_path, code_sandbox):
    # The completion lands in a comment line, so what the model writes cannot break the program: the
    # first function's test passes whatever was sampled, the second's never does.
    rows = [
        {"prompt": "def f():\n    return 1\n# ", "test": "assert f() == 1"},
        {"prompt": "def g():\n    return 2\n# ", "test": "assert g() == 3, 'wrong on purpose'"},
    ]
    task = write_task(
        tmp_path,
        "task: code\noutput_type: generate_until\ndoc_to_text: prompt\ndoc_to_target: test\n"
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: true\n  temperature: 1.0\n'
        "repeats: 3\nmetric_list:\n  - metric: pass_at_k\n    k: [1, 2, 5]\n    test: test\n"
        "    timeout_s: 5\n",
        rows,
    )
    run = load_run(trained)
    res = run_task(load_task(task), Scorer(run.model, run.tokenizer), seed=7)
    assert res.metrics["pass@1"] == res.metrics["pass@2"] == 0.5
    assert "pass@5" not in res.metrics  # k above the 3 samples per document: not estimated
    assert [o.split(":")[0] for o in res.samples[1]["outcomes"]] == ["failed"] * 3
    assert "wrong on purpose" in res.samples[1]["outcomes"][0]
    again = run_task(load_task(task), Scorer(run.model, run.tokenizer), seed=7)
    assert [s["generations"] for s in again.samples] == [s["generations"] for s in res.samples]
    other = run_task(load_task(task), Scorer(run.model, run.tokenizer), seed=8)
    assert [s["generations"] for s in other.samples] != [s["generations"] for s in res.samples]


def test_data_val_sources_is_the_validation_split(tmp_path):
    from lmforge.data import load_prepared, prepare
    from lmforge.data.shards import open_shard

    corpus = REPO / "tests" / "data" / "pydoc_topics.jsonl"
    held = tmp_path / "held.txt"
    held.write_text("A held-out document of my choosing, about lists and loops.\n" * 20)
    base = [f"run.dir={tmp_path / 'run'}", f"data.sources=[{corpus}]", "data.max_chars=null"]
    cfg = load_config(TINY, [*base, f"data.dir={tmp_path / 'd1'}", f"data.val_sources=[{held}]"])
    meta = prepare(cfg, console=lambda *_: None).meta
    assert meta["splits"]["val"]["documents"] == 1
    assert meta["splits"]["train"]["documents"] == 79  # every document of data.sources trains
    data = load_prepared(tmp_path / "d1")
    val = [int(t) for s in data.shards("val") for t in open_shard(s)]
    assert data.tokenizer.decode(val) == held.read_text() + "<|endoftext|>"
    plain = load_config(TINY, [*base, f"data.dir={tmp_path / 'd2'}"])
    assert prepare(plain, console=lambda *_: None).meta["splits"]["train"]["documents"] < 79
    missing = load_config(
        TINY, [*base, f"data.dir={tmp_path / 'd3'}", f"data.val_sources=[{tmp_path / 'nope'}]"]
    )
    with pytest.raises(LmforgeError, match="nope"):
        prepare(missing, console=lambda *_: None)
    assert not (tmp_path / "d3").exists() or not any((tmp_path / "d3").iterdir())
