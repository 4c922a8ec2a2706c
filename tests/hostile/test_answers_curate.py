"""The curation step `harmful` removes something by default: it ships a real block list (LDNOOBW,
English, CC BY 4.0) and the run says which lists ran and how many entries each gave, in its output and
in report.json / report.md. A step with no entry at all is refused before anything is read."""

from __future__ import annotations

import json

import yaml

from lmforge.cli import main
from lmforge.data.curate.steps.harmful import SHIPPED

CLEAN = "The committee met on Tuesday to review the budget for the new library building and its garden."


def _config(tmp_path, steps) -> str:
    inputs = tmp_path / "in"
    inputs.mkdir(parents=True)
    entry = SHIPPED["ldnoobw-en"].read_text(encoding="utf-8").splitlines()[1]  # a phrase of the list
    docs = [{"id": "clean", "text": CLEAN}, {"id": "listed", "text": f"{CLEAN} Then {entry}."}]
    (inputs / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    cur = {"inputs": [str(inputs)], "output_dir": str(tmp_path / "out"), "workers": 1, "strictness_sweep": [],
           "steps": steps}
    path = tmp_path / "curate.yaml"
    path.write_text(yaml.safe_dump({"curate": cur}))
    return str(path)


def test_the_harmful_step_removes_by_default_and_reports_its_lists(tmp_path, capsys):
    assert main(["data", "-c", _config(tmp_path, [{"step": "harmful"}])]) == 0
    said = "harmful: 403 block-list entries from ldnoobw-en (403)"
    assert said in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (row,) = report["steps"]
    assert row["removed"] == 1 and row["settings"]["block_lists"] == {"ldnoobw-en": 403}
    assert said in (tmp_path / "out" / "report.md").read_text()
    removed = [json.loads(line) for line in (tmp_path / "out" / "removed.jsonl").read_text().splitlines()]
    assert removed == [{"id": "listed", "step": "harmful", "reason": "harmful:blocklist"}]


def test_a_harmful_step_with_no_entry_or_an_unreadable_list_is_refused(tmp_path, capsys):
    for i, (step, words) in enumerate([({"step": "harmful", "lists": []}, "block list is empty"),
                                       ({"step": "harmful", "blocklist_files": [str(tmp_path / "nope.txt")]},
                                        "cannot read")]):
        assert main(["data", "-c", _config(tmp_path / str(i), [step])]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lmforge data: error: curate.steps[harmful]") and words in err, err
        assert not (tmp_path / str(i) / "out").exists()
