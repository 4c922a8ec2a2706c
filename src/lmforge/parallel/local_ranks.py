"""Start n worker processes on this machine with the environment torchrun gives its workers, without
torchrun's agent: for tools and tests that run many short multi-process jobs (memory measurements,
distributed equivalence tests), where an agent per job would cost more than the job."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(n: int, cmd: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None,
              timeout: float = 600.0) -> None:
    """Run `cmd` as ranks 0..n-1 (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT set,
    plus `env` over this process's environment), each rank's output in log_dir/log_{rank}.txt; wait
    for all. A rank that fails or outlives `timeout` (then every rank is killed) raises RuntimeError
    with the tail of each failed rank's log."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for r in range(n):
        rank_env = {**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        log = open(log_dir / f"log_{r}.txt", "w")
        procs.append((subprocess.Popen(list(cmd), env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for r, (p, log) in enumerate(procs):
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            rc = "timeout"
        log.close()
        if rc != 0:
            failed.append(f"--- rank {r} (exit {rc}) ---\n" + (log_dir / f"log_{r}.txt").read_text()[-4000:])
    if failed:
        raise RuntimeError("ranks failed:\n" + "\n".join(failed))
