"""Curation report: threshold scaling, quality proxies, the strictness curve and the written files."""

from __future__ import annotations

import json

import pytest

from lmforge.config.curate import GopherQualityStep, LengthStep, NormalizeStep, RepetitionStep
from lmforge.data.curate.doc import Doc, StepStats
from lmforge.data.curate.report import build_report, quality_proxies, scaled, strictness_curve, write_report
from lmforge.data.curate.step import MapStep


class MinWords(MapStep):
    """A tiny filter for the tests: drop documents with fewer than cfg.min_chars // 5 words."""

    name = "min_words"

    def apply(self, doc):
        if len(doc.text.split()) < self.cfg.min_chars / 5:
            return None, "min_words:short"
        return doc, None


def test_scaled_makes_filters_stricter_and_clamps_ratios():
    g = scaled(GopherQualityStep(), 2.0)
    assert g.min_words == 100 and g.max_words == 50_000
    assert g.min_mean_word_length == 6.0 and g.max_mean_word_length == 5.0
    assert g.min_alpha_words_ratio == 1.0  # 1.6 clamped
    assert g.max_bullet_lines_ratio == pytest.approx(0.45)
    r = scaled(RepetitionStep(), 0.5)  # looser: maxes doubled, fractions clamped to 1
    assert r.max_top_ngram_char_frac == {2: pytest.approx(0.4), 3: pytest.approx(0.36),
                                         4: pytest.approx(0.32)}
    assert scaled(RepetitionStep(max_dup_line_frac=0.6), 0.5).max_dup_line_frac == 1.0
    n = NormalizeStep()
    assert scaled(n, 3.0) == n  # no thresholds
    assert scaled(LengthStep(max_chars=None, min_chars=10), 1.5).model_dump() == \
        LengthStep(max_chars=None, min_chars=15).model_dump()
    with pytest.raises(ValueError):
        scaled(n, 0)


def test_quality_proxies():
    q = quality_proxies(["the cat and the dog", "a b c a b c a b c"])
    assert q["mean_stop_word_ratio"] == pytest.approx((3 / 5 + 0) / 2)
    assert q["mean_alpha_ratio"] == 1.0
    assert q["distinct_3gram_ratio"] == pytest.approx((3 + 3) / (3 + 7))
    assert quality_proxies([])["distinct_3gram_ratio"] == 0.0


def test_strictness_curve_keeps_less_as_it_gets_stricter():
    sample = [Doc(str(n), " ".join(["word"] * n)) for n in range(1, 41)]
    pts = strictness_curve([LengthStep(min_chars=100)], sample, [0.5, 1.0, 2.0], MinWords)
    assert [p["multiplier"] for p in pts] == [0.5, 1.0, 2.0]
    assert [p["kept"] for p in pts] == [31, 21, 1]  # >= 10, 20, 40 words
    assert pts[1]["kept_fraction"] == pytest.approx(21 / 40)


def test_report_files_and_sums(tmp_path):
    st = StepStats("length")
    for n in (1, 30, 50):
        d = Doc(str(n), "w " * n)
        st.record(d, d if n > 10 else None, None if n > 10 else "length:short")
    report = build_report(
        inputs=["x"], output_dir=str(tmp_path), docs_read=3, chars_read=st.chars_in, bytes_read=st.chars_in,
        steps=[st.to_dict()], bad_input={"counts": {"empty": 1}, "examples": {"empty": ["x:1"]},
                                         "ignored_files": 0, "total": 1},
        dedup={"exact_removed": 0, "minhash_removed": 0, "exact_group_sizes": {},
               "minhash_cluster_sizes": {"2": 3}},
        shards=[{"path": "data/part-00000.jsonl", "docs": 2}], units=1, resumed_units=0,
        timings={"map_s": 2.0, "total_s": 2.0}, strictness=strictness_curve([LengthStep(min_chars=100)],
                                                                [Doc("a", "w " * 30)], [1.0, 2.0], MinWords))
    assert (report["docs_in"], report["docs_out"], report["removed"]) == (3, 2, 1)
    assert report["removal_reasons"] == {"length:short": 1}
    assert report["steps"][0]["reasons"]["length:short"]["examples"] == ["w "]
    assert report["tokens_in_est"] == round(st.chars_in / 4)
    plots = write_report(tmp_path, report)
    assert set(plots) == {"funnel", "reasons", "clusters", "strictness"}
    assert all(p.stat().st_size > 1000 for p in plots.values())
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["plots"]["funnel"] == "plots/funnel.png" and on_disk["docs_out"] == 2
    md = (tmp_path / "report.md").read_text()
    assert "length:short" in md and "![strictness](plots/strictness.png)" in md and "empty: 1" in md
