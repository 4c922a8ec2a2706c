"""A verb that would replace a file the user named refuses without --overwrite, before any work and
without writing anything else; with --overwrite it writes beside the file and renames over it."""

from __future__ import annotations

import pytest
import yaml

from lmforge.cli import main


@pytest.fixture
def notes(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("the user's own file\n")
    return p


@pytest.mark.parametrize("argv", [
    ["constitution", "--write-default", "{f}"],
    ["scaling", "plan", "--compute", "1e18", "--out", "{f}"],
    ["scaling", "fit", "no-such-run", "--out", "{f}"],  # refused before the runs are read
    ["plot-schedule", "-o", "{f}"],
    ["lr-find", "-o", "{f}"],
    ["eval", "no-run-a", "no-run-b", "--tasks", "t.yaml", "--compare-out", "{f}"],  # before any eval
    ["tasks", "-o", "{f}", "--n", "4"],
])
def test_an_existing_file_is_refused_before_any_work(argv, notes, capsys):
    assert main([a.replace("{f}", str(notes)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"{notes} already exists; refusing to replace it: give --overwrite" in err
    assert notes.read_text() == "the user's own file\n"


def test_tasks_writes_neither_file_when_the_second_is_refused(tmp_path, notes, capsys):
    new = tmp_path / "new.jsonl"
    assert main(["tasks", "-o", str(new), "--test-out", str(notes), "--n", "8"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert not new.exists() and notes.read_text() == "the user's own file\n"


def test_overwrite_replaces_the_file(tmp_path, notes):
    assert main(["constitution", "--write-default", str(notes), "--overwrite"]) == 0
    assert isinstance(yaml.safe_load(notes.read_text()), list)
    assert main(["scaling", "plan", "--compute", "1e18", "--out", str(notes), "--overwrite"]) == 0
    assert yaml.safe_load(notes.read_text())["train"]["max_steps"] > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".notes")]  # no temporary left behind
