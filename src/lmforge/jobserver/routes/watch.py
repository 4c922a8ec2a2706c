"""Watching a job: its logs and its server-sent events.

    GET    /v1/jobs/{id}/logs?tail=N&stream=    the last N lines of stdout / stderr
    GET    /v1/jobs/{id}/events                 SSE: status, metrics (metrics.jsonl lines), log lines
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from lmforge.jobserver.launch import STDERR, STDOUT
from lmforge.jobserver.progress import Tail, tail_lines
from lmforge.jobserver.routes.state import JobsState
from lmforge.jobserver.store import TERMINAL, Job

SSE_POLL_S = 0.25


def watch_router(state: JobsState, user_of: Callable) -> APIRouter:
    """The logs and event-stream routes; `user_of` is the bearer-token dependency."""
    router = APIRouter()

    @router.get("/v1/jobs/{job_id}/logs", tags=["jobs"])
    async def logs(job_id: str, tail: int = Query(100, ge=0, le=10000),
                   stream: str = Query("both", pattern="^(stdout|stderr|both)$"),
                   user: str = Depends(user_of)) -> dict[str, Any]:
        """The last `tail` lines of the job's stdout and/or stderr."""
        d = state.job_dir(state.own_job(job_id, user))
        out: dict[str, Any] = {"object": "lmforge.job.logs", "id": job_id}
        for name, file in (("stdout", STDOUT), ("stderr", STDERR)):
            if stream in (name, "both"):
                out[name] = tail_lines(d / file, tail)
        return out

    @router.get("/v1/jobs/{job_id}/events", tags=["jobs"])
    async def events(job_id: str, request: Request, user: str = Depends(user_of)):
        """Server-sent events until the job ends: `status` (the job object at each change), `metrics` (each
        metrics.jsonl record, from the first), `log` ({stream, line}; from the last 64 KiB), then `end`."""
        job = state.own_job(job_id, user)
        return StreamingResponse(_events(state, job, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router


async def _events(state: JobsState, job: Job, request: Request):
    d = state.job_dir(job)
    tails = {"metrics": Tail(d / "run" / "metrics.jsonl")}
    for name, file in (("stdout", STDOUT), ("stderr", STDERR)):
        try:
            size = (d / file).stat().st_size
        except OSError:
            size = 0
        tails[name] = Tail(d / file, max(0, size - (1 << 16)))
    cut = {name: (d / file).exists() and (d / file).stat().st_size > 1 << 16
           for name, file in (("stdout", STDOUT), ("stderr", STDERR))}
    last: tuple | None = None
    idle = 0.0
    while True:
        now = state.store.get(job.id)
        if now is None:
            yield _sse("end", {"id": job.id, "status": "deleted"})
            return
        state_now = (now.status, now.attempts)
        if state_now != last:
            last = state_now
            yield _sse("status", state.view(now))
        sent = False
        for line in tails["metrics"].read():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            yield _sse("metrics", rec)
            sent = True
        for name in ("stdout", "stderr"):
            lines = tails[name].read()
            if cut[name] and lines:  # the first line read from the middle of a long log is cut
                lines, cut[name] = lines[1:], False
            for line in lines:
                yield _sse("log", {"stream": name, "line": line})
                sent = True
        if now.status in TERMINAL and not sent:
            yield _sse("end", {"id": job.id, "status": now.status})
            return
        idle = 0.0 if sent else idle + SSE_POLL_S
        if idle >= 15.0:  # a comment keeps proxies from closing a quiet stream
            idle = 0.0
            yield ": keep-alive\n\n"
        if await request.is_disconnected():
            return
        await asyncio.sleep(SSE_POLL_S)


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
