"""User errors: one clear message naming what and where, exit status 2, no traceback, nothing damaged."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest
import torch

from conftest import CORPUS, TINY, tiny_overrides
from lmforge.cli import main


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err
    return code, err


def sets(*overrides: str) -> list[str]:
    return sum((["--set", o] for o in overrides), [])


def test_unknown_key_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lmforge", "train", "-c", str(TINY), "--set",
                           "train.max_stepz=3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown key 'train.max_stepz'" in proc.stderr and "did you mean 'max_steps'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_source_path(tmp_path, capsys):
    code, err = run_cli(capsys, "train", "-c", str(TINY), *sets(
        f"run.dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'data'}",
        f"data.sources=[{tmp_path / 'nope'}]"))
    assert code == 2 and str(tmp_path / "nope") in err


def test_empty_corpus(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "empty.txt").write_text("   \n")
    code, err = run_cli(capsys, "prepare", "-c", str(TINY), *sets(
        f"run.dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'data'}", f"data.sources=[{corpus}]"))
    assert code == 2 and "empty" in err.lower()
    assert not (tmp_path / "data" / "meta.json").exists()


def test_bad_utf8_skip_or_fail(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = CORPUS.read_text()
    (corpus / "good1.txt").write_text(text[:100_000])
    (corpus / "good2.txt").write_text(text[100_000:200_000])
    (corpus / "bad.txt").write_bytes(b"caf\xe9 au lait\n" * 10)
    base = (f"run.dir={tmp_path / 'run'}", f"data.sources=[{corpus}]")
    code, err = run_cli(capsys, "prepare", "-c", str(TINY),
                        *sets(*base, f"data.dir={tmp_path / 'd1'}", "data.on_bad_utf8=fail"))
    assert code == 2 and "bad.txt" in err
    code, _ = run_cli(capsys, "prepare", "-c", str(TINY),
                      *sets(*base, f"data.dir={tmp_path / 'd2'}", "data.on_bad_utf8=skip"))
    assert code == 0


def test_malformed_jsonl_names_file_and_line(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "one document here"}\n{"text": "two"}\n{"text": broken\n')
    code, err = run_cli(capsys, "prepare", "-c", str(TINY), *sets(
        f"run.dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'data'}", f"data.sources=[{src}]"))
    assert code == 2 and f"{src}:3" in err


def test_run_dir_holding_a_run_is_refused_then_resume_shape_checked(tmp_path, shared_data_dir, capsys):
    args = ["train", "-c", str(TINY), *sets(*tiny_overrides(tmp_path / "run", shared_data_dir,
                                                            "train.max_steps=3", "checkpoint.every=3"))]
    assert main(args) == 0
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    config_before = (tmp_path / "run" / "config.yaml").read_text()
    code, err = run_cli(capsys, *args)
    assert code == 2 and "already holds a run" in err and "--resume" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    code, err = run_cli(capsys, *args, "--resume", "--set", "model.d_model=128", "--set", "model.n_heads=4")
    assert code == 2 and "different shape" in err and "tok_embeddings.weight" in err
    assert (tmp_path / "run" / "config.yaml").read_text() == config_before
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_full_disk_during_save_keeps_previous_checkpoint(tmp_path, shared_data_dir, capsys, monkeypatch):
    args = ["train", "-c", str(TINY), *sets(*tiny_overrides(tmp_path / "run", shared_data_dir,
                                                            "train.max_steps=4", "checkpoint.every=4"))]
    assert main(args) == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    code, err = run_cli(capsys, *args, "--resume", "--set", "train.max_steps=8")
    monkeypatch.undo()
    assert code == 2 and "no space left on device" in err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000004"]
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("verb", ["eval", "generate"])
def test_eval_generate_on_missing_run(tmp_path, capsys, verb):
    code, err = run_cli(capsys, verb, str(tmp_path / "missing"))
    assert code == 2 and "no such run" in err
