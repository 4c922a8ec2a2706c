"""The routes of `lmforge jobs`: a REST job API (OpenAPI at /docs) a dashboard can be a thin page over.

    GET    /health                              no token needed
    POST   /v1/jobs                             create (train / eval / generate / export); 201
    GET    /v1/jobs?status=&limit=&after=       the caller's jobs, newest first; `after` pages on
    GET    /v1/jobs/{id}                        status, step / max_steps, latest metrics, ETA
    GET    /v1/jobs/{id}/events                 SSE: status, metrics (metrics.jsonl lines), log lines
    GET    /v1/jobs/{id}/logs?tail=N&stream=    the last N lines of stdout / stderr
    POST   /v1/jobs/{id}/cancel                 SIGTERM: a train job saves a checkpoint and stops
    POST   /v1/jobs/{id}/resume                 a cancelled / interrupted / failed train job continues
    POST   /v1/jobs/{id}/publish                a finished LoRA/DoRA job's adapter onto a running
                                                `lmforge serve` (jobserver/publish.py; with --publish-url)
    DELETE /v1/jobs/{id}?artifacts=true         refused while it runs; artifacts=true removes its dir
    GET    /v1/jobs/{id}/artifacts[/{name}]     metrics.jsonl, curves.png, config.yaml, eval reports...
    /v1/studies...                              human evaluation: blind rating studies (routes/rating.py)

Every /v1 route needs `Authorization: Bearer <token>`; a job of another user answers 404 exactly as a
missing one does, so ids do not leak. Errors are {"error": {"message", "type", "param", "code"}}.

Each area is an APIRouter built by a small function in jobserver/routes/ from the shared state it is handed
(JobsState, the token dependency, the publisher); this module only composes them. The HTTP edge (error
shape, body limit, exception handlers) is jobserver/http.py; the dashboard page is jobserver/dashboard.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI

from lmforge.jobserver.auth import RateLimiter
from lmforge.jobserver.confine import Confiner
from lmforge.jobserver.http import MAX_BODY_BYTES, BodyLimit, install_error_handlers
from lmforge.jobserver.limits import Limits
from lmforge.jobserver.progress import Progress
from lmforge.jobserver.publish import Publisher
from lmforge.jobserver.rating import RatingStore
from lmforge.jobserver.routes.artifacts import artifacts_router
from lmforge.jobserver.routes.auth import bearer_user
from lmforge.jobserver.routes.health import health_router
from lmforge.jobserver.routes.jobs import jobs_router
from lmforge.jobserver.routes.publish import publish_router
from lmforge.jobserver.routes.rating import rating_router
from lmforge.jobserver.routes.state import JobsState
from lmforge.jobserver.routes.watch import watch_router
from lmforge.jobserver.runner import Runner
from lmforge.jobserver.store import Store

__all__ = ["API_NICE", "MAX_BODY_BYTES", "create_app"]

# The API answers at a lower CPU priority than the jobs it watches: a busy dashboard on a small machine
# slows its own answers, not the training (see bench/jobs_load.py).
API_NICE = 10


def create_app(workspace: str | Path, *, max_running: int = 1, allow_roots: tuple[str, ...] = (),
               max_body_bytes: int = MAX_BODY_BYTES, jobs_per_minute: float = 30.0, job_burst: int = 10,
               limits: Limits | None = None, runner: Runner | None = None,
               start_runner: bool = True, publisher: Publisher | None = None) -> FastAPI:
    """The job server's app over `workspace` (server.db, jobs/); its runner starts and stops with it.
    `limits`: what one job may ask and what runs at once (default: from this machine). `publisher`:
    the model servers finished adapters may be published to (None: the publish route refuses)."""
    workspace = Path(workspace).resolve()
    limits = limits or (runner.limits if runner is not None else Limits.for_machine(max_running=max_running))
    (workspace / "jobs").mkdir(parents=True, exist_ok=True)
    store = Store(workspace)
    runner = runner or Runner(store, workspace, max_running, limits=limits)
    confiner = Confiner(workspace, allow_roots)
    runner.confiner = confiner  # train jobs are checked again when they start
    state = JobsState(workspace, store, runner, confiner, Progress(), RateLimiter(jobs_per_minute, job_burst),
                      limits)

    async def lifespan(app):
        if start_runner:
            runner.start()  # its thread, and the jobs it starts, keep the normal priority
        _lower_priority(API_NICE)
        yield
        runner.stop()
        store.close()
        ratings.close()

    app = FastAPI(title="lmforge job server", version="1", lifespan=lifespan,
                  description="Submit, watch, stop and resume lmforge runs. Every /v1 route needs a bearer "
                  "token from `lmforge jobs token create`.")
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.state.store, app.state.runner, app.state.workspace = store, runner, workspace
    install_error_handlers(app)
    user_of = bearer_user(store)
    app.include_router(health_router())
    app.include_router(jobs_router(state, user_of))
    app.include_router(publish_router(state, user_of, publisher))
    app.include_router(artifacts_router(state, user_of))
    app.include_router(watch_router(state, user_of))
    ratings = RatingStore(workspace)  # human evaluation: rating studies and the /rate page
    app.include_router(rating_router(state, user_of, ratings))

    from lmforge.jobserver.dashboard import mount_dashboard  # the web page at /: a client of the routes above

    mount_dashboard(app)
    return app


def _lower_priority(by: int) -> None:
    """Raise the niceness of the calling thread only (Linux applies PRIO_PROCESS with who=0 per thread);
    threads it starts afterwards (asyncio.to_thread's pool) inherit it."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + by))
    except (AttributeError, OSError):  # not on this platform: same priority as the jobs
        pass
