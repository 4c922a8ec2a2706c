"""Jobs on a Ray cluster through the Ray Jobs API: `lmforge jobs --backend ray --ray-address URL`.

The server keeps its queue (`--max-running`), its store and its routes; only where a job's process runs
changes. Each start is one Ray job whose entrypoint is the same launcher the local runner starts
(`python -m lmforge.jobserver.launch JOB_DIR`), so the job writes its logs, metrics, checkpoints and exit.json
into its dir in the workspace exactly as a local job does, and the server reads them from there. That
is why the workspace must be a filesystem every Ray node mounts at the same path (NFS, Lustre, a shared
volume), and why the nodes need lmforge at the server's interpreter path (the same image or venv): no
`working_dir` is uploaded, the entrypoint names the job dir by its absolute path.

Ray knows a job by its submission id, `lmforge-<job id>-<attempt>`: derived from the stored row, so a
restarted server re-attaches its running jobs by asking Ray about that id, and a resume (a new attempt)
is a new submission. Cancel is Ray's `stop_job`: Ray sends SIGTERM to the launcher and its children
(the trainer saves a checkpoint at the next step boundary and exits) and SIGKILLs them after
RAY_JOB_STOP_WAIT_TIME_S, 3 s by default. A checkpoint of a large model can take longer than that, so
each job's runtime_env raises the grace to STOP_GRACE_S (Ray's job supervisor reads it from there).
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from pathlib import Path

from lmforge.errors import LmforgeError
from lmforge.jobserver.launch import EXIT
from lmforge.jobserver.store import Job

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
STOP_GRACE_S = 120
POLL_S = 1.0
ACTIVE = frozenset({"PENDING", "RUNNING"})
# Server environment passed on to the jobs: where lmforge and its caches are found.
PASS_ENV = ("PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def submission_id(job: Job) -> str:
    """Ray's name for the job's current attempt (the runner counts attempts from 1)."""
    return f"lmforge-{job.id}-{job.attempts}"


def ended_state(ray_status: str, message: str | None,
                cancel_requested: bool) -> tuple[str, str | None] | None:
    """Ray's job status -> None while it runs (PENDING: Ray is placing it, it holds a --max-running slot),
    else (status, error) for a job that left no exit.json. With exit.json the runner takes the trainer's
    own exit code instead, whatever Ray says: the launcher exits 0 even when the trainer failed."""
    if ray_status in ACTIVE:
        return None
    why = f"Ray job {ray_status}" + (f": {message}" if message else "")
    if ray_status == "SUCCEEDED":  # the launcher ended well but wrote nothing: the workspace is not shared
        return "failed", f"{why}, but the job left no {EXIT} in its dir: is the workspace on a filesystem " \
            "the Ray nodes share, at the same path?"
    if ray_status == "STOPPED":
        return ("cancelled", None) if cancel_requested else ("interrupted", f"{why}; resume it to continue "
                                                           "from its last checkpoint")
    if ray_status == "FAILED":
        return "failed", why
    return "interrupted", f"{why}; resume it to continue from its last checkpoint"


def connect(address: str):
    """A Ray Jobs client for the dashboard at `address`; LmforgeError naming what is missing or wrong."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as e:
        raise LmforgeError("--backend ray needs the Ray Jobs client: pip install 'lmforge[ray]' "
                           f"(ray[default]>=2.9); importing it failed: {e}") from None
    try:
        # Ray >= 2.5x clusters started where a token exists (~/.ray/auth_token, $RAY_AUTH_TOKEN) require it;
        # its client sends it only in token mode. Turn that on as `ray start` does: when a token exists and
        # RAY_AUTH_MODE is not set.
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except ImportError:  # an older Ray: no token auth
        pass
    try:
        return JobSubmissionClient(address)
    except Exception as e:  # noqa: BLE001 - ConnectionError, RuntimeError, ray's AuthenticationError
        if type(e).__name__ == "AuthenticationError":
            raise LmforgeError(f"--ray-address {address}: the cluster wants a token Ray's client did not "
                               f"send ({e}); put it in $RAY_AUTH_TOKEN (or ~/.ray/auth_token) and set "
                               "RAY_AUTH_MODE=token") from None
        raise LmforgeError(f"--ray-address {address}: cannot reach Ray's job server ({e}); start a cluster "
                           "with `ray start --head` (its dashboard listens on :8265) or give the dashboard "
                           "URL of yours") from None


class RayBackend:
    """Submits, polls and stops the runner's jobs on a Ray cluster (the `Backend` of runner.py)."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 stop_grace_s: int = STOP_GRACE_S, poll_s: float = POLL_S) -> None:
        self.address = address or os.environ.get("RAY_ADDRESS", "").strip() or DEFAULT_ADDRESS
        if not self.address.startswith(("http://", "https://")):
            raise LmforgeError(f"--ray-address {self.address}: give the URL of the cluster's dashboard "
                               f"(the Ray Jobs API), e.g. {DEFAULT_ADDRESS}")
        self.client = connect(self.address)
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.stop_grace_s, self.poll_s = stop_grace_s, poll_s
        self._seen: dict[str, tuple[float, tuple[str, str | None] | None]] = {}
        self._warned = 0.0
        self._lock = threading.Lock()

    def submit(self, job: Job, job_dir: Path) -> None:
        """Submit the job's launcher; raises OSError when Ray refuses it (the runner marks it failed)."""
        sid = submission_id(job)
        env = {"PYTHONUNBUFFERED": "1", "RAY_JOB_STOP_WAIT_TIME_S": str(self.stop_grace_s),
               **{k: os.environ[k] for k in PASS_ENV if k in os.environ}}
        # Reserving resources makes Ray place the job on a node that has them (not always on the head);
        # one CPU (and GPU, if asked) per process the job starts. Ray then sets OMP_NUM_THREADS and
        # CUDA_VISIBLE_DEVICES for what it reserved.
        n = max(1, job.nproc)
        try:
            self.client.submit_job(
                entrypoint=shlex.join([sys.executable, "-m", "lmforge.jobserver.launch",
                                       str(job_dir.resolve())]),
                submission_id=sid, runtime_env={"env_vars": env},
                entrypoint_num_cpus=self.num_cpus * n, entrypoint_num_gpus=self.num_gpus * n or None,
                metadata={"lmforge_job": job.id, "user": job.user, "kind": job.kind})
        except RuntimeError as e:
            if "already exists" not in str(e):  # a retried submit of this very attempt: it is ours
                raise OSError(f"Ray refused the job: {e}") from None
        except ConnectionError as e:
            raise OSError(f"cannot reach Ray at {self.address}: {e}") from None

    def poll(self, job: Job) -> tuple[str, str | None] | None:
        """None while the job runs on Ray (or Ray cannot be asked now); else `ended_state`'s pair."""
        sid = submission_id(job)
        now = time.monotonic()
        with self._lock:
            last = self._seen.get(sid)
            if last is not None and now - last[0] < self.poll_s:
                return last[1]
        try:
            info = self.client.get_job_info(sid)
            got = ended_state(str(getattr(info.status, "value", info.status)), info.message,
                              job.cancel_requested)
        except RuntimeError as e:
            if "404" not in str(e):
                return self._unreachable(e)
            got = ("interrupted", f"Ray has no job {sid} (was the cluster restarted?); resume it to continue "
                   "from its last checkpoint")
        except OSError as e:  # requests' ConnectionError: the dashboard is down for a moment
            return self._unreachable(e)
        with self._lock:
            self._seen[sid] = (now, got)
            if got is not None:
                del self._seen[sid]
        return got

    def stop(self, job: Job) -> None:
        """Ray's stop_job: SIGTERM to the launcher and the job, SIGKILL after the grace."""
        try:
            self.client.stop_job(submission_id(job))
        except (RuntimeError, OSError) as e:
            print(f"lmforge jobs: cannot stop Ray job {submission_id(job)}: {e}", file=sys.stderr,
                  flush=True)

    def _unreachable(self, e: Exception) -> None:
        """Keep the job running while Ray cannot be asked; say so at most once a minute."""
        if time.monotonic() - self._warned > 60:
            self._warned = time.monotonic()
            print(f"lmforge jobs: cannot ask Ray at {self.address} about jobs: {e}", file=sys.stderr,
                  flush=True)
        return None
