"""The golden loss curve of configs/debug/tiny.yaml: a refactor that is not meant to change the maths
must reproduce it.

Bit-exactness holds only on the kind of machine that recorded a curve (torch picks different fp32
kernels per CPU: two AVX-512 CPUs of different vendors already differ in the last bits), so each
recording names its machine: torch and tokenizers versions, the CPU capability, model name and a hash
of its feature flags. On a machine of a recorded kind the curve must match bit for bit; on any other
machine with the same torch and tokenizers it must match within tolerances measured across CPUs (an
AVX-512 Xeon against an AVX2 EPYC: loss and val loss within 9e-8 relative, grad norm within 1e-5),
which a real change of the maths still breaks (`test_the_tolerance_catches_a_small_maths_change`).

A change that is meant to alter the maths (or a new kind of machine worth pinning exactly) records with:
    python tests/integration/test_golden.py --record
"""

from __future__ import annotations

import hashlib
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
# Relative tolerances across CPU kinds: ~100x the largest difference measured between two recordings.
TOLERANCE = {"loss": 1e-5, "val_loss": 1e-5, "grad_norm": 1e-3, "lr": 0.0}


def cpu_info() -> tuple[str, str]:
    """(model name, short hash of the feature flags) from /proc/cpuinfo ('unknown' elsewhere)."""
    model, flags = "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return model, hashlib.sha256(flags.encode()).hexdigest()[:12]


def environment() -> dict[str, str]:
    model, flags = cpu_info()
    return {"torch": torch.__version__, "tokenizers": tokenizers.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_model": model, "cpu_flags": flags}


def run_curve(cfg) -> dict[str, list[float]]:
    train(cfg)
    records = read_metrics(Path(cfg.run.dir) / "metrics.jsonl")
    return {f: [r[f] for r in records if f in r] for f in FIELDS}


def recordings() -> list[dict]:
    return json.loads(GOLDEN.read_text())["recordings"]


def reference() -> tuple[dict, bool]:
    """The recording to compare with here, and whether the comparison is bit-exact."""
    env, recs = environment(), recordings()
    exact = [r for r in recs if r["environment"] == env]
    if exact:
        return exact[0], True
    same_software = [r for r in recs if (r["environment"]["torch"], r["environment"]["tokenizers"])
                     == (env["torch"], env["tokenizers"])]
    if not same_software:
        pytest.skip(f"no golden curve recorded with torch {env['torch']} and tokenizers {env['tokenizers']}; "
                    "record one: python tests/integration/test_golden.py --record")
    capability = env["cpu_capability"]
    same_capability = [r for r in same_software if r["environment"]["cpu_capability"] == capability]
    return (same_capability or same_software)[0], False


def mismatches(curve: dict[str, list[float]], expected: dict[str, list[float]], exact: bool) -> list[str]:
    out = []
    for f in FIELDS:
        if len(curve[f]) != len(expected[f]):
            out.append(f"{f}: {len(curve[f])} values, golden has {len(expected[f])}")
            continue
        for i, (a, b) in enumerate(zip(curve[f], expected[f])):
            if (a != b) if exact else abs(a - b) > TOLERANCE[f] * abs(b):
                out.append(f"{f}[{i}] = {a!r}, golden {b!r}")
                break
    return out


def test_golden_curve(tiny_cfg):
    ref, exact = reference()
    curve = run_curve(tiny_cfg())
    bad = mismatches(curve, ref["curve"], exact)
    how = "bit-exact, the recording machine's kind" if exact else f"within {TOLERANCE} relative"
    assert not bad, f"the curve differs from the golden one ({how}; recorded on {ref['environment']}): {bad}"


@pytest.mark.slow
def test_the_tolerance_catches_a_small_maths_change(tiny_cfg):
    """A 1% larger learning rate is caught by the cross-machine comparison, let alone a real bug."""
    ref, _ = reference()
    curve = run_curve(tiny_cfg("optim.lr=3.03e-3"))
    bad = mismatches(curve, ref["curve"], exact=False)
    assert any(b.startswith("loss") for b in bad), bad


def record() -> None:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import TINY, tiny_overrides
    from lmforge.config import load_config

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(TINY, tiny_overrides(Path(d) / "run", Path(d) / "data"))
        curve = run_curve(cfg)
    env = environment()
    recs = [r for r in (recordings() if GOLDEN.exists() else []) if r["environment"] != env]
    recs.append({"environment": env, "curve": curve})
    GOLDEN.write_text(json.dumps({"recordings": recs}, indent=1) + "\n")
    print(f"recorded {env}: final loss {curve['loss'][-1]}")


if __name__ == "__main__":
    if "--record" in sys.argv:
        record()
    else:
        print(__doc__)
