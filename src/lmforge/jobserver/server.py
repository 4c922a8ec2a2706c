"""`lmforge jobs`: start the job server, and the `token` subcommands that manage who may use it."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import LmforgeError
from lmforge.utils.pidlock import PidLock


def _workspace(path: str | None) -> Path:
    if not path:
        raise LmforgeError("give --workspace DIR: the server keeps server.db and jobs/ there")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise LmforgeError(f"--workspace {path} is not a directory")
    return p


def _whole(option: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LmforgeError(f"{option} {value!r}: give a whole number from {low} to {high}")
    return value


def _finite(option: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise LmforgeError(f"{option} {value!r}: give a finite number from {low:g} to {high:g}")
    return float(value)


def lock_workspace(ws: Path) -> PidLock:
    """The workspace's server lock, held for the server's life: a second server over the same server.db
    would run every queued job twice. Refused naming the holder (the lock dies with it, kill -9 too)."""
    from lmforge.jobserver.store import LOCK_NAME

    ws.mkdir(parents=True, exist_ok=True)
    return PidLock.acquire(ws / LOCK_NAME, lambda holder: LmforgeError(
        f"--workspace {ws} is already served by another job server ({holder}); stop that one first, or "
        "give this one another workspace"))


def serve_jobs(workspace: str, host: str = "127.0.0.1", port: int = 8080, max_running: int = 1,
               allow_roots: Sequence[str] = (), jobs_per_minute: float = 30.0, job_burst: int = 10,
               max_body_bytes: int = 1 << 20, backend: str = "local", ray_address: str | None = None,
               ray_gpus: float = 0.0, limits: dict | None = None, publish_urls: Sequence[str] = (),
               publish_key: str | None = None) -> None:
    """Serve the job API until interrupted. Running jobs outlive the server (the next start re-attaches
    them). `backend="ray"` hands the jobs to the Ray cluster at `ray_address` (see ray_backend.py), each
    process reserving one CPU and `ray_gpus` GPUs. `limits`: Limits.for_machine's keyword arguments (what
    one job may ask, what runs at once; None values come from this machine). Every number is checked
    first, then the workspace is locked: nothing starts on a bad option or a workspace already served."""
    import uvicorn

    from lmforge.jobserver.app import create_app
    from lmforge.jobserver.limits import Limits
    from lmforge.jobserver.runner import Runner
    from lmforge.jobserver.store import Store

    _whole("--port", port, 1, 65535)
    _whole("--max-running", max_running, 1, 10_000)
    _finite("--jobs-per-minute", jobs_per_minute, 0, 1e6)
    _whole("--job-burst", job_burst, 1, 1_000_000)
    _whole("max_body_bytes", max_body_bytes, 1024, 1 << 30)
    _finite("--ray-gpus-per-process", ray_gpus, 0, 1024)
    lim = Limits.for_machine(**(limits or {}), max_running=max_running)
    if backend not in ("local", "ray"):
        raise LmforgeError(f"--backend {backend}: choose local or ray")
    for r in allow_roots:
        if not Path(r).is_dir():
            raise LmforgeError(f"--allow-root {r} is not a directory")
    publisher = None
    if publish_urls:
        from lmforge.jobserver.publish import Publisher

        publisher = Publisher(publish_urls, publish_key or os.environ.get("LMFORGE_ADMIN_KEY"))
    elif publish_key:
        raise LmforgeError("--publish-key is the admin key of the model servers named by --publish-url: "
                           "give those too")
    ws, runner, where = _workspace(workspace).resolve(), None, "here"
    lock = lock_workspace(ws)
    try:
        if backend == "ray":
            from lmforge.jobserver.ray_backend import RayBackend

            ray = RayBackend(ray_address, num_gpus=ray_gpus)
            # Its own connection to server.db (the app opens another; SQLite serialises the two writers).
            runner = Runner(Store(ws), ws, max_running, backend=ray, limits=lim)
            where = f"on the Ray cluster at {ray.address}"
        app = create_app(ws, max_running=max_running, allow_roots=tuple(allow_roots), runner=runner,
                         limits=lim, jobs_per_minute=jobs_per_minute, job_burst=job_burst,
                         max_body_bytes=max_body_bytes, publisher=publisher)
        print(f"lmforge jobs: http://{host}:{port} (API docs at /docs), workspace {ws}, {max_running} "
              f"job(s) at a time, {where}; a job may ask {lim.max_procs_per_job} process(es), "
              f"{lim.max_threads_per_job} thread(s), {lim.max_memory_per_job / (1 << 30):.1f} GiB; all jobs "
              f"together {lim.max_procs} process(es), {lim.max_memory / (1 << 30):.1f} GiB",
              file=sys.stderr, flush=True)
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        lock.release()


def token_command(action: str, workspace: str, user: str | None = None, token_id: str | None = None) -> None:
    """`lmforge jobs token create|list|revoke`."""
    from lmforge.jobserver.auth import create_token, revoke_token
    from lmforge.jobserver.store import Store

    store = Store(_workspace(workspace))
    try:
        if action == "create":
            if not user:
                raise LmforgeError("give --user NAME: the token acts as that user")
            print(create_token(store, user))
            print("(shown once: the server keeps only its hash)", file=sys.stderr)
        elif action == "list":
            for t in store.tokens():
                state = "revoked" if t["revoked_at"] else "active"
                made = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t["created_at"]))
                print(f"{t['id']}  {t['user']:<20}  {state:<8}  created {made}")
        elif action == "revoke":
            if not token_id:
                raise LmforgeError("give the token's id (`lmforge jobs token list` shows them)")
            revoke_token(store, token_id)
            print(f"revoked {token_id}")
    finally:
        store.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A job server in a child process (tests, benchmarks)."""

    proc: subprocess.Popen
    url: str


@contextlib.contextmanager
def server_process(workspace: str | Path, *extra: str, port: int | None = None,
                   timeout: float = 60.0) -> Iterator[ServerProcess]:
    """Start `lmforge jobs --workspace ...` on localhost, wait for /health, stop it (SIGTERM) at the end."""
    import httpx

    port = port or free_port()
    cmd = [sys.executable, "-m", "lmforge", "jobs", "--workspace", str(workspace), "--port", str(port),
           *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the job server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the job server did not answer /health")
            time.sleep(0.1)
        yield ServerProcess(proc, url)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
