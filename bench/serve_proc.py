"""What the serving benches share: a free localhost port, a server subprocess waited on until /health
answers, its resident memory, and a percentile."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], env: dict[str, str], port: int, cwd: Path, timeout: float = 120.0
           ) -> tuple[subprocess.Popen, str]:
    """Start `cmd` (a server listening on 127.0.0.1:port) and wait until its /health answers 200;
    returns the process and its OpenAI base URL. Exits with the server's stderr if it dies first."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read().decode()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, f"{url}/v1"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start within {timeout:.0f} s")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs, nearest rank."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]
