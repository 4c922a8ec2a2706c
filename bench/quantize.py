"""Weight-only quantization (`lmforge quantize`) of the demo model: size, quality and CPU speed against
the bf16 model, and QuantLinear's matmul alone at a realistic shape.

    .venv/bin/python bench/quantize.py                     # runs/demo; ~10-20 minutes on 2 shared cores
    .venv/bin/python bench/quantize.py --skip-tasks        # without the builtin:code task suite
    .venv/bin/python bench/quantize.py --only-matmul       # the 4096 x 4096 matmul table only

Variants (written under --work, default /tmp/lmforge-bench-quant): bf16 (the source with every weight
rounded to bfloat16: the baseline the issue asks for; it computes in fp32 like every CPU run here),
int8 RTN per-channel, int4 RTN group 64 and 32 (the demo's d_ff 704 is not a multiple of 128, so
group 128 cannot apply to its w_down), int4 GPTQ group 64 (128 calibration windows of 256 tokens from
the run's validation split). Each is a run dir from `quantize_run` (bf16: keep_dtype bfloat16 and no
layer quantized is not a mode, so it is the source loaded and saved in bf16 by this script).

Reported per variant: checkpoint data on disk (MiB, measured on the files) and the ratio to bf16;
validation loss / perplexity (`lmforge.eval.open_run.evaluate`, eval.max_batches 20 of 8 x 256 tokens);
builtin:code task metrics (`lmforge eval tasks RUN... --tasks builtin:code --limit 100`, delta to bf16); CPU
generation tokens/s (greedy decode of 64 tokens from a 16-token prompt, batch 1, KV cache,
`lmforge.eval.generate.generate`), variants interleaved round by round, medians, ratio to bf16.
Matmul table: y = x W^T for W 4096 x 4096 at 1, 4, 16 and 256 rows: F.linear fp32 and bf16 against
QuantLinear's int kernels (kernel="int") and its dequantize + F.linear path (kernel="reference"),
interleaved, medians. Never asserts; writes bench/results/quantize.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmforge.checkpoint.manager import CheckpointManager  # noqa: E402
from lmforge.cli import main as cli  # noqa: E402
from lmforge.compress.quantize import quantize_run  # noqa: E402
from lmforge.eval.generate import generate  # noqa: E402
from lmforge.eval.open_run import evaluate, load_run  # noqa: E402
from lmforge.models.quant import QuantLinear  # noqa: E402
from machine import machine_info, print_markdown_table  # noqa: E402

VARIANTS = {
    "int8 rtn": dict(bits=8, group_size=None, method="rtn"),
    "int4 rtn g64": dict(bits=4, group_size=64, method="rtn"),
    "int4 rtn g32": dict(bits=4, group_size=32, method="rtn"),
    "int4 gptq g64": dict(bits=4, group_size=64, method="gptq"),
}


def _bf16_copy(src: str, out: Path) -> None:
    """The source's weights rounded to bf16 in a run dir (its config, data dir unchanged)."""
    import shutil

    from lmforge.config.load import save_config

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    run = load_run(src)
    cfg = run.cfg.model_copy(update={"run": run.cfg.run.model_copy(update={"dir": str(out)})})
    save_config(cfg, out / "config.yaml")
    CheckpointManager(out, keep_last=1).save(run.step, run.model.to(torch.bfloat16), None, {})


def _disk(run_dir: Path) -> int:
    return sum(f.stat().st_size for f in run_dir.glob("checkpoints/step_*/state/*") if f.is_file())


def _median_times(fns: dict, repeats: int, warmup: int = 1) -> dict[str, float]:
    for f in fns.values():
        for _ in range(warmup):
            f()
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_table(repeats: int) -> list[dict]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 4096, bias=False)
    w32 = lin.weight.detach()
    w16 = w32.bfloat16()
    q8 = QuantLinear.from_linear(lin, 8, None, True)
    q4 = QuantLinear.from_linear(lin, 4, 128, True)
    rows = []
    with torch.no_grad():
        for m in (1, 4, 16, 256):
            x = torch.randn(m, 4096)
            xb = x.bfloat16()

            def run(layer, kernel, x=x):
                def f():
                    layer.kernel = kernel
                    layer(x)
                return f

            fns = {"fp32": lambda x=x: F.linear(x, w32), "bf16": lambda xb=xb: F.linear(xb, w16),
                   "int8 kernel": run(q8, "int"), "int8 dequant": run(q8, "reference"),
                   "int4 kernel": run(q4, "int"), "int4 dequant": run(q4, "reference")}
            t = _median_times(fns, repeats if m < 256 else max(3, repeats // 3))
            rows.append({"rows": m, **{k: v * 1e3 for k, v in t.items()}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default="runs/demo")
    ap.add_argument("--work", default="/tmp/lmforge-bench-quant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tasks-limit", type=int, default=100)
    ap.add_argument("--skip-tasks", action="store_true")
    ap.add_argument("--only-matmul", action="store_true")
    ap.add_argument("--json", default="bench/results/quantize.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info(threads=args.threads, src=args.src)
    print(json.dumps(info))
    out: dict = {"machine": info}
    if not args.only_matmul:
        work = Path(args.work)
        dirs = {"bf16": work / "bf16"}
        _bf16_copy(args.src, dirs["bf16"])
        reports = {}
        for name, kw in VARIANTS.items():
            dirs[name] = work / name.replace(" ", "-")
            reports[name] = quantize_run(args.src, dirs[name], overwrite=True, **kw)
        quality = {name: evaluate(d, ["eval.max_batches=20"], say=lambda *_: None)
                   for name, d in dirs.items()}
        tasks = {}
        if not args.skip_tasks:
            cli(["eval", *map(str, dirs.values()), "--tasks", "builtin:code", "--limit",
                 str(args.tasks_limit)])
            for name, d in dirs.items():
                res = json.loads(sorted(d.glob("eval_harness_step_*.json"))[-1].read_text())
                tasks[name] = {t: next(iter(v["metrics"].values())) for t, v in res["tasks"].items()}
        runs = {name: load_run(d) for name, d in dirs.items()}
        prompt = runs["bf16"].tokenizer.encode("def parse_args(argv):\n    parser = argparse.")[:16]
        gen = {name: (lambda r=r: generate(r.model, prompt, 64, temperature=0.0, device=r.device))
               for name, r in runs.items()}
        speed = _median_times(gen, args.repeats)
        rows = []
        base = _disk(dirs["bf16"])
        for name, d in dirs.items():
            size = _disk(d)
            q = quality[name]
            row = [name, f"{size / 2**20:.2f}", f"{base / size:.2f}x", f"{q['loss']:.4f}", f"{q['ppl']:.2f}",
                   f"{q['ppl'] - quality['bf16']['ppl']:+.2f}", f"{64 / speed[name]:.1f}",
                   f"{speed['bf16'] / speed[name]:.2f}"]
            if tasks:
                row.append(" ".join(f"{t.removeprefix('code_')} {v:.3f} ({v - tasks['bf16'][t]:+.3f})"
                                    for t, v in tasks[name].items()))
            rows.append(row)
        headers = ["variant", "MiB on disk", "vs bf16", "val loss", "val ppl", "ppl delta", "gen tok/s",
                   "speed vs bf16"] + (["builtin:code (delta to bf16)"] if tasks else [])
        print_markdown_table(headers, rows)
        out.update({"sizes": {n: _disk(d) for n, d in dirs.items()}, "quality": quality, "tasks": tasks,
                    "gen_seconds_per_64_tokens": speed,
                    "logits": {n: r.get("logits") for n, r in reports.items()}})
    mm = matmul_table(args.repeats)
    kinds = [k for k in mm[0] if k != "rows"]
    print_markdown_table(["rows", *[f"{k} ms" for k in kinds]],
                         [[str(r["rows"]), *[f"{r[k]:.2f}" for k in kinds]] for r in mm])
    out["matmul_4096"] = mm
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
