"""Every measurement that needs a GPU, as one prepared command: `bash bench/gpu_suite.sh` (which sets up a
bare GPU machine and then runs this).

A GPU is lent to lmforge's developers rarely and briefly (about 15 minutes, bare machine), so the suite
runs its rows in priority order under one wall-clock budget: a row starts only when its estimate fits in
what is left, runs in its own process under a deadline (a crash or a hang costs that row only), and
leaves its JSON beside the others. The rows are the existing benches, each with its competitor in the
same process where there is one; this file only orders, bounds and reports them.

    bash bench/gpu_suite.sh                          # CUDA: every row, 540 s, into bench/results/gpu_suite/
    bash bench/gpu_suite.sh --tiny --out /tmp/suite  # CPU, tiny shapes: checks the suite itself (a test)
    python bench/gpu_suite.py --only gpt2,lora --budget 300

Writes OUT/suite.json (every row: status, seconds, the bench's JSON) and OUT/suite.md (a table and each
row's printed summary), which the docs quote.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
DEFAULT_OUT = BENCH / "results" / "gpu_suite"


@dataclass
class Row:
    name: str
    what: str
    estimate_s: float  # on one H100/H200, compile included: a row starts only when this fits
    args: list[str]  # the bench and its arguments on CUDA; "{json}" is this row's result file
    tiny: list[str] | None  # the same on CPU at tiny shapes; None: the row needs CUDA
    needs: list[str] = field(default_factory=list)  # importable modules, else the row is skipped
    needs_nanogpt: bool = False
    check: Callable[[], str | None] | None = None  # a reason to skip the row, or None to run it


# What `python -m lmforge serve` imports beyond torch (the bare GPU image lacks some: see gpu_suite.sh).
SERVE_MODULES = ["fastapi", "starlette", "uvicorn", "anyio", "idna", "h11", "click", "pydantic",
                 "pydantic_core", "annotated_types", "typing_inspection", "annotated_doc", "opentelemetry"]


def _train_has_budget() -> str | None:
    """The planner row's check: `lmforge train --budget` is another piece of work; until it lands the
    row says so instead of failing."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get(
        "PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-m", "lmforge", "train", "--help"], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=120)
    return None if "--budget" in out.stdout else "lmforge train has no --budget"


def _sm89() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _throughput(row: str, est: float, what: str) -> Row:
    return Row(row, what, est,
               ["gpu_throughput.py", "--rows", row, "--rounds", "20", "--out", "{json}", "{nanogpt}"],
               ["gpu_throughput.py", "--rows", row, "--tiny", "--device", "cpu", "--no-compile",
                "--rounds", "3", "--warmup", "1", "--out", "{json}", "{nanogpt}"],
               needs=["transformers"], needs_nanogpt=row == "gpt2")


# Priority order: a row starts only when its estimate fits in what is left, so the rows that matter most
# come first. The estimates are one H100's, from the H200 run of 2026-11-27 (bench/results/gpu_suite/:
# each row's seconds) plus ~25% for the H100's slower memory and a margin; rows not yet measured are
# sized from their work. They add up to ~1,300 s, more than one 540 s call: the headline throughput rows
# (the regression check), then the rows never measured, then the rest; at 540 s (estimates as times) the
# first six and moe run, the rest are cut (bench/README.md: the calls that measure them).
ROWS: list[Row] = [
    _throughput("gpt2", 80, "train step, GPT-2 124M layout vs nanoGPT (bf16, compiled)"),
    _throughput("llama1b", 110, "train step, Llama 1.1B vs transformers (bf16, compiled)"),
    Row("resume", "bitwise resume: 40 steps straight vs 20 + --resume (loss curves must be identical)", 30,
        ["gpu_suite.py", "--resume-row", "{json}", "--device", "cuda"],
        ["gpu_suite.py", "--resume-row", "{json}", "--device", "cpu"]),
    Row("quant", "greedy decode tok/s, Llama 1.1B bf16 vs int8 vs int4 weight-only (lmforge QuantLinear), "
        "batch 1/8, vs transformers generate (bf16)", 75,
        ["gpu_quant_decode.py", "--preset", "gpu", "--device", "cuda", "--rounds", "2", "--json", "{json}"],
        ["gpu_quant_decode.py", "--preset", "tiny", "--device", "cpu", "--rounds", "1", "--json", "{json}"],
        needs=["transformers"]),
    Row("serve_load", "`lmforge serve` over HTTP at 1/8/32 concurrent requests, Llama 1.1B: output tok/s, "
        "p50/p95 latency vs transformers generate batched", 90,
        ["gpu_serve.py", "--preset", "gpu", "--device", "cuda", "--json", "{json}"],
        ["gpu_serve.py", "--preset", "tiny", "--device", "cpu", "--json", "{json}"],
        needs=["transformers", *SERVE_MODULES]),
    Row("serve", "serving engine decode tok/s, batch 1/16/64, Llama 1.1B bf16 vs transformers generate", 120,
        ["engine_decode.py", "--preset", "gpu", "--device", "cuda", "--rounds", "3", "--json", "{json}"],
        ["engine_decode.py", "--preset", "tiny", "--device", "cpu", "--rounds", "1", "--json", "{json}"],
        needs=["transformers"]),
    Row("e2e", "`lmforge train` loop vs its bare step, 124M Llama shape, bf16, compiled", 50,
        ["train_e2e.py", "-c", "configs/debug/tiny.yaml", "--blocks", "4", "--steps", "20",
         "--json", "{json}", "--set", "model.d_model=768", "--set", "model.n_layers=12",
         "--set", "model.n_heads=12", "--set", "model.n_kv_heads=12", "--set", "model.max_seq_len=1024",
         "--set", "data.tokenizer.vocab_size=4096", "--set", "data.dir=data/cache/gpu-suite-e2e",
         "--set", "train.micro_batch_size=16", "--set", "train.grad_accum_steps=1",
         "--set", "train.precision=bf16", "--set", "train.compile=true", "--set", "train.threads=null"],
        ["train_e2e.py", "-c", "configs/debug/tiny.yaml", "--blocks", "2", "--steps", "3", "--warmup", "1",
         "--json", "{json}", "--set", "train.device=cpu"]),
    _throughput("llama", 85, "train step, Llama 12L d768 vs transformers (bf16, compiled)"),
    Row("memory", "peak memory, GPT-2 124M at batch 32x1024, loss chunks 0/4096/8192 (eager)", 50,
        ["gpu_throughput.py", "--memory", "--no-compile", "--chunks", "0,4096,8192", "--out", "{json}"],
        ["gpu_throughput.py", "--memory", "--tiny", "--device", "cpu", "--no-compile", "--chunks", "0,64",
         "--memory-steps", "1", "--out", "{json}"]),
    Row("ac", "activation checkpointing none/full/selective and activation offload alone/with full "
        "(train.activation_offload): step time and peak memory", 80,
        ["activation_checkpointing.py", "--device", "cuda", "--rounds", "1",
         "--variants", "none,full,selective,offload,full_offload", "--out", "{json}"],
        ["activation_checkpointing.py", "--device", "cpu", "--rounds", "1", "--variants", "none,selective",
         "--d-model", "64", "--layers", "2", "--heads", "4", "--vocab", "256", "--seq", "64", "--batch", "2",
         "--steps", "1", "--out", "{json}"]),
    Row("moe", "MoE layer (8 experts, top-2, d4096) grouped vs transformers Mixtral block", 25,
        ["moe_layer.py", "--preset", "gpu", "--json", "{json}"],
        ["moe_layer.py", "--preset", "small", "--repeats", "2", "--warmup", "1", "--json", "{json}"],
        needs=["transformers"]),
    Row("packed", "packed-sequence attention: SDPA+mask vs flex vs varlen", 55,
        ["packed_attention.py", "--rounds", "20", "--json", "{json}"], None),
    Row("prefix", "prefix-LM / GLM attention through the model: dense mask vs flex BlockMask, fwd+bwd", 45,
        ["prefix_attention.py", "--rounds", "10", "--json", "{json}"],
        ["prefix_attention.py", "--preset", "tiny", "--device", "cpu", "--warmup", "1", "--rounds", "2",
         "--json", "{json}"]),
    Row("lora", "LoRA step, Llama 1.1B r16 all linears vs transformers + PEFT (bf16, compiled)", 140,
        ["lora_step.py", "--preset", "gpu", "--compile", "--repeats", "10", "--json", "{json}"],
        ["lora_step.py", "--preset", "demo", "--repeats", "2", "--warmup", "1", "--device", "cpu",
         "--json", "{json}"], needs=["transformers", "peft"]),
    Row("qlora", "QLoRA step, Llama 1.1B NF4 vs bitsandbytes + PEFT", 45,
        ["qlora_step.py", "--json", "{json}"], None, needs=["bitsandbytes", "peft"]),
    Row("tf32", "fp32 training step (no autocast), ~0.9B Llama shape at 4x1024: TF32 matmuls on vs off "
        "(train.tf32), interleaved, and the first loss both ways", 45,
        ["tf32_step.py", "--json", "{json}"], None),
    Row("opt_offload", "train.optimizer_offload=cpu vs on the device, ~0.9B Llama shape bf16: device memory "
        "held between steps and step time", 60,
        ["optimizer_offload.py", "--json", "{json}"], None),
    Row("fp8", "FP8 (torchao float8 tensorwise/rowwise) vs bf16, compiled: loss over 200 steps at d1024 L8 "
        "and tokens/s at Llama 1.1B (train.fp8)", 150,
        ["fp8_train.py", "--json", "{json}"], None, needs=["torchao"],
        check=lambda: None if _sm89() else "needs compute capability >= 8.9"),
    # Last: five minutes by definition, more than half of one call. It needs a call of its own (--only).
    Row("planner", "`lmforge train --budget 5m` on builtin:python: final val bpb, the planned shape, whole "
        "wall time vs the budget", 330,
        ["gpu_suite.py", "--planner-row", "{json}", "--planner-budget", "5m"],
        ["gpu_suite.py", "--planner-row", "{json}", "--planner-budget", "90s"],
        check=_train_has_budget),
]


def _missing(mods: list[str]) -> list[str]:
    import importlib.util

    return [m for m in mods if importlib.util.find_spec(m) is None]


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])


def run_row(row: Row, *, tiny: bool, out: Path, nanogpt: str | None, deadline_s: float, env: dict) -> dict:
    args = row.tiny if tiny else row.args
    if args is None:
        return dict(status="skipped", why="needs CUDA")
    missing = _missing(row.needs)
    if missing:
        return dict(status="skipped", why=f"{', '.join(missing)} not installed")
    if row.needs_nanogpt and not nanogpt:
        return dict(status="skipped", why="no nanoGPT checkout (--nanogpt PATH or $LMFORGE_NANOGPT)")
    why = row.check() if row.check else None
    if why:
        return dict(status="skipped", why=why)
    jpath = out / f"{row.name}.json"
    jpath.unlink(missing_ok=True)
    argv = []
    for a in args:
        if a == "{nanogpt}":
            argv += ["--nanogpt", nanogpt] if nanogpt else []
        else:
            argv.append(a.replace("{json}", str(jpath)))
    cmd = [sys.executable, str(BENCH / argv[0]), *argv[1:]]
    log = out / f"{row.name}.log"
    t0 = time.monotonic()
    with open(log, "w") as fh:
        # Own process group: at the deadline the bench and every worker it started go together.
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=deadline_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, status = None, "timeout"
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    result = None
    if jpath.is_file():
        try:
            result = json.loads(jpath.read_text())
        except ValueError:
            status = "failed" if status == "ok" else status
    elif status == "ok":
        status = "failed"  # a bench that exits 0 without its result did not measure
    return dict(status=status, rc=rc, seconds=round(seconds, 1), command=" ".join(["python", *cmd[1:]]),
                summary=_tail(text), result=result)


def resume_row(path: Path, device: str) -> int:
    """40 steps straight, then the same run stopped after its step-20 checkpoint and resumed: the two
    loss curves must be identical (bit for bit, as the JSON's floats print them)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = [sys.executable, "-m", "lmforge", "train", "-c", str(REPO / "configs/debug/tiny.yaml"),
                "--set", f"train.device={device}", "--set", f"data.dir={tmp}/data",
                "--set", "train.max_steps=40", "--set", "checkpoint.every=10",
                "--set", "checkpoint.keep_last=5", "--set", "train.eval_every=0"]
        if device == "cuda":
            base += ["--set", "train.precision=bf16"]
        straight, resumed = Path(tmp, "a"), Path(tmp, "b")
        t0 = time.monotonic()
        subprocess.run([*base, "--set", f"run.dir={straight}"], check=True, cwd=REPO)
        shutil.copytree(straight, resumed)
        for ckpt in sorted((resumed / "checkpoints").iterdir()):
            if int(ckpt.name.split("_")[-1]) > 20:
                shutil.rmtree(ckpt)
        subprocess.run([*base, "--set", f"run.dir={resumed}", "--resume"], check=True, cwd=REPO)

        def losses(run: Path) -> list[tuple[int, float]]:
            rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
            return [(r["step"], r["loss"]) for r in rows if "loss" in r and "step" in r]

        a, b = losses(straight), losses(resumed)
        same = a == b and len(a) >= 40
        out = dict(device=device, steps=len(a), identical=same, seconds=round(time.monotonic() - t0, 1),
                   first_difference=next(([x, y] for x, y in zip(a, b) if x != y), None))
    print(f"resume on {device}: {len(a)} logged steps, curves {'identical' if same else 'DIFFER'}")
    path.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if same else 1


def planner_row(path: Path, budget: str) -> int:
    """`lmforge train --budget BUDGET` on builtin:python, as a user runs it (the planner picks the device),
    its data prepared from nothing in a fresh dir: the final validation bits per byte, what the plan
    chose, and the whole process's wall time against the budget (the issue's bound: budget + 5%)."""
    from lmforge.config.train import parse_duration

    budget_s = parse_duration(budget)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp, "run")
        cmd = [sys.executable, "-m", "lmforge", "train", "--budget", budget,
               "--set", 'data.sources=["builtin:python"]', "--set", f"run.dir={run}",
               "--set", f"data.dir={tmp}/data"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
        wall = time.monotonic() - t0
        sys.stderr.write(proc.stderr)
        rc = proc.returncode
        plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").is_file() else None
        metrics = run / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        rows = [json.loads(ln) for ln in lines if ln.strip()]
    evals = [r for r in rows if "val_bpb" in r]
    chosen = {c["key"]: c["value"] for c in plan["choices"]} if plan else {}
    # A refusal (exit 2) is one line `lmforge train: error: ...`, e.g. a budget too small for this machine.
    error = next((ln for ln in reversed(proc.stderr.splitlines()) if ": error: " in ln), None) if rc else None
    out = dict(command=" ".join(["lmforge", *cmd[3:]]), rc=rc, error=error, budget_s=budget_s,
               wall_s=round(wall, 1),
               wall_over_budget=round(wall / budget_s, 3), within_budget=wall <= 1.05 * budget_s,
               val_bpb=evals[-1]["val_bpb"] if evals else None, step=evals[-1].get("step") if evals else None,
               chosen=chosen, plan=plan)
    shape = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in chosen.items()
                      if k.startswith(("model.", "data.tokenizer.vocab_size", "train.micro_batch_size",
                                       "train.precision", "optim.lr")))
    print(f"planner {budget}: val bpb {out['val_bpb']}, wall {wall:.1f} s of {budget_s:.0f} s "
          f"({out['wall_over_budget']:.3f}x{'' if out['within_budget'] else ', OVER budget + 5%'}); {shape}")
    path.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if rc == 0 and evals and out["within_budget"] else 1


def merge(old: dict, new: dict) -> dict:
    """`new`'s rows over `old`'s: rows that did not run this time keep their earlier result (each row says
    when and on which device it ran)."""
    rows = dict(old.get("rows", {}))
    rows.update(new["rows"])
    return dict(new, rows={**{n: rows[n] for n in old.get("rows", {})}, **rows},
                seconds=round(sum(r.get("seconds") or 0 for r in rows.values()), 1))


def markdown(report: dict) -> str:
    lines = [f"# GPU suite: {report['device']}", "",
             f"torch {report['torch']}, {report['when']}, budget {report['budget_s']} s, "
             f"took {report['seconds']} s{' (tiny shapes, CPU)' if report['tiny'] else ''}.", "",
             "| row | what | status | seconds | ran |", "|---|---|---|---|---|"]
    for name, r in report["rows"].items():
        lines.append(f"| {name} | {r['what']} | {r['status']}{': ' + r['why'] if r.get('why') else ''} | "
                     f"{r.get('seconds', '')} | {r.get('when', '')} |")
    for name, r in report["rows"].items():
        if r.get("summary"):
            lines += ["", f"## {name}", "", f"`{r['command']}`", "", "```", r["summary"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (checks the suite; the default "
                    "without CUDA)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all rows together")
    ap.add_argument("--only", default=None,
                    help="comma-separated subset of: " + ",".join(r.name for r in ROWS))
    ap.add_argument("--nanogpt", default=None, help="a nanoGPT checkout (default: $LMFORGE_NANOGPT)")
    ap.add_argument("--update", action="store_true", help="keep the rows of OUT/suite.json that this call "
                    "does not run (a rerun of failed or skipped rows)")
    ap.add_argument("--resume-row", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--planner-row", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--planner-budget", default="5m", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.resume_row:
        return resume_row(args.resume_row, args.device)
    if args.planner_row:
        return planner_row(args.planner_row, args.planner_budget)

    import torch

    tiny = args.tiny or not torch.cuda.is_available()
    rows = ROWS
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {r.name for r in ROWS})
        if unknown:
            ap.error(f"unknown rows {unknown}; valid: {', '.join(r.name for r in ROWS)}")
        rows = [r for r in ROWS if r.name in names]
    nanogpt = args.nanogpt or os.environ.get("LMFORGE_NANOGPT")
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    t_start = time.monotonic()
    old = {}
    if args.update and (args.out / "suite.json").is_file():
        old = json.loads((args.out / "suite.json").read_text())
    report = dict(device=torch.cuda.get_device_name(0) if not tiny else "cpu", torch=torch.__version__,
                  when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), tiny=tiny, budget_s=args.budget,
                  rows={})
    for row in rows:
        left = args.budget - (time.monotonic() - t_start)
        est = 30.0 if tiny else row.estimate_s
        if left < est:
            r = dict(status="skipped", why=f"budget: {left:.0f} s left, the row needs ~{est:.0f} s")
        else:
            print(f"[gpu_suite] {row.name}: {row.what} ({left:.0f} s left)", flush=True)
            r = run_row(row, tiny=tiny, out=args.out, nanogpt=nanogpt, deadline_s=left, env=env)
            print(f"[gpu_suite] {row.name}: {r['status']} in {r.get('seconds', 0)} s "
                  f"{r.get('why', '')}\n{r.get('summary', '')}", flush=True)
        report["rows"][row.name] = dict(what=row.what, when=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                                        device=report["device"], **r)
        report["seconds"] = round(time.monotonic() - t_start, 1)
        whole = merge(old, report) if old else report
        (args.out / "suite.json").write_text(json.dumps(whole, indent=2) + "\n")  # after every row
        (args.out / "suite.md").write_text(markdown(whole))
    bad = [n for n, r in report["rows"].items() if r["status"] in ("failed", "timeout")]
    print(f"[gpu_suite] done in {report['seconds']} s; {args.out}/suite.md"
          + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
