"""train.tf32: TensorFloat-32 for CUDA matmuls and convolutions (engine/precision.py set_tf32), set for the
run and put back when it releases; refused on a device other than CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lmforge.config.schema import Config
from lmforge.engine.precision import set_tf32
from lmforge.errors import ConfigError

TARGETS = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)


def precisions() -> list[str]:
    return [t.fp32_precision for t in TARGETS]


@pytest.mark.parametrize("enabled,want", [(True, "tf32"), (False, "ieee")])
def test_sets_the_cuda_flags_and_puts_them_back(enabled, want):
    # torch keeps these flags in a CPU-only build too, so the real setter runs here; a device of type
    # cuda is only named, never used.
    before = precisions()
    restore = set_tf32(enabled, torch.device("cuda"))
    try:
        assert precisions() == [want] * 3
    finally:
        restore()
    assert precisions() == before


def test_null_and_false_off_cuda_change_nothing():
    before = precisions()
    set_tf32(None, torch.device("cuda"))
    set_tf32(False, torch.device("cpu"))
    assert precisions() == before


def test_true_off_cuda_is_refused():
    with pytest.raises(ConfigError, match="train.tf32=true: TensorFloat-32 is a CUDA matmul mode"):
        set_tf32(True, torch.device("cpu"))
    assert Config.model_validate({"train": {"tf32": True}}).train.tf32 is True
    with pytest.raises(ValueError, match="tf32"):
        Config.model_validate({"train": {"tf32": "sometimes"}})


def test_the_cli_refuses_it_on_cpu_before_any_work(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lmforge", "train", "-c", "configs/debug/tiny.yaml",
                           "--set", f"run.dir={run}", "--set", "train.tf32=true"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "train.tf32=true" in proc.stderr and "Traceback" not in proc.stderr
    assert not run.exists()
