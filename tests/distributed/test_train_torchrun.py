"""`torchrun ... -m lmforge train` end to end: every layout trains the same curve as one process on
the same global batch, a checkpoint saved by 2 ranks resumes on 1 and on 4, two torchrun "nodes" on
localhost train together through c10d rendezvous, and a rank killed under --max-restarts=1 makes
torchrun restart the job, which resumes from its last checkpoint and finishes on the same curve."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_harness import SRC, free_port

from conftest import TINY, tiny_overrides
from lmforge.metrics.loggers import read_metrics

STEPS = 20
COMPARED = ("loss", "grad_norm", "lr", "val_loss", "val_bpb", "val_loss_ema", "tokens_seen")
# Measured: every logged value within 1e-6 of the single-process run (fp32; only the order of
# floating-point sums differs). The tolerance leaves headroom over that.
TOL = 1e-5


def overrides(run_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    base = tiny_overrides(run_dir, data_dir, f"train.max_steps={STEPS}", "checkpoint.every=10",
                          "train.eval_every=10", "averaging.ema=true", "averaging.ema_decay=0.9", *extra)
    return [a for o in base for a in ("--set", o)]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    e["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return e


def torchrun_cmd(nproc: int, run_dir: Path, data_dir: Path, *extra: str, launcher: tuple[str, ...] = ()):
    launch = launcher or ("--nproc-per-node", str(nproc), "--master-port", str(free_port()))
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "lmforge", "train", "-c", str(TINY),
            *overrides(run_dir, data_dir, *extra)]


def run(cmd: list[str], timeout: float = 300) -> None:
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def curve(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if "event" not in r:
            out.setdefault(r["step"], {}).update({k: r[k] for k in COMPARED if k in r})
    return out


def assert_same_curve(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for k, v in a[step].items():
            assert abs(v - b[step][k]) <= TOL * max(1.0, abs(v)), (step, k, v, b[step][k])


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, shared_data_dir) -> Path:
    """One process, micro-batch 8 x 2 accumulation: the global batch every layout must reproduce."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    run([sys.executable, "-m", "lmforge", "train", "-c", str(TINY), *overrides(run_dir, shared_data_dir)])
    return run_dir


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[int, dict]:
    return curve(reference_run)


def exported(run_dir: Path, out: Path) -> dict:
    """The run's final checkpoint, consolidated by `lmforge export` in one process."""
    from safetensors.torch import load_file

    from lmforge.checkpoint.hf_io import export_hf

    export_hf(run_dir, out, say=lambda *_: None)
    return load_file(out / "model.safetensors")


LAYOUTS = {
    "ddp": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch_size=4"]),
    "fsdp": (2, ["parallel.dp_shard=2", "train.micro_batch_size=4"]),
    "zero2": (2, ["parallel.dp_shard=2", "parallel.zero=2", "train.micro_batch_size=4"]),
    "zero1": (2, ["parallel.dp_shard=2", "parallel.zero=1", "train.micro_batch_size=4"]),
    "tp_sp": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    "pp_1f1b": (2, ["parallel.pp=2", "parallel.dp_shard=1"]),
    "fsdp_x_tp": (4, ["parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch_size=4"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_the_single_process_curve(layout, reference, reference_run, tmp_path, shared_data_dir):
    nproc, extra = LAYOUTS[layout]
    run(torchrun_cmd(nproc, tmp_path / "run", shared_data_dir, *extra))
    assert_same_curve(reference, curve(tmp_path / "run"))
    # The sharded checkpoint consolidates (one process, any layout) to the single-process weights.
    ours, ref = exported(tmp_path / "run", tmp_path / "hf"), exported(reference_run, tmp_path / "hf_ref")
    assert ours.keys() == ref.keys()
    for k, v in ref.items():
        assert (ours[k] - v).abs().max().item() <= 1e-6, k  # measured <= 1.2e-7 (AdamW, 20 steps)
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["step_00000010", "step_00000020"]
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000020" / "meta.json").read_text())
    assert meta["world_size"] == nproc


@pytest.mark.slow
def test_saved_on_two_ranks_resumes_on_one_and_on_four(reference, tmp_path, shared_data_dir):
    saved = tmp_path / "saved"
    run(torchrun_cmd(2, saved, shared_data_dir, "parallel.dp_shard=2", "train.micro_batch_size=4"))
    shutil.rmtree(saved / "checkpoints" / "step_00000020")  # as if the job had stopped after step 10
    one, four = tmp_path / "one", tmp_path / "four"
    shutil.copytree(saved, one)
    shutil.copytree(saved, four)
    run([sys.executable, "-m", "lmforge", "train", "-c", str(TINY), *overrides(one, shared_data_dir),
         "--resume"])
    run(torchrun_cmd(4, four, shared_data_dir, "parallel.dp_shard=4", "train.micro_batch_size=2")
        + ["--resume"])
    for resumed in (one, four):
        assert_same_curve(reference, curve(resumed))


@pytest.mark.slow
def test_two_torchrun_nodes_on_localhost_train_together(reference, tmp_path, shared_data_dir):
    port = free_port()
    nodes = []
    for _ in range(2):  # two "nodes", each one torchrun agent with one worker
        launcher = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lmforge-test")
        cmd = torchrun_cmd(2, tmp_path / "run", shared_data_dir, "parallel.dp_shard=2",
                           "train.micro_batch_size=4", launcher=launcher)
        nodes.append(subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    for p in nodes:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
    assert_same_curve(reference, curve(tmp_path / "run"))


def worker_pids(agent_pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@pytest.mark.slow
def test_a_dead_rank_stops_the_job_instead_of_hanging(tmp_path, shared_data_dir):
    cmd = torchrun_cmd(2, tmp_path / "run", shared_data_dir, "parallel.dp_shard=2",
                       "train.micro_batch_size=4", "train.max_steps=100000", "checkpoint.every=0",
                       "parallel.timeout_s=30")
    agent = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (tmp_path / "run" / "metrics.jsonl").exists() and len(worker_pids(agent.pid)) == 2:
            break
        time.sleep(0.05)
    os.kill(worker_pids(agent.pid)[-1], signal.SIGKILL)
    t0 = time.time()
    _, err = agent.communicate(timeout=120)
    assert agent.returncode != 0 and time.time() - t0 < 60
    assert "exitcode  : -9" in err  # torchrun names the lost rank, then stops the survivor


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_under_max_restarts(tmp_path, shared_data_dir):
    extra = ("parallel.dp_shard=2", "train.micro_batch_size=4", "train.max_steps=60", "checkpoint.every=10",
             "train.eval_every=30")
    straight = tmp_path / "straight"
    run(torchrun_cmd(2, straight, shared_data_dir, *extra))

    killed = tmp_path / "killed"
    cmd = torchrun_cmd(2, killed, shared_data_dir, *extra, "logging.progress=plain")
    cmd[cmd.index("--nproc-per-node"):cmd.index("--nproc-per-node")] = ["--max-restarts", "1"]
    agent = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, victim = time.time() + 240, None
    while time.time() < deadline and victim is None:
        steps = [r["step"] for r in read_metrics(killed / "metrics.jsonl") if "loss" in r] \
            if (killed / "metrics.jsonl").exists() else []
        if steps and steps[-1] >= 13:  # past the checkpoint at step 10
            pids = worker_pids(agent.pid)
            assert len(pids) == 2, pids
            victim = pids[-1]
            os.kill(victim, signal.SIGKILL)
        assert agent.poll() is None, agent.stdout.read()[-3000:]
        time.sleep(0.01)
    assert victim is not None, "training never got past step 13"
    out, _ = agent.communicate(timeout=300)
    assert agent.returncode == 0, out[-4000:]
    assert "resumed from" in out and "step_00000010" in out.split("resumed from")[1].splitlines()[0]
    a, b = curve(straight), curve(killed)
    assert sorted(a) == sorted(b) == list(range(1, 61))
    assert a == b  # same layout, same reduction order: the restarted job is bit-identical
