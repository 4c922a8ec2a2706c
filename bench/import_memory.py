"""Peak memory of opening a real-size checkpoint: `lmforge import` against transformers'
`AutoModelForCausalLM.from_pretrained`, on the same synthetic sharded checkpoint.

The checkpoint is a Llama of ~1.1B parameters (d2048, 16 layers, ff 5632, vocab 32000, untied), random
weights saved by transformers as sharded safetensors (1 GB shards) in the dtype asked for. Each side runs
in a fresh process; its peak resident set (ru_maxrss of the child: anonymous memory and the touched pages
of the memory-mapped shards) is reported beside the same process's peak after importing its libraries
alone, so the difference is what opening the model cost. transformers memory-maps the shards and reads a
weight only when it is used, so its side is measured after loading and after touching every weight once.
lmforge's import reads every weight into its model (in the checkpoint's dtype) and writes its step-0
checkpoint (the weights once more, streamed to disk).

    python bench/import_memory.py                       # fp32 and bf16 checkpoints, ~2 minutes on 2 cores
    python bench/import_memory.py --dtypes bf16 --keep /tmp/ckpt

Writes bench/results/import_memory.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import machine_info  # bench/machine.py (on sys.path)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "import_memory.json"
SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
             intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
             tie_word_embeddings=False)

MAKE = """
import sys, torch, transformers
cfg = transformers.LlamaConfig(**{shape})
torch.manual_seed(0)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(cfg)
model = model.to_empty(device="cpu").to({dtype})
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.02)
model.save_pretrained(sys.argv[1], max_shard_size="1GB")
"""
LMFORGE = "import lmforge.cli, lmforge.checkpoint.hf_io, lmforge.models.transformer, torch"
HF = "import torch, transformers; from transformers import AutoModelForCausalLM"
LOAD_HF = HF + "; AutoModelForCausalLM.from_pretrained(sys.argv[1])"
# transformers memory-maps the shards and reads a weight's pages only when it is used: touching every
# weight once (a sum) is what a forward pass would make resident.
TOUCH_HF = HF + ("; m = AutoModelForCausalLM.from_pretrained(sys.argv[1])"
                 "; [p.sum() for p in m.parameters()]")


def peak_mib(code: str, *args: str) -> float:
    """Peak RSS (MiB) of a fresh `python -c code args`, measured by a wrapper running it as its only child."""
    wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-c", "import sys; " + code, *args],
                         check=True, capture_output=True, text=True, cwd=REPO).stdout
    return int(out.split()[-1]) / 1024  # ru_maxrss is KiB on Linux


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,bf16", help="checkpoint dtypes to measure")
    ap.add_argument("--keep", type=Path, default=None, help="make/keep the checkpoints under this dir")
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-import-mem-"))
    base = args.keep or tmp
    rows = []
    try:
        for name in args.dtypes.split(","):
            dtype = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[name]
            ckpt = base / f"llama1b-{name}"
            if not (ckpt / "config.json").is_file():
                subprocess.run([sys.executable, "-c", MAKE.format(shape=SHAPE, dtype=dtype), str(ckpt)],
                               check=True)
            size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20
            out = tmp / f"imported-{name}"
            shutil.rmtree(out, ignore_errors=True)
            row = dict(
                dtype=name, checkpoint_mib=round(size), shards=len(list(ckpt.glob("*.safetensors"))),
                lmforge_libraries_mib=round(peak_mib(LMFORGE)),
                lmforge_import_mib=round(peak_mib(
                    "from lmforge.cli import main; sys.exit(main(['import', sys.argv[1], sys.argv[2]]))",
                    str(ckpt), str(out))),
                transformers_libraries_mib=round(peak_mib(HF)),
                transformers_load_mib=round(peak_mib(LOAD_HF, str(ckpt))),
                transformers_touched_mib=round(peak_mib(TOUCH_HF, str(ckpt))),
            )
            row["lmforge_model_mib"] = row["lmforge_import_mib"] - row["lmforge_libraries_mib"]
            row["transformers_model_mib"] = (row["transformers_touched_mib"]
                                             - row["transformers_libraries_mib"])
            rows.append(row)
            print(f"{name}: checkpoint {size:,.0f} MiB in {row['shards']} shards; peak RSS lmforge import "
                  f"{row['lmforge_import_mib']:,} MiB ({row['lmforge_model_mib']:,} over its libraries), "
                  f"transformers from_pretrained {row['transformers_load_mib']:,} MiB, every weight used "
                  f"{row['transformers_touched_mib']:,} MiB ({row['transformers_model_mib']:,} over its "
                  "libraries)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(machine=machine_info(), shape=SHAPE, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
