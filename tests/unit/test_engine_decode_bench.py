"""bench/engine_decode.py (the GPU suite's serve row) at its tiny CPU preset: the serving engine and
transformers' generate decode the same greedy tokens from the same fp32 weights, and the bench writes
its tokens/s and ratio per batch size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

pytest.importorskip("transformers")


def test_tiny_preset_agrees_with_transformers_and_reports_tokens_per_second(tmp_path):
    import engine_decode

    out = tmp_path / "ed.json"
    assert engine_decode.main(["--preset", "tiny", "--device", "cpu", "--rounds", "1", "--threads", "1",
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["machine"]["max_logit_diff"] <= 1e-4
    for batch, row in report["results"].items():
        assert row["agree"] == row["sequences"] == int(batch)  # fp32: greedy tokens equal, row by row
        assert row["lmforge_tok_s"] > 0 and row["transformers_tok_s"] > 0 and row["ratio"] > 0
