"""`lmforge train --nproc N [--nnodes M --node-rank R --master-addr A --master-port P]` (parallel/launch.py):
the same run as `torchrun ... -m lmforge train` with 2 local processes and with 2 "nodes" on localhost, a
SIGTERM to the launcher saving and stopping the run as under torchrun, the first failed worker's exit
status, and the refusals (exit 2, one line, before any worker starts)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_harness import free_port
from test_train_torchrun import assert_same_curve, curve, env

from conftest import TINY, tiny_overrides
from lmforge.cli import main

STEPS = 6


def sets(run_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    base = tiny_overrides(run_dir, data_dir, f"train.max_steps={STEPS}", "train.eval_every=3",
                          "checkpoint.every=3", "parallel.dp_shard=2", "train.micro_batch_size=4", *extra)
    return [a for o in base for a in ("--set", o)]


def lmforge_train(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmforge", "train", "-c", str(TINY), *args]


def check(proc: subprocess.CompletedProcess | subprocess.Popen, err: str) -> None:
    assert proc.returncode == 0, err[-4000:]
    assert "Traceback" not in err and "OMP_NUM_THREADS" not in err  # the agent's log is left out


@pytest.fixture(scope="module")
def torchrun_curve(tmp_path_factory, shared_data_dir) -> dict:
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "lmforge", "train", "-c", str(TINY), *sets(run_dir, shared_data_dir)]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return curve(run_dir)


@pytest.mark.slow
def test_two_local_processes_train_the_torchrun_curve(torchrun_curve, tmp_path, shared_data_dir):
    proc = subprocess.run(lmforge_train("--nproc", "2", *sets(tmp_path / "run", shared_data_dir)), env=env(),
                          capture_output=True, text=True, timeout=300)
    check(proc, proc.stderr)
    assert_same_curve(torchrun_curve, curve(tmp_path / "run"))


@pytest.mark.slow
def test_two_nodes_on_localhost_train_the_torchrun_curve(torchrun_curve, tmp_path, shared_data_dir):
    port = str(free_port())
    nodes = [subprocess.Popen(lmforge_train("--nnodes", "2", "--node-rank", str(rank), "--nproc", "1",
                                            "--master-addr", "127.0.0.1", "--master-port", port,
                                            *sets(tmp_path / "run", shared_data_dir)),
                              env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in (1, 0)]  # node 1 first: it waits for node 0's store
    for p in nodes:
        _, err = p.communicate(timeout=300)
        check(p, err)
    assert_same_curve(torchrun_curve, curve(tmp_path / "run"))


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_stops_every_worker(tmp_path, shared_data_dir):
    run_dir = tmp_path / "run"
    args = sets(run_dir, shared_data_dir, "train.max_steps=100000", "checkpoint.every=100000",
                "train.eval_every=100000", "train.log_every=1")
    p = subprocess.Popen(lmforge_train("--nproc", "2", *args), env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and '"loss"' in metrics.read_text()):
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()[-4000:]
        time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err[-4000:]  # what `lmforge train` itself exits with
    assert "Traceback" not in err
    saved = [d for d in (run_dir / "checkpoints").iterdir() if d.name.startswith("step_")]
    assert saved, err[-4000:]  # the workers got the signal and saved at a step boundary


def test_first_failed_workers_status_and_one_line(monkeypatch, capsys):
    """The exit status is the first failed worker's (torchrun's is 1); a status with which lmforge has
    reported the error itself gets no second line, a crash gets one line, never the agent's traceback."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from lmforge.parallel import launch

    job = launch.Launch(nproc=2, nnodes=1, node_rank=0, master_addr=None, master_port=None)
    for exitcode, status, said in [(2, 2, ""), (-signal.SIGKILL, 137, "rank 1 was killed by SIGKILL"),
                                   (1, 1, "rank 1 exited with status 1")]:
        def failed(args, exitcode=exitcode):
            assert args.nproc_per_node == "2" and args.module and args.training_script == "lmforge"
            assert args.training_script_args == ["train", "-c", "x.yaml"]
            failures = {1: ProcessFailure(1, 4242, exitcode, "/nonexistent"),
                        0: ProcessFailure(0, 4241, -signal.SIGTERM, "/nonexistent")}
            failures[0].timestamp = failures[1].timestamp + 1  # rank 0 was stopped after rank 1 failed
            raise ChildFailedError("lmforge", failures)

        monkeypatch.setattr(torchrun, "run", failed)
        assert launch.launch("train", job, ["train", "-c", "x.yaml"]) == status
        lines = capsys.readouterr().err.splitlines()
        assert lines == ([f"lmforge train: error: {said} (its output is above)"] if said else [])


@pytest.mark.parametrize("argv,expected", [
    (["--nproc", "2", "-c", "a.yaml"], ["-c", "a.yaml"]),
    (["--nproc=2", "--nnodes", "2", "--node-rank=1", "--master-addr", "h", "--master-port", "9"], []),
    (["--npro", "2", "--set", "x=1"], ["--set", "x=1"]),  # an abbreviation argparse accepted
    (["--set", "--nproc", "--resume"], ["--set", "--nproc", "--resume"]),  # a value, not the flag
    (["--resume", "--", "--nproc"], ["--resume", "--", "--nproc"]),
])
def test_worker_arguments_are_the_command_without_the_launcher_flags(argv, expected):
    from lmforge.cli.verbs.training import _takes_value
    from lmforge.parallel.launch import worker_argv

    assert worker_argv(argv, _takes_value("train")) == expected
    assert worker_argv(argv, _takes_value("sft")) == expected


@pytest.mark.parametrize("flags,needles", [
    (["--nproc", "0"], ["--nproc", "got '0'", "auto"]),
    (["--nproc", "two"], ["--nproc", "got 'two'"]),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], ["--node-rank 2", "--nnodes 2", "0 to 1"]),
    (["--nnodes", "2", "--node-rank", "1"], ["--nnodes 2 needs --master-addr"]),
    (["--nproc", "2", "--master-port", "70000"], ["--master-port", "1 to 65535"]),
    (["--nproc", "2", "--set", "parallel.tp=3"], ["parallel.tp=3", "world size 2"]),
    (["--nproc", "3", "--set", "parallel.pp=2", "--set", "parallel.dp_shard=1"], ["world size is 3"]),
    (["--nproc", "2", "--budget", "5m"], ["--budget", "drop --nproc"]),
])
def test_refusals_before_any_worker_starts(flags, needles, tmp_path, capsys, monkeypatch):
    from lmforge.parallel import launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch, "launch", lambda *a: pytest.fail("a refused job started its workers"))
    argv = ["train", "-c", str(TINY), "--set", f"run.dir={tmp_path / 'run'}", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("lmforge train: error: "), err
    for n in needles:
        assert n in err, err
    assert not (tmp_path / "run").exists()


def test_refused_inside_a_launched_job(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["sft", "-c", str(TINY), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "--nproc starts the processes itself" in err and "WORLD_SIZE=2" in err


def test_torchrun_arguments_of_a_launch():
    """Several nodes meet by torchrun's static rendezvous at the given address (port 29500 by default,
    torchrun's); one node without an address or port is left to torchrun's free-port rendezvous."""
    from lmforge.parallel.launch import Launch, _torchrun_args

    a = _torchrun_args(Launch(4, 2, 1, "node0", None), ["train", "-c", "x.yaml"])
    assert (a.nproc_per_node, a.nnodes, a.node_rank, a.master_addr, a.master_port) == ("4", "2", 1, "node0",
                                                                                       29500)
    assert a.rdzv_backend == "static" and a.module and a.training_script == "lmforge"
    assert a.training_script_args == ["train", "-c", "x.yaml"]
    one = _torchrun_args(Launch(2, 1, 0, None, None), ["train"])
    assert one.master_port is None and one.training_script_args == ["train"]
    assert _torchrun_args(Launch(2, 1, 0, "10.0.0.1", None), ["train"]).master_addr == "10.0.0.1"


def test_nproc_auto_is_one_per_gpu_else_one(monkeypatch):
    import argparse

    import torch

    from lmforge.parallel.launch import resolve

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = argparse.Namespace(nproc="auto", nnodes=None, node_rank=None, master_addr=None, master_port=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    job = resolve(args)
    assert (job.nproc, job.world_size, job.in_process) == (1, 1, True)  # a CPU: this process trains
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve(args).nproc == 4
