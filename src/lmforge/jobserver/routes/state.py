"""What the job server's routes share, handed to each router's builder explicitly (no globals)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.jobserver.auth import RateLimiter
from lmforge.jobserver.confine import ConfinementError, Confiner, check_job_id
from lmforge.jobserver.jobs import RequestError, job_json
from lmforge.jobserver.limits import Limits
from lmforge.jobserver.progress import Progress
from lmforge.jobserver.runner import Runner
from lmforge.jobserver.store import Job, Store


@dataclass
class JobsState:
    """The workspace, its job store and runner, and the rules every job request is held to."""

    workspace: Path
    store: Store
    runner: Runner
    confiner: Confiner
    progress: Progress
    limiter: RateLimiter
    limits: Limits

    def own_job(self, job_id: str, user: str) -> Job:
        """The caller's job `job_id`; another user's job is "not found", exactly as a missing one."""
        try:
            check_job_id(job_id)
        except ConfinementError:
            raise RequestError(404, f"no job {job_id!r}", "id", "job_not_found") from None
        job = self.store.get(job_id)
        if job is None or job.user != user:  # another user's job is "not found": ids do not leak
            raise RequestError(404, f"no job {job_id!r}", "id", "job_not_found")
        return job

    def job_dir(self, job: Job) -> Path:
        return self.workspace / "jobs" / job.id

    def view(self, job: Job) -> dict[str, Any]:
        return job_json(job, self.workspace, self.progress)
