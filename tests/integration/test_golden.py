"""The golden loss curve of configs/debug/tiny.yaml: a refactor that is not meant to change the maths
must reproduce it bit for bit.

Bit-exactness holds for one software/hardware combination (torch picks different fp32 kernels on
AVX2 and AVX512 CPUs), so curves are recorded per environment key. A change that is meant to alter
the maths re-records with:  python tests/integration/test_golden.py --record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import tokenizers
import torch

from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import train

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "debug_tiny.json"
FIELDS = ("loss", "grad_norm", "lr", "val_loss")


def env_key() -> str:
    return (f"torch-{torch.__version__}|tokenizers-{tokenizers.__version__}|"
            f"cpu-{torch.backends.cpu.get_cpu_capability()}")


def run_curve(cfg) -> dict[str, list[float]]:
    train(cfg)
    records = read_metrics(Path(cfg.run.dir) / "metrics.jsonl")
    return {f: [r[f] for r in records if f in r] for f in FIELDS}


def test_golden_curve(tiny_cfg):
    golden = json.loads(GOLDEN.read_text())
    key = env_key()
    if key not in golden["curves"]:
        pytest.fail(f"no golden curve recorded for {key}; known: {sorted(golden['curves'])}. If this "
                    "environment is new, record it: python tests/integration/test_golden.py --record")
    curve = run_curve(tiny_cfg())
    expected = golden["curves"][key]
    for f in FIELDS:
        assert len(curve[f]) == len(expected[f]), f
        assert curve[f] == expected[f], f"{f} differs from the golden curve (bit-exact comparison)"


def record() -> None:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import TINY, tiny_overrides
    from lmforge.config import load_config

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(TINY, tiny_overrides(Path(d) / "run", Path(d) / "data"))
        curve = run_curve(cfg)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"curves": {}}
    golden["curves"][env_key()] = curve
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"recorded {env_key()}: final loss {curve['loss'][-1]}")


if __name__ == "__main__":
    if "--record" in sys.argv:
        record()
    else:
        print(__doc__)
