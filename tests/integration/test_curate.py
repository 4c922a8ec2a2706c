"""`lmforge data` end to end: a small real corpus with injected duplicates and junk, every input id
accounted for exactly once, a report whose numbers add up, kill -9 + resume giving byte-identical
output, and Ray giving the same output as local workers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import CORPUS
from lmforge.config import load_config
from lmforge.data.curate import curate
from lmforge.errors import DataError

STEPS = [
    {"step": "normalize"},
    {"step": "gopher_quality", "min_words": 20},
    {"step": "repetition"},
    {"step": "length", "min_chars": 80},
    {"step": "exact_dedup"},
    {"step": "minhash_dedup", "threshold": 0.7},
]
JUNK = ["$$$ ### !!! %%% ^^^ &&& *** ((( )))", "buy now " * 80,
        "\n".join(["the same line over and over again"] * 30), "too short"]


def paragraphs() -> list[str]:
    seen, out = set(), []
    for line in CORPUS.read_text().splitlines():
        for p in re.split(r"\n\s*\n", json.loads(line)["text"]):
            p = p.strip()
            if len(p.split()) >= 20 and p not in seen:
                seen.add(p)
                out.append(p)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """300 documents in a JSONL file, a folder of .txt files and (if pyarrow) a Parquet file, with 10
    exact duplicates, 10 near duplicates (one word changed), 4 junk documents and one broken line."""
    root = tmp_path_factory.mktemp("corpus")
    paras = paragraphs()[:276]
    long_ones = [i for i, p in enumerate(paras) if len(p.split()) >= 60][:10]
    docs = [(f"p{i:04d}", p) for i, p in enumerate(paras)]
    exact = [(f"x{k}", paras[i]) for k, i in enumerate(long_ones)]
    near = []
    for k, i in enumerate(long_ones):
        words = paras[i].split(" ")
        words[len(words) // 2] = "zebra"
        near.append((f"n{k}", " ".join(words)))
    junk = [(f"j{k}", t) for k, t in enumerate(JUNK)]
    allr = docs[:150] + exact + docs[150:200] + near + junk + docs[200:]
    assert len(allr) == 300
    with open(root / "a.jsonl", "w") as f:
        for i, (rid, text) in enumerate(allr[:200]):
            f.write(json.dumps({"id": rid, "text": text}) + "\n")
            if i == 100:
                f.write('{"id": "broken", "text": \n')
    (root / "txt").mkdir()
    ids = [rid for rid, _ in allr[:200]]
    idmap = {rid: rid for rid, _ in allr}
    for rid, text in allr[200:250]:
        (root / "txt" / f"{rid}.txt").write_text(text)
        ids.append(str(root / "txt" / f"{rid}.txt"))
        idmap[rid] = ids[-1]
    rest = allr[250:]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [r for r, _ in rest], "text": [t for _, t in rest]}),
                       root / "z.parquet", row_group_size=16)
        ids += [r for r, _ in rest]
    except ImportError:
        with open(root / "z.jsonl", "w") as f:
            for rid, text in rest:
                f.write(json.dumps({"id": rid, "text": text}) + "\n")
        ids += [r for r, _ in rest]
    return {"root": root, "ids": ids, "idmap": idmap, "long_ones": long_ones}


def config_yaml(tmp_path: Path, corpus: dict, out: Path, **extra) -> Path:
    # the sweep only adds to the report; runs that do not check it skip it (it is not in the fingerprint)
    cur = {"inputs": [str(corpus["root"])], "output_dir": str(out), "docs_per_shard": 12, "workers": 2,
           "strictness_sweep": [], "steps": STEPS, **extra}
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump({"curate": cur}))
    return path


def run_in_process(tmp_path: Path, corpus: dict, out: Path, overwrite=False, **extra) -> dict:
    cfg = load_config(config_yaml(tmp_path, corpus, out, **extra), [])
    return curate(cfg, overwrite=overwrite, console=lambda m: None)


def output_bytes(out: Path) -> dict[str, bytes]:
    files = sorted((out / "data").glob("part-*")) + [out / "removed.jsonl"]
    return {f.name: f.read_bytes() for f in files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> Path:
    """One uninterrupted run (2 spawn workers), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("ref")
    run_in_process(tmp, corpus, tmp / "out", strictness_sweep=[0.5, 1.0, 2.0])
    return tmp / "out"


def test_every_input_is_output_or_removed_exactly_once(reference, corpus):
    out_ids = [json.loads(line)["id"] for f in sorted((reference / "data").glob("part-*.jsonl"))
               for line in f.read_text().splitlines()]
    removed = [json.loads(line) for line in (reference / "removed.jsonl").read_text().splitlines()]
    seen = Counter(out_ids + [r["id"] for r in removed])
    assert sorted(seen) == sorted(corpus["ids"]) and set(seen.values()) == {1}
    assert out_ids == [i for i in corpus["ids"] if i in set(out_ids)]  # input order kept
    by_id = {r["id"]: r for r in removed}
    m = corpus["idmap"]
    for k, i in enumerate(corpus["long_ones"]):
        orig = m[f"p{i:04d}"]
        assert by_id[m[f"x{k}"]] == {"id": m[f"x{k}"], "step": "exact_dedup",
                                     "reason": f"exact_dedup:duplicate_of:{orig}"}
        assert by_id[m[f"n{k}"]] == {"id": m[f"n{k}"], "step": "minhash_dedup",
                                     "reason": f"minhash_dedup:cluster:{orig}"}
    assert {by_id[m[f"j{k}"]]["step"] for k in range(len(JUNK))} <= {"gopher_quality", "repetition", "length"}
    shard_sizes = [len(f.read_text().splitlines()) for f in sorted((reference / "data").glob("part-*"))]
    assert all(n == 12 for n in shard_sizes[:-1]) and 0 < shard_sizes[-1] <= 12


def test_report_numbers_add_up(reference, corpus):
    r = json.loads((reference / "report.json").read_text())
    assert r["docs_in"] == len(corpus["ids"])
    assert r["bad_input"]["counts"] == {"bad_json": 1}
    assert r["bad_input"]["examples"]["bad_json"] == [f"{corpus['root'] / 'a.jsonl'}:102"]
    steps = r["steps"]
    assert [s["name"] for s in steps] == [s["step"] for s in STEPS]
    assert steps[0]["docs_in"] == r["docs_in"] and steps[-1]["docs_out"] == r["docs_out"]
    for a, b in zip(steps, steps[1:]):
        assert a["docs_out"] == b["docs_in"] and a["chars_out"] == b["chars_in"]
    removed = [json.loads(line) for line in (reference / "removed.jsonl").read_text().splitlines()]
    assert r["removed"] == len(removed) == sum(s["removed"] for s in steps) == r["docs_in"] - r["docs_out"]
    assert Counter(x["step"] for x in removed) == {s["name"]: s["removed"] for s in steps if s["removed"]}
    assert sum(r["removal_reasons"].values()) == r["removed"]
    assert r["dedup"]["exact_removed"] == steps[4]["removed"] >= 10
    assert r["dedup"]["minhash_removed"] == steps[5]["removed"] >= 10
    sizes = r["dedup"]["minhash_cluster_sizes"]
    assert sum((int(k) - 1) * v for k, v in sizes.items()) == r["dedup"]["minhash_removed"]
    assert sum(s["docs"] for s in r["shards"]) == r["docs_out"]
    assert [p["multiplier"] for p in r["strictness"]] == [0.5, 1.0, 2.0]
    kept = [p["kept_fraction"] for p in r["strictness"]]
    assert kept[0] >= kept[1] >= kept[2] and kept[1] < 1.0
    assert r["throughput"]["docs_per_s"] > 0 and r["units"] == 26
    for name in ("funnel", "reasons", "clusters", "strictness"):
        assert (reference / "plots" / f"{name}.png").stat().st_size > 1000
    assert "## Strictness trade-off" in (reference / "report.md").read_text()


def test_output_feeds_prepare(reference):
    from lmforge.config.schema import DataConfig
    from lmforge.data.sources import SourceStats, iter_documents

    stats = SourceStats()
    docs = list(iter_documents(DataConfig(sources=[str(reference / "data")]), stats))
    assert len(docs) == json.loads((reference / "report.json").read_text())["docs_out"]
    assert stats.skipped_bad_json == 0


def test_rerun_resumes_and_changed_config_needs_overwrite(tmp_path, corpus, reference):
    out = tmp_path / "out"
    run_in_process(tmp_path, corpus, out, workers=1)
    first = output_bytes(out)
    assert first == output_bytes(reference)  # worker count does not change the output
    markers = {p: p.stat().st_mtime_ns for p in (out / "work" / "completions").iterdir()}
    run_in_process(tmp_path, corpus, out, workers=1)
    assert {p: p.stat().st_mtime_ns for p in (out / "work" / "completions").iterdir()} == markers
    assert json.loads((out / "report.json").read_text())["resumed_units"] == 26
    with pytest.raises(DataError, match="different settings .*docs_per_shard.*--overwrite"):
        run_in_process(tmp_path, corpus, out, workers=1, docs_per_shard=50)
    run_in_process(tmp_path, corpus, out, workers=1, overwrite=True, docs_per_shard=50)
    assert len(list((out / "work" / "completions").iterdir())) == 7


@pytest.mark.slow  # 12 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_kill_9_and_resume_is_byte_identical(tmp_path, corpus, reference):
    out = tmp_path / "killed"
    cfg = config_yaml(tmp_path, corpus, out)
    cmd = [sys.executable, "-m", "lmforge", "data", "-c", str(cfg)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    completions = out / "work" / "completions"
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            if completions.is_dir() and len(list(completions.glob("*.json"))) >= 3:
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its pool workers, mid-unit
    finally:
        proc.wait(timeout=60)
    done_before = {p: p.stat().st_mtime_ns for p in completions.glob("*.json")}
    assert 3 <= len(done_before) < 26
    assert not (out / "report.json").exists()

    res = subprocess.run(cmd + ["--set", "curate.workers=1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stdout
    assert {p: p.stat().st_mtime_ns for p in done_before} == done_before  # not processed twice
    assert output_bytes(out) == output_bytes(reference)
    assert json.loads((out / "report.json").read_text())["resumed_units"] >= len(done_before)


@pytest.mark.slow  # 13 s on 2 cores: the slow tier (CI), keeping the default suite near 15 min
def test_ray_engine_matches_local(tmp_path, corpus, reference):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run_in_process(tmp_path, corpus, tmp_path / "out", engine="ray")
    finally:
        ray.shutdown()
    assert output_bytes(tmp_path / "out") == output_bytes(reference)


def test_map_step_after_dedup_is_a_config_error(tmp_path, corpus):
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"steps\[2\].*comes after 'exact_dedup'"):
        run_in_process(tmp_path, corpus, tmp_path / "out",
                       steps=[{"step": "normalize"}, {"step": "exact_dedup"}, {"step": "length"}])
