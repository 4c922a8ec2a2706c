"""POST /v1/jobs/{id}/publish: a finished LoRA/DoRA job's adapter onto a running `lmforge serve` (one of
the job server's --publish-url; jobserver/publish.py does the call)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request

from lmforge.jobserver.jobs import RequestError
from lmforge.jobserver.publish import Publisher
from lmforge.jobserver.routes.state import JobsState


def publish_router(state: JobsState, user_of: Callable, publisher: Publisher | None) -> APIRouter:
    """The publish route; with `publisher` None (no --publish-url) it refuses every request (409)."""
    router = APIRouter()

    @router.post("/v1/jobs/{job_id}/publish", tags=["jobs"])
    async def publish(job_id: str, request: Request, user: str = Depends(user_of)) -> dict[str, Any]:
        """Load a succeeded LoRA/DoRA train job's adapter into a running `lmforge serve` (one of the
        job server's --publish-url) as model `lora_name`."""
        job = state.own_job(job_id, user)
        if publisher is None:
            raise RequestError(409, "this job server publishes to no model server (its operator starts it "
                               "with --publish-url URL and the model server's admin key)", None, "no_publish")
        req = publisher.parse(await request.body())
        if job.kind != "train" or job.status != "succeeded":
            raise RequestError(409, f"job {job_id} ({job.kind}, {job.status}) has no finished adapter: only "
                               "a succeeded train job can be published", "id", "not_publishable")
        answer = await asyncio.to_thread(publisher.publish, state.job_dir(job) / "run", req)
        return {"object": "lmforge.job.published", "id": job.id, "server_url": req.server_url,
                "lora_name": req.lora_name, "adapter": answer}

    return router
