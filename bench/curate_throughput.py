"""Corpus curation throughput and near-dup quality: lmforge vs datatrove's MinHash dedup, same corpus.

    python bench/curate_throughput.py [--mb 50] [--repeats 2] [--workers 2]

The corpus is built from the docs and stdlib of the running Python (chunked into ~3 KB documents) plus
edited copies with known edit rates until it reaches --mb megabytes. Ground truth: for every injected
copy, the exact Jaccard of its word 5-gram shingles with its original (computed once, per pair, no
all-pairs). Recall = injected pairs with true Jaccard >= 0.8 whose two documents end up with one removed
(same cluster); precision = removed documents whose true Jaccard with some kept document of their
cluster is >= 0.7 (checked exactly, per removed document).

Both tools run with the same MinHash settings (5-grams, 14 bands x 8 rows = 112 hashes), the same number
of worker processes, alternating runs, medians. Writes bench/results/curate_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmforge.config import load_config  # noqa: E402
from lmforge.config.schema import DataConfig  # noqa: E402
from lmforge.data.sources import SourceStats, iter_documents  # noqa: E402

NGRAM, BANDS, ROWS = 5, 14, 8
EDIT_RATES = (0.0, 0.01, 0.03, 0.05, 0.1, 0.2, 0.4)


def shingles(text: str, n: int = NGRAM) -> set[int]:
    words = text.lower().split()
    if len(words) < n:
        return {hash(" ".join(words))}
    return {hash(" ".join(words[i:i + n])) for i in range(len(words) - n + 1)}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / max(1, len(sa | sb))


def edit(text: str, rate: float, rng: random.Random) -> str:
    words = text.split(" ")
    for i in range(len(words)):
        if rng.random() < rate:
            words[i] = rng.choice(("data", "value", "self", "return", "lmforge", "token"))
    return " ".join(words)


def build_corpus(out: Path, megabytes: float, seed: int = 0) -> dict:
    """JSONL corpus + ground-truth pairs (original id, copy id, true Jaccard)."""
    rng = random.Random(seed)
    base: list[str] = []
    for doc in iter_documents(DataConfig(sources=["builtin:python"]), SourceStats()):
        for i in range(0, len(doc), 3000):
            chunk = doc[i:i + 3000]
            if len(chunk.split()) >= 60:
                base.append(chunk)
    records, pairs, size = [], [], 0
    for i, text in enumerate(base):
        records.append({"id": f"orig-{i}", "text": text})
        size += len(text.encode())
    target = megabytes * 2**20
    k = 0
    while size < target:
        i = rng.randrange(len(base))
        rate = rng.choice(EDIT_RATES)
        text = edit(base[i], rate, rng)
        cid = f"copy-{k}"
        records.append({"id": cid, "text": text})
        pairs.append((f"orig-{i}", cid, jaccard(base[i], text)))
        size += len(text.encode())
        k += 1
    rng.shuffle(records)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return {"docs": len(records), "bytes": size, "pairs": pairs,
            "texts": {r["id"]: r["text"] for r in records}}


def quality(removed: set[str], truth: dict) -> dict:
    """Recall on injected pairs with true J >= 0.8 (one of the two removed); precision = removed
    documents that have an injected partner (original <-> copy) with true J >= 0.7. Near-duplicates
    that occur naturally in the stdlib count as false positives, so precision is a lower bound."""
    positives = [(a, b) for a, b, j in truth["pairs"] if j >= 0.8]
    hit = sum(1 for a, b in positives if a in removed or b in removed)
    partner = set()
    for a, b, j in truth["pairs"]:
        if j >= 0.7:
            partner.update((a, b))
    good = sum(1 for d in removed if d in partner)
    return {"recall": hit / max(1, len(positives)), "precision": good / max(1, len(removed)),
            "positives": len(positives), "removed": len(removed)}


def run_lmforge(corpus: Path, work: Path, workers: int, full: bool,
                bands: int = BANDS) -> tuple[float, set[str]]:
    from lmforge.data.curate import curate

    steps = (f"[{{step: minhash_dedup, ngram: {NGRAM}, num_perm: {BANDS * ROWS}, bands: {bands}, "
             "threshold: 0.8}]")
    overrides = [f"curate.inputs=[{corpus}]", f"curate.output_dir={work}", f"curate.workers={workers}",
                 "curate.docs_per_shard=2000"]
    if not full:
        overrides.append(f"curate.steps={steps}")
    cfg = load_config(None, overrides)
    t0 = time.perf_counter()
    curate(cfg)
    seconds = time.perf_counter() - t0
    removed = set()
    with open(work / "removed.jsonl") as f:
        for line in f:
            r = json.loads(line)
            if r["step"] == "minhash_dedup":
                removed.add(r["id"])
    return seconds, removed


def run_datatrove(corpus: Path, work: Path, workers: int) -> tuple[float, set[str]]:
    from datatrove.executor.local import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupSignature
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers.jsonl import JsonlWriter

    cfg = MinhashConfig(n_grams=NGRAM, num_buckets=BANDS, hashes_per_bucket=ROWS)
    tasks = workers
    reader = lambda: JsonlReader(str(corpus), glob_pattern="corpus.jsonl", id_key="id")  # noqa: E731
    stages = [
        LocalPipelineExecutor([reader(), MinhashDedupSignature(str(work / "sigs"), config=cfg)],
                              tasks=tasks, workers=workers, logging_dir=str(work / "logs1")),
        LocalPipelineExecutor([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=cfg)],
                              tasks=BANDS, workers=workers, logging_dir=str(work / "logs2")),
        LocalPipelineExecutor([MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=cfg)],
                              tasks=1, logging_dir=str(work / "logs3")),
        LocalPipelineExecutor([reader(),
                               MinhashDedupFilter(str(work / "remove"),
                                                  exclusion_writer=JsonlWriter(str(work / "removed"))),
                               JsonlWriter(str(work / "out"))],
                              tasks=tasks, workers=workers, logging_dir=str(work / "logs4")),
    ]
    t0 = time.perf_counter()
    for s in stages:
        s.run()
    seconds = time.perf_counter() - t0
    import gzip

    removed = set()
    for p in (work / "removed").glob("*.jsonl.gz"):
        with gzip.open(p, "rt") as f:
            removed.update(json.loads(line)["id"] for line in f)
    return seconds, removed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--lmforge-bands", type=int, default=BANDS,
                    help="LSH bands on lmforge's side (same 112 hashes; rows = 112 // bands)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "curate_throughput.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-curate-bench-"))
    try:
        truth = build_corpus(tmp / "corpus", args.mb)
        mb = truth["bytes"] / 2**20
        print(f"corpus: {truth['docs']:,} docs, {mb:.1f} MB, {len(truth['pairs']):,} injected copies")
        times: dict[str, list[float]] = {"lmforge_dedup": [], "datatrove_dedup": [], "lmforge_full": []}
        results = {}
        for r in range(args.repeats):
            order = ["lmforge_dedup", "datatrove_dedup"]
            if r % 2:
                order.reverse()
            for name in order + ["lmforge_full"]:
                work = tmp / f"{name}-{r}"
                if name == "datatrove_dedup":
                    sec, removed = run_datatrove(tmp / "corpus", work, args.workers)
                else:
                    sec, removed = run_lmforge(tmp / "corpus" / "corpus.jsonl", work, args.workers,
                                               full=name == "lmforge_full", bands=args.lmforge_bands)
                times[name].append(sec)
                if r == 0 and name != "lmforge_full":
                    results[name] = quality(removed, truth)
                print(f"  round {r} {name}: {sec:.1f}s")
                shutil.rmtree(work, ignore_errors=True)
        rows = {}
        for name, ts in times.items():
            med = statistics.median(ts)
            rows[name] = {"median_s": med, "docs_per_s": truth["docs"] / med, "mb_per_s": mb / med,
                          "runs_s": ts, **results.get(name, {})}
        ratio = rows["datatrove_dedup"]["median_s"] / rows["lmforge_dedup"]["median_s"]
        print("\n| run | median s | docs/s | MB/s | recall (J>=0.8) | precision |")
        print("|---|---|---|---|---|---|")
        for name, row in rows.items():
            print(f"| {name} | {row['median_s']:.1f} | {row['docs_per_s']:,.0f} | {row['mb_per_s']:.2f} | "
                  f"{row.get('recall', float('nan')):.3f} | {row.get('precision', float('nan')):.3f} |")
        print(f"\nnear-dedup speed ratio lmforge / datatrove: {ratio:.2f}x")
        out = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "torch_cpu": torch.backends.cpu.get_cpu_capability(),
                           "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
               "corpus": {"docs": truth["docs"], "mb": mb, "injected": len(truth["pairs"])},
               "settings": {"ngram": NGRAM, "bands": BANDS, "rows": ROWS, "workers": args.workers,
                            "lmforge_bands": args.lmforge_bands},
               "rows": rows, "ratio_dedup": ratio}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
