"""A run dir or checkpoint from someone else is as safe to open as a safetensors file: pickles planted
in DCP's metadata or in a checkpoint's non-tensor values are refused, and their code never runs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "debug" / "tiny.yaml"
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"


class Planted:
    """Unpickling this runs a shell command: what an attacker would put in a shared checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def lmforge(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})


def base(run: Path, data: Path) -> list[str]:
    return ["-c", str(TINY), "--set", f"run.dir={run}", "--set", f"data.dir={data}", "--set",
            f"data.sources=[{CORPUS}]", "--set", "data.max_chars=null", "--set", "logging.progress=none",
            "--set", "logging.plot=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_data_dir) -> Path:
    run = tmp_path_factory.mktemp("pickles") / "run"
    out = lmforge(
        "train", *base(run, shared_data_dir), "--set", "train.max_steps=2", "--set", "checkpoint.every=0"
    )
    assert out.returncode == 0, out.stderr
    return run


@pytest.mark.parametrize("verb", ["eval", "generate", "export", "resume", "init_from"])
def test_planted_metadata_pickle_never_runs(run_dir, tmp_path, shared_data_dir, verb):
    import shutil

    run = tmp_path / "shared_run"
    shutil.copytree(run_dir, run)
    marker = tmp_path / "PWNED"
    ckpt = run / "checkpoints" / "step_00000002"
    (ckpt / "state" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    args = {
        "eval": ["eval", str(run)],
        "generate": ["generate", str(run), "--prompt", "x"],
        "export": ["export", str(run), str(tmp_path / "hf")],
        "resume": ["train", *base(run, shared_data_dir), "--set", "train.max_steps=4", "--resume"],
        "init_from": ["train", *base(tmp_path / "new", tmp_path / "data"), "--set", f"model.init_from={run}",
                      "--set", "train.max_steps=1"],
    }[verb]
    out = lmforge(*args)
    assert not marker.exists(), "the planted pickle ran"
    assert "posix.system is not part of checkpoint metadata" in out.stderr + out.stdout
    assert "Traceback" not in out.stderr
    if verb != "resume":
        assert out.returncode == 2, out.stderr


def test_planted_value_pickle_never_runs(tmp_path, tiny_cfg):
    """A non-tensor value of the optimizer state (a hyperparameter) replaced by a pickle."""
    from lmforge.checkpoint.manager import CheckpointManager
    from lmforge.config import ModelConfig
    from lmforge.config.optim import optim_config
    from lmforge.errors import CheckpointError
    from lmforge.models import build_model
    from lmforge.optim.builder import build_optimizer

    model = build_model(ModelConfig(preset="debug", vocab_size=64, max_seq_len=16))
    opt = build_optimizer(model, optim_config())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    mgr = CheckpointManager(tmp_path, keep_last=1)
    path = mgr.save(1, model, opt, {})
    model_sd, optim_sd = get_state_dict(
        model, [opt], options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    key = next(k for k in optim_sd if k.startswith("param_groups.") and k.endswith(".lr"))
    marker = tmp_path / "PWNED"
    optim_sd[key] = Planted(marker)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "state"))
    with pytest.raises(CheckpointError, match=f"checkpoint value optim.{key} was refused"):
        mgr.load(path, model, opt, {})
    assert not marker.exists()
