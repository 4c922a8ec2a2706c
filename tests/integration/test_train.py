"""End to end on the tiny recipe: what a run leaves behind, eval/generate on it, own-folder sources,
TensorBoard, and a SIGTERM (preemption) that saves and resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import CORPUS, TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.eval.open_run import evaluate, generate_text
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import train


def test_run_dir_contents_and_metrics_contract(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.max_steps=12", "train.log_every=3", "train.eval_every=6", "checkpoint.every=4",
                   "checkpoint.keep_last=2")
    final = train(cfg)
    run = tmp_path / "run"
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["model"]["vocab_size"] % 64 == 0 and resolved["train"]["max_steps"] == 12
    records = read_metrics(run / "metrics.jsonl")
    train_recs = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_recs] == [3, 6, 9, 12]
    for r in train_recs:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mib"} <= r.keys()
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [6, 12] and val[-1]["val_loss"] == pytest.approx(final["loss"])
    assert train_recs[-1]["loss"] < train_recs[0]["loss"]
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000008", "step_00000012"]


def test_eval_and_generate_on_a_run(tiny_cfg, tmp_path, capsys):
    train(tiny_cfg("train.max_steps=6", "checkpoint.every=3"))
    run = tmp_path / "run"
    out = evaluate(run, ["eval.max_batches=3"], say=lambda *_: None)
    assert out["step"] == 6 and out["tokens"] == 3 * 8 * 64
    assert 0 < out["bpb"] < 10 and out["ppl"] == pytest.approx(2.718281828 ** out["loss"], rel=1e-6)
    assert json.loads((run / "eval_val_step_00000006.json").read_text())["loss"] == out["loss"]
    # an earlier checkpoint by path
    early = evaluate(run / "checkpoints" / "step_00000003", ["eval.max_batches=3"], say=lambda *_: None)
    assert early["step"] == 3 and early["loss"] != out["loss"]
    a = generate_text(run, ["generate.prompt='def '", "generate.max_new_tokens=20", "generate.seed=3"])
    b = generate_text(run, ["generate.prompt='def '", "generate.max_new_tokens=20", "generate.seed=3"])
    c = generate_text(run, ["generate.prompt='def '", "generate.max_new_tokens=20", "generate.seed=4"])
    assert a == b and a != c and a[0].startswith("def ")
    assert main(["generate", str(run), "--prompt", "class ", "--set", "generate.max_new_tokens=5"]) == 0
    assert "class " in capsys.readouterr().out


def test_own_folder_of_txt_and_md(tmp_path):
    corpus = tmp_path / "mytexts"
    (corpus / "sub").mkdir(parents=True)
    text = CORPUS.read_text()
    for i in range(6):
        ext = "md" if i % 2 else "txt"
        folder = corpus / "sub" if i > 3 else corpus
        (folder / f"doc{i}.{ext}").write_text(text[i * 40_000:(i + 1) * 40_000])
    cfg = load_config(TINY, [f"run.dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'data'}",
                             f"data.sources=[{corpus}]", "logging.progress=none", "train.max_steps=3",
                             "data.val_fraction=0.3"])
    out = train(cfg)
    assert out["loss"] > 0
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["stats"]["files"] == 6
    assert sum(meta["splits"][s]["documents"] for s in ("train", "val")) == 6


def test_tensorboard_events(tiny_cfg, tmp_path):
    pytest.importorskip("tensorboard")
    train(tiny_cfg("train.max_steps=3", "logging.tensorboard=true"))
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow  # 10 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_sigterm_saves_and_resumes(tmp_path, shared_data_dir):
    args = sum((["--set", o] for o in tiny_overrides(tmp_path / "run", shared_data_dir, "train.max_steps=400",
                                                         "checkpoint.every=0")), [])
    cmd = [sys.executable, "-m", "lmforge", "train", "-c", str(TINY), *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not [r for r in read_metrics(metrics) if r.get("step", 0) >= 5]:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM" in err and "--resume" in err and "Traceback" not in err
    ckpts = list((tmp_path / "run" / "checkpoints").iterdir())
    assert len(ckpts) == 1
    stopped_at = int(ckpts[0].name.split("_")[1])
    assert 5 <= stopped_at < 400
    # the resume is not about the process boundary: in this process (one thread, as the stopped one)
    more = f"train.max_steps={stopped_at + 3}"
    assert main(["train", "-c", str(TINY), *args, "--resume", "--set", more]) == 0
    steps = [r["step"] for r in read_metrics(metrics) if "loss" in r]
    assert steps == list(range(1, stopped_at + 4))


def test_resume_skips_a_damaged_latest_checkpoint(tiny_cfg, tmp_path, shared_data_dir):
    train(tiny_cfg("train.max_steps=6", "checkpoint.every=3"))
    (tmp_path / "run" / "checkpoints" / "step_00000006" / "rank_00000.pt").write_bytes(b"garbage")
    train(tiny_cfg("train.max_steps=8", "checkpoint.every=3"), resume=True)  # continues from step 3
    # The unreadable checkpoint is kept (moved out of the step sequence), not overwritten by step 6 again.
    kept = tmp_path / "run" / "checkpoints" / "unreadable" / "step_00000006" / "rank_00000.pt"
    assert kept.read_bytes() == b"garbage"
    clean = load_config(TINY, tiny_overrides(tmp_path / "clean", shared_data_dir, "train.max_steps=8",
                                             "checkpoint.every=3"))
    train(clean)

    def losses(run):
        return [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]

    assert losses(tmp_path / "run") == losses(tmp_path / "clean")


def test_compiled_training_tracks_eager(tiny_cfg, tmp_path, shared_data_dir):
    """train.compile=true: the same model and data, fused kernels; losses agree to float rounding."""
    train(tiny_cfg("train.max_steps=5", "checkpoint.every=0", "checkpoint.save_final=false"))
    compiled = load_config(TINY, tiny_overrides(tmp_path / "compiled", shared_data_dir, "train.max_steps=5",
                                                "checkpoint.every=0", "checkpoint.save_final=false",
                                                "train.compile=true"))
    train(compiled)

    def losses(run):
        return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]

    eager, fused = losses(tmp_path / "run"), losses(tmp_path / "compiled")
    assert len(eager) == len(fused) == 5
    assert fused == pytest.approx(eager, abs=1e-4)
