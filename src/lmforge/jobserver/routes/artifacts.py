"""A job's files: GET /v1/jobs/{id}/artifacts (the list) and /artifacts/{name} (one file's bytes).

Only the job's logs, its export and its run dir's files are artifacts: no checkpoints, data, dotfiles or
links, at most three levels deep, and a name never resolves outside the job's dir.
"""

from __future__ import annotations

import asyncio
import mimetypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from lmforge.jobserver.confine import ConfinementError, check_artifact_name, resolve_inside
from lmforge.jobserver.jobs import RequestError
from lmforge.jobserver.launch import STDERR, STDOUT
from lmforge.jobserver.routes.state import JobsState

# Run-dir entries that are not artifacts: weights are exported by an export job, data is shared input.
_NOT_ARTIFACTS = {"checkpoints", "data", "tensorboard"}


def artifacts_router(state: JobsState, user_of: Callable) -> APIRouter:
    """The artifact routes; `user_of` is the bearer-token dependency."""
    router = APIRouter()

    @router.get("/v1/jobs/{job_id}/artifacts", tags=["artifacts"])
    async def artifacts(job_id: str, user: str = Depends(user_of)) -> dict[str, Any]:
        """The job's downloadable files (the HF export appears as export.zip once an export job made it)."""
        files = await asyncio.to_thread(artifact_files, state.job_dir(state.own_job(job_id, user)))
        data = []
        for name, p in files.items():
            st = p.stat()
            data.append({"name": name, "bytes": st.st_size, "modified_at": int(st.st_mtime)})
        return {"object": "list", "data": data}

    @router.get("/v1/jobs/{job_id}/artifacts/{name:path}", tags=["artifacts"])
    async def artifact(job_id: str, name: str, user: str = Depends(user_of)):
        """One artifact's bytes, as they are at the moment of asking."""
        job = state.own_job(job_id, user)
        try:
            check_artifact_name(name)
        except ConfinementError as e:
            raise RequestError(400, str(e), "name", "bad_name") from None
        jdir = state.job_dir(job)
        path = (await asyncio.to_thread(artifact_files, jdir)).get(name)
        if path is None:
            raise RequestError(404, f"job {job_id} has no artifact {name!r}", "name", "artifact_not_found")
        try:
            path = resolve_inside(jdir, str(path.relative_to(jdir)))  # no link out, at any level
        except ConfinementError as e:
            raise RequestError(404, str(e), "name", "artifact_not_found") from None
        return _snapshot(path, Path(name).name)

    return router


def artifact_files(d: Path) -> dict[str, Path]:
    """name -> file: the job's logs and export, then its run dir's files (no checkpoints, data, dotfiles
    or links; at most three levels deep). A train job's config.yaml is the run's resolved config."""
    found = {n: d / n for n in (STDOUT, STDERR, "export.zip", "config.yaml")}
    run = d / "run"
    if run.is_dir():
        for p in sorted(run.rglob("*")):
            rel = p.relative_to(run)
            hidden = any(x.startswith(".") for x in rel.parts)
            if rel.parts[0] in _NOT_ARTIFACTS or hidden or len(rel.parts) > 3:
                continue
            if rel.as_posix() == "config.yaml" or rel.as_posix() not in found:
                found[rel.as_posix()] = p
    return {n: p for n, p in found.items() if p.is_file() and not p.is_symlink()}


def _snapshot(path: Path, filename: str) -> StreamingResponse:
    """The file as it is now: exactly the bytes it had when asked for (metrics.jsonl and logs grow while
    a job runs; a plain file response would declare one length and send more)."""
    f = open(path, "rb")  # noqa: SIM115 - closed by the generator
    size = os.fstat(f.fileno()).st_size

    def chunks():
        with f:
            left = size
            while left > 0:
                data = f.read(min(left, 1 << 20))
                if not data:
                    return
                left -= len(data)
                yield data

    media = mimetypes.guess_type(filename)[0] or "application/octet-stream"
    return StreamingResponse(chunks(), media_type=media, headers={
        "Content-Length": str(size), "Content-Disposition": f'attachment; filename="{filename}"'})
