"""The job routes: create, list, get, cancel, resume, delete (a job's output: watch.py).

    POST   /v1/jobs                             create (train / eval / generate / export); 201
    GET    /v1/jobs?status=&limit=&after=       the caller's jobs, newest first; `after` pages on
    GET    /v1/jobs/{id}                        status, step / max_steps, latest metrics, ETA
    POST   /v1/jobs/{id}/cancel                 SIGTERM: a train job saves a checkpoint and stops
    POST   /v1/jobs/{id}/resume                 a cancelled / interrupted / failed train job continues
    DELETE /v1/jobs/{id}?artifacts=true         refused while it runs; artifacts=true removes its dir
"""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from lmforge.jobserver.jobs import RequestError, build_job, parse_request
from lmforge.jobserver.routes.state import JobsState
from lmforge.jobserver.store import RESUMABLE, STATUSES, TERMINAL

_CREATE_BODY = {"requestBody": {"content": {
    "application/json": {"schema": {"type": "object", "properties": {
        "kind": {"enum": ["train", "eval", "generate", "export"]},
        "config": {"description": "the run's config: an object or YAML text"},
        "set": {"type": "array", "items": {"type": "string"}}, "name": {"type": "string"},
        "source": {"type": "string"}, "prompt": {"type": "string"},
        "nproc": {"type": "integer"}}}},
    "application/yaml": {"schema": {"type": "string"}}}}}


def jobs_router(state: JobsState, user_of: Callable) -> APIRouter:
    """The routes that make, list and stop jobs; `user_of` is the bearer-token dependency."""
    router = APIRouter()
    store, runner, limiter = state.store, state.runner, state.limiter

    @router.post("/v1/jobs", status_code=201, tags=["jobs"], openapi_extra=_CREATE_BODY)
    async def create(request: Request, user: str = Depends(user_of)) -> dict[str, Any]:
        """Queue a job: a train job from a config, or an eval / generate / export job on a train job."""
        raw = await request.body()
        query = {k: v for k, v in request.query_params.items()}
        query["set"] = request.query_params.getlist("set")
        req = parse_request(raw, request.headers.get("content-type", "application/json"), query)
        wait = limiter.take(user)
        if wait:
            raise RequestError(429, f"too many jobs created; retry in {math.ceil(wait)} s", None,
                               str(math.ceil(wait)))
        job = await asyncio.to_thread(build_job, req, user, state.workspace, state.confiner, store.get,
                                      state.limits)
        try:
            store.add_job(job)
        except BaseException:  # nothing of a job that was not stored remains
            shutil.rmtree(state.job_dir(job), ignore_errors=True)
            raise
        runner.wake()
        return state.view(job)

    @router.get("/v1/jobs", tags=["jobs"])
    async def list_jobs(status: str | None = Query(None, description="only jobs with this status"),
                        limit: int = Query(20, ge=1, le=100), after: str | None = Query(
                            None, description="the last id of the previous page"),
                        user: str = Depends(user_of)) -> JSONResponse:
        """The caller's jobs, newest first."""
        if status is not None and status not in STATUSES:
            raise RequestError(400, f"status {status!r} is not one of {', '.join(STATUSES)}", "status")
        after_seq = state.own_job(after, user).seq if after else None
        jobs = store.list(user=user, status=status, after_seq=after_seq, limit=limit + 1)
        more = len(jobs) > limit
        data = [state.view(j) for j in jobs[:limit]]
        return JSONResponse({"object": "list", "data": data, "has_more": more,
                             "last_id": data[-1]["id"] if data else None})

    @router.get("/v1/jobs/{job_id}", tags=["jobs"])
    async def get_job(job_id: str, user: str = Depends(user_of)) -> JSONResponse:
        """One job: status, step / max_steps, latest training and validation metrics, ETA."""
        # a dashboard polls this: no response model
        return JSONResponse(state.view(state.own_job(job_id, user)))

    @router.post("/v1/jobs/{job_id}/cancel", tags=["jobs"])
    async def cancel(job_id: str, user: str = Depends(user_of)) -> dict[str, Any]:
        """A queued job is cancelled at once; a running one gets SIGTERM and is cancelled when it stops."""
        job = state.own_job(job_id, user)
        if job.status in TERMINAL:
            raise RequestError(409, f"job {job_id} has already ended ({job.status})", "id", "job_ended")
        runner.cancel(job)
        return state.view(store.get(job.id) or job)

    @router.post("/v1/jobs/{job_id}/resume", tags=["jobs"])
    async def resume(job_id: str, user: str = Depends(user_of)) -> dict[str, Any]:
        """Queue a cancelled / interrupted / failed train job again; it continues from its last checkpoint."""
        job = state.own_job(job_id, user)
        if job.kind != "train" or job.status not in RESUMABLE:
            raise RequestError(409, f"job {job_id} ({job.kind}, {job.status}) cannot be resumed: only a "
                               f"train job that is {', '.join(sorted(RESUMABLE))}", "id", "not_resumable")
        wait = limiter.take(user)
        if wait:
            raise RequestError(429, f"too many jobs started; retry in {math.ceil(wait)} s", None,
                               str(math.ceil(wait)))
        if not store.update(job.id, expect=tuple(RESUMABLE), status="queued", resume=True,
                            queued_at=time.time(), cancel_requested=False, finished_at=None, error=None,
                            exit_code=None):
            raise RequestError(409, f"job {job_id} changed state; look again", "id", "conflict")
        runner.wake()
        return state.view(store.get(job.id) or job)

    @router.delete("/v1/jobs/{job_id}", tags=["jobs"])
    async def delete(job_id: str, artifacts: bool = False, user: str = Depends(user_of)) -> dict[str, Any]:
        """Forget a job that has ended; with artifacts=true its dir (run, logs, exports) goes too."""
        job = state.own_job(job_id, user)
        if job.status not in TERMINAL:
            raise RequestError(409, f"job {job_id} is {job.status}; cancel it first", "id", "job_active")
        users = [j for j in store.list(user=user) if j.source == job.id and j.status not in TERMINAL]
        if users:
            raise RequestError(409, f"job {users[0].id} ({users[0].kind}) is using job {job_id}; wait for it "
                               "or cancel it first", "id", "job_in_use")
        store.delete(job.id)
        state.progress.forget(job.id)
        if artifacts:
            await asyncio.to_thread(shutil.rmtree, state.job_dir(job), True)
        return {"id": job.id, "object": "lmforge.job.deleted", "deleted": True,
                "artifacts_deleted": artifacts}

    return router
