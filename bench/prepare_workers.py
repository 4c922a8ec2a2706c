"""`lmforge prepare` throughput with data.workers = 1 vs more worker processes, same corpus.

    python bench/prepare_workers.py [--mb 50] [--repeats 3] [--workers 1 2]

The corpus is --mb megabytes of bench/corpora.py's seeded prose in one JSONL file (~3 KB documents). The
tokenizer is trained once beforehand (an 8k byte-level BPE on the first 2 MB) and given by
data.tokenizer.path, so each timed run is reading, encoding and writing shards only. Runs alternate
between the worker counts (the machine may be shared: interleaving spreads its load over all of them);
medians are reported, with the load average, and the shards of every run are checked identical.
Writes bench/results/prepare_workers.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from corpora import prose_documents  # noqa: E402
from lmforge.config.schema import Config  # noqa: E402
from lmforge.data.prepare import prepare  # noqa: E402
from lmforge.data.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prepare-workers-"))
    try:
        corpus = work / "corpus.jsonl"
        with corpus.open("w") as f:
            for doc in prose_documents(int(args.mb * 1e6)):
                f.write(json.dumps({"text": doc}) + "\n")
        tok = Tokenizer.train((d for d in prose_documents(2_000_000, seed=1)), 8192, 2)
        tok.save(work / "tok.json")
        times: dict[int, list[float]] = {w: [] for w in args.workers}
        digests = set()
        for r in range(args.repeats):
            for w in args.workers if r % 2 == 0 else reversed(args.workers):
                out = work / f"data-{w}-{r}"
                cfg = Config.model_validate({"run": {"dir": str(work / "run")}, "data": {
                    "sources": [str(corpus)], "dir": str(out), "tokenizer": {"path": str(work / "tok.json")},
                    "workers": w}})
                t0 = time.perf_counter()
                data = prepare(cfg, console=lambda *_: None)
                times[w].append(time.perf_counter() - t0)
                h = hashlib.sha256()
                for p in data.shards("train") + data.shards("val"):
                    h.update(p.read_bytes())
                digests.add(h.hexdigest())
                shutil.rmtree(out)
                print(f"workers={w} run {r}: {times[w][-1]:.1f}s", flush=True)
        mb = corpus.stat().st_size / 1e6
        result = {
            "corpus_mb": round(mb, 1), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "identical_shards": len(digests) == 1,
            "runs": {w: [round(t, 2) for t in ts] for w, ts in times.items()},
            "median_s": {w: round(statistics.median(ts), 2) for w, ts in times.items()},
            "mb_per_s": {w: round(mb / statistics.median(ts), 2) for w, ts in times.items()},
        }
        print(json.dumps(result, indent=1))
        (ROOT / "bench" / "results").mkdir(exist_ok=True)
        (ROOT / "bench" / "results" / "prepare_workers.json").write_text(json.dumps(result, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
