"""The job server under dashboard-like load: does polling slow the run it watches?

    .venv/bin/python bench/jobs_load.py                    # demo model, 200 req/s, 3 rounds of 30 s + 30 s
    .venv/bin/python bench/jobs_load.py --recipe tiny --window 10 --rounds 2   # quick look, debug model

A job server (`lmforge jobs`, a child process) trains a run as a job: the demo recipe
(runs/demo/config.yaml: d_model 256, 4 layers, batch 16 x 256, its prepared data in data/cache/demo)
or configs/debug/tiny.yaml (--recipe tiny, on tests/data), log_every 1, no evaluations or
checkpoints, train.threads from --threads (1 by default, so that the job, the server and the clients
each have a core on a 2-core machine; say what you used). Once it trains, windows of --window seconds
alternate between quiet (no requests) and load: --clients threads, each with its own httpx client,
together sending --rate requests per second on a fixed schedule, a mix of GET /v1/jobs/{id} (status,
step, latest metrics, ETA; 50%), GET /v1/jobs (the list; 25%) and GET /v1/jobs/{id}/artifacts/
metrics.jsonl (the whole curve; 25%). The order alternates every round (quiet-load, load-quiet).

Reported: per window, the median of the trainer's own per-step tokens_per_s (the metrics.jsonl records
that appeared between reads of the file at the window's start and end) and the tokens trained per wall
second over it; the medians over quiet and over loaded windows and their ratio (loaded / quiet; the
drop is 1 - ratio, target < 5%); the median of the per-round ratios (each loaded window over the quiet
one beside it, so that slow drift of a shared machine cancels); requests sent, failed (an exception or
a status other than 200; target 0), achieved rate and latency p50 / p99. The clients run in this
process, niced (--client-nice) like the server's API thread, standing in for browsers on other
machines; on a 2-core machine they still share its cores.
Never asserts; prints the machine and writes JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from lmforge.jobserver.server import server_process  # noqa: E402


def recipe(name: str, threads: int) -> tuple[str, list[str]]:
    """(config YAML text, extra --allow-root dirs) of the run the server trains."""
    if name == "demo":
        cfg = yaml.safe_load((REPO / "runs" / "demo" / "config.yaml").read_text())
        data = REPO / "data" / "cache" / "demo"
        cfg["data"]["dir"] = str(data)
        roots = [str(data)]
    else:
        cfg = yaml.safe_load((REPO / "configs" / "debug" / "tiny.yaml").read_text())
        corpus = REPO / "tests" / "data" / "pydoc_topics.jsonl"
        cfg["data"].update({"sources": [str(corpus)], "max_chars": None})
        cfg["data"].pop("dir", None)
        roots = [str(corpus.parent)]
    cfg["train"].update({"max_steps": 1_000_000, "log_every": 1, "eval_every": 0, "threads": threads})
    cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "every": 0, "save_final": False}
    cfg.setdefault("logging", {})["progress"] = "none"
    cfg["logging"]["plot"] = False
    return yaml.safe_dump(cfg), roots


def records(path: Path) -> list[dict]:
    """The training records of the job's metrics.jsonl so far (read from disk, not through the server)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines:
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError:  # a line being written
            continue
        if "tokens_per_s" in rec:
            out.append(rec)
    return out


def load(url: str, headers: dict, job_id: str, rate: float, clients: int, seconds: float,
         args_nice: int) -> dict:
    """`rate` requests per second from `clients` threads for `seconds`; counts and latencies."""
    job = f"/v1/jobs/{job_id}"
    paths = [job, "/v1/jobs", job, f"{job}/artifacts/metrics.jsonl"]
    lat: list[float] = []
    failed: list[str] = []
    lock = threading.Lock()
    start = time.monotonic() + 0.2
    interval = clients / rate

    def worker(k: int) -> None:
        # The clients stand in for browsers on other machines: on a 2-core box they run niced so that the
        # harness competes with the job as little as the server's own API thread does (nice 10).
        if args_nice:
            os.setpriority(os.PRIO_PROCESS, 0, args_nice)
        with httpx.Client(base_url=url, headers=headers, timeout=10) as c:
            i = 0
            while True:
                due = start + (i + k / clients) * interval
                if due >= start + seconds or time.monotonic() >= start + seconds:
                    return  # a request the server could not take in time is not sent: the rate says so
                time.sleep(max(0.0, due - time.monotonic()))
                t = time.perf_counter()
                try:
                    r = c.get(paths[(i + k) % len(paths)])
                    ok = r.status_code == 200
                    why = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    ok, why = False, repr(e)
                dt = time.perf_counter() - t
                with lock:
                    lat.append(dt)
                    if not ok:
                        failed.append(why)
                i += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.monotonic() - start
    lat.sort()
    return {"sent": len(lat), "failed": len(failed), "failures": sorted(set(failed))[:5],
            "rate": len(lat) / took, "p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
            "p99_ms": 1000 * lat[int(len(lat) * 0.99)] if lat else None}


def window(before: list[dict], after: list[dict], seconds: float) -> dict:
    """The steps logged between two reads of metrics.jsonl taken at a window's start and end."""
    recs = after[len(before):]
    tps = [r["tokens_per_s"] for r in recs]
    seen = (after[-1]["tokens_seen"] - before[-1]["tokens_seen"]) if before and after else 0
    return {"steps": len(recs), "median_tokens_per_s": statistics.median(tps) if tps else None,
            "wall_tokens_per_s": seen / seconds if seen else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=("demo", "tiny"), default="demo")
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second under load")
    ap.add_argument("--clients", type=int, default=32, help="client threads sharing the rate (enough that "
                    "a slow answer does not hold the rate down)")
    ap.add_argument("--window", type=float, default=30.0, help="seconds per quiet / loaded window")
    ap.add_argument("--rounds", type=int, default=3, help="quiet + loaded window pairs")
    ap.add_argument("--threads", type=int, default=1, help="the job's train.threads")
    ap.add_argument("--client-nice", type=int, default=10, help="niceness of the client threads (0: same "
                    "priority as the job)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    cfg, roots = recipe(args.recipe, args.threads)
    with tempfile.TemporaryDirectory(prefix="jobs_load_") as tmp:
        ws = Path(tmp)
        token = subprocess.run([sys.executable, "-m", "lmforge", "jobs", "token", "create", "--workspace",
                                str(ws), "--user", "bench"], capture_output=True, text=True,
                               check=True).stdout.strip()
        headers = {"Authorization": f"Bearer {token}"}
        extra = [a for r in roots for a in ("--allow-root", r)]
        with server_process(ws, *extra) as srv:
            c = httpx.Client(base_url=srv.url, headers=headers, timeout=30)
            r = c.post("/v1/jobs", json={"config": cfg, "name": f"load-{args.recipe}"})
            r.raise_for_status()
            job_id = r.json()["id"]
            try:
                metrics = ws / "jobs" / job_id / "run" / "metrics.jsonl"
                rows = measure(args, srv.url, headers, c, job_id, metrics)
            finally:  # a job outlives its server: stop it whatever happened here
                c.post(f"/v1/jobs/{job_id}/cancel")
                deadline = time.monotonic() + 60
                while c.get(f"/v1/jobs/{job_id}").json()["status"] == "running" and (
                        time.monotonic() < deadline):
                    time.sleep(0.2)
    report(args, rows)


def measure(args, url: str, headers: dict, c: httpx.Client, job_id: str, metrics: Path) -> list[dict]:
    """The quiet and loaded windows, round by round."""
    while len(records(metrics)) < 3:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            raise SystemExit(f"the job ended: {job}")
        time.sleep(0.5)
    rows = []
    for rnd in range(args.rounds):
        order = ("quiet", "load") if rnd % 2 == 0 else ("load", "quiet")
        for kind in order:
            t0, before = time.monotonic(), records(metrics)
            if kind == "load":
                req = load(url, headers, job_id, args.rate, args.clients, args.window,
                           args.client_nice)
            else:
                time.sleep(args.window)
                req = None
            t1, after = time.monotonic(), records(metrics)
            row = {"round": rnd, "kind": kind, **window(before, after, t1 - t0), "requests": req}
            rows.append(row)
            extra_txt = (f"  {req['sent']} requests ({req['rate']:.0f}/s), {req['failed']} failed, "
                         f"p50 {req['p50_ms']:.1f} ms, p99 {req['p99_ms']:.1f} ms" if req else "")
            print(f"round {rnd} {kind:>5}: {row['steps']:3d} steps, median "
                  f"{row['median_tokens_per_s'] or 0:8.0f} tok/s, wall "
                  f"{row['wall_tokens_per_s'] or 0:8.0f} tok/s{extra_txt}", flush=True)
    return rows


def report(args, rows: list[dict]) -> None:
    """Medians, ratios and request counts; JSON with --json."""

    def med(kind: str, key: str) -> float:
        vals = [r[key] for r in rows if r["kind"] == kind and r[key]]
        return statistics.median(vals) if vals else float("nan")

    q, lo = med("quiet", "median_tokens_per_s"), med("load", "median_tokens_per_s")
    qw, lw = med("quiet", "wall_tokens_per_s"), med("load", "wall_tokens_per_s")
    # Paired: each round's loaded window over its own quiet neighbour (slow drift of the machine cancels).
    by = {(r["round"], r["kind"]): r["median_tokens_per_s"] for r in rows}
    pairs = [by[(k, "load")] / by[(k, "quiet")] for k in range(args.rounds)
             if by.get((k, "load")) and by.get((k, "quiet"))]
    paired = statistics.median(pairs) if pairs else float("nan")
    reqs = [r["requests"] for r in rows if r["requests"]]
    sent, failed = sum(r["sent"] for r in reqs), sum(r["failed"] for r in reqs)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"\nmachine: {cpu}, {os.cpu_count()} cores; recipe {args.recipe}, job threads {args.threads}; "
          f"{args.rate:.0f} req/s from {args.clients} clients; {args.rounds} x ({args.window:.0f} s quiet + "
          f"{args.window:.0f} s loaded)")
    print(f"tokens/s, median of per-step  quiet {q:9.0f}  loaded {lo:9.0f}  ratio {lo / q:.3f} "
          f"(drop {100 * (1 - lo / q):+.1f}%)")
    print(f"tokens/s, wall over window    quiet {qw:9.0f}  loaded {lw:9.0f}  ratio {lw / qw:.3f} "
          f"(drop {100 * (1 - lw / qw):+.1f}%)")
    print(f"tokens/s, paired per round    ratios {' '.join(f'{x:.3f}' for x in pairs)}  median {paired:.3f} "
          f"(drop {100 * (1 - paired):+.1f}%)")
    p50, p99 = statistics.median([r["p50_ms"] for r in reqs]), max(r["p99_ms"] for r in reqs)
    asked = args.rate * args.window * args.rounds
    print(f"requests: {sent} sent ({sent / (args.window * args.rounds):.0f}/s of {args.rate:.0f}/s asked; "
          f"{max(0, asked - sent):.0f} not sent in time), {failed} failed, p50 {p50:.1f} ms, "
          f"p99 {p99:.1f} ms (worst window)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "quiet_tps": q, "load_tps": lo, "ratio": lo / q,
                                               "wall_ratio": lw / qw, "paired_ratios": pairs,
                                               "paired_ratio": paired, "sent": sent, "failed": failed,
                                               "machine": cpu, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
