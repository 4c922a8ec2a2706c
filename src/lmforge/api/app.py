"""The routes of `lmforge server`: a REST job API (OpenAPI at /docs) a dashboard can be a thin page over.

    GET    /health                              no token needed
    POST   /v1/jobs                             create (train / eval / generate / export); 201
    GET    /v1/jobs?status=&limit=&after=       the caller's jobs, newest first; `after` pages on
    GET    /v1/jobs/{id}                        status, step / max_steps, latest metrics, ETA
    GET    /v1/jobs/{id}/events                 SSE: status, metrics (metrics.jsonl lines), log lines
    GET    /v1/jobs/{id}/logs?tail=N&stream=    the last N lines of stdout / stderr
    POST   /v1/jobs/{id}/cancel                 SIGTERM: a train job saves a checkpoint and stops
    POST   /v1/jobs/{id}/resume                 a cancelled / interrupted / failed train job continues
    POST   /v1/jobs/{id}/publish                a finished LoRA/DoRA job's adapter onto a running
                                                `lmforge serve` (api/publish.py; with --publish-url)
    DELETE /v1/jobs/{id}?artifacts=true         refused while it runs; artifacts=true removes its dir
    GET    /v1/jobs/{id}/artifacts[/{name}]     metrics.jsonl, curves.png, config.yaml, eval reports...

Every /v1 route needs `Authorization: Bearer <token>`; a job of another user answers 404 exactly as a
missing one does, so ids do not leak. Errors are {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import math
import mimetypes
import os
import shutil
import time
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException

from lmforge.api.auth import RateLimiter, authenticate
from lmforge.api.confine import ConfinementError, Confiner, check_artifact_name, check_job_id, resolve_inside
from lmforge.api.jobs import RequestError, build_job, job_json, parse_request
from lmforge.api.launch import STDERR, STDOUT
from lmforge.api.limits import Limits
from lmforge.api.progress import Progress, Tail, tail_lines
from lmforge.api.publish import Publisher
from lmforge.api.runner import Runner
from lmforge.api.store import RESUMABLE, STATUSES, TERMINAL, Job, Store

MAX_BODY_BYTES = 1 << 20
# The API answers at a lower CPU priority than the jobs it watches: a busy dashboard on a small machine
# slows its own answers, not the training (see bench/jobs_load.py).
API_NICE = 10
SSE_POLL_S = 0.25
# Run-dir entries that are not artifacts: weights are exported by an export job, data is shared input.
_NOT_ARTIFACTS = {"checkpoints", "data", "tensorboard"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class _BodyLimit:
    """Refuse a body over `limit` bytes (413) by its Content-Length or while it streams in."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope["headers"]:
            if k == b"content-length" and (not v.isdigit() or int(v) > self.limit):
                return await _error(413, f"the request body is larger than {self.limit} bytes",
                                    code="body_too_large")(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise RequestError(413, f"the request body is larger than {self.limit} bytes",
                                       code="body_too_large")
            return msg

        return await self.app(scope, limited, send)


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
    progress = Progress()
    limiter = RateLimiter(jobs_per_minute, job_burst)

    async def lifespan(app):
        if start_runner:
            runner.start()  # its thread, and the jobs it starts, keep the normal priority
        _lower_priority(API_NICE)
        yield
        runner.stop()
        store.close()

    app = FastAPI(title="lmforge job server", version="1", lifespan=lifespan,
                  description="Submit, watch, stop and resume lmforge runs. Every /v1 route needs a bearer "
                  "token from `lmforge server token create`.")
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    app.state.store, app.state.runner, app.state.workspace = store, runner, workspace
    bearer = HTTPBearer(auto_error=False, description="a token from `lmforge server token create`")

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        if e.status == 429:
            headers = {"Retry-After": str(e.code)}
            return _error(429, str(e), None, "rate_limited", headers)
        return _error(e.status, str(e), e.param, e.code, headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"][1:]) or None
        return _error(400, f"{param}: {first['msg']}", param)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return _error(500, "internal server error")

    async def user_of(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:  # noqa: B008
        # async: a sync dependency would cost a hop to the thread pool on every request (the lookup is ~10 us)
        user = authenticate(store, f"Bearer {cred.credentials}" if cred else None)
        if user is None:
            raise RequestError(401, "a valid bearer token is required (Authorization: Bearer <token>; "
                               "`lmforge server token create` makes one)", code="invalid_token")
        return user

    def own_job(job_id: str, user: str) -> Job:
        try:
            check_job_id(job_id)
        except ConfinementError:
            raise RequestError(404, f"no job {job_id!r}", "id", "job_not_found") from None
        job = store.get(job_id)
        if job is None or job.user != user:  # another user's job is "not found": ids do not leak
            raise RequestError(404, f"no job {job_id!r}", "id", "job_not_found")
        return job

    def jdir(job: Job) -> Path:
        return workspace / "jobs" / job.id

    def view(job: Job) -> dict[str, Any]:
        return job_json(job, workspace, progress)

    @app.get("/health", tags=["server"])
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.post("/v1/jobs", status_code=201, tags=["jobs"],
              openapi_extra={"requestBody": {"content": {
                  "application/json": {"schema": {"type": "object", "properties": {
                      "kind": {"enum": ["train", "eval", "generate", "export"]},
                      "config": {"description": "the run's config: an object or YAML text"},
                      "set": {"type": "array", "items": {"type": "string"}}, "name": {"type": "string"},
                      "source": {"type": "string"}, "prompt": {"type": "string"},
                      "nproc": {"type": "integer"}}}},
                  "application/yaml": {"schema": {"type": "string"}}}}})
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
        job = await asyncio.to_thread(build_job, req, user, workspace, confiner, store.get, limits)
        try:
            store.add_job(job)
        except BaseException:  # nothing of a job that was not stored remains
            shutil.rmtree(jdir(job), ignore_errors=True)
            raise
        runner.wake()
        return view(job)

    @app.get("/v1/jobs", tags=["jobs"])
    async def list_jobs(status: str | None = Query(None, description="only jobs with this status"),
                        limit: int = Query(20, ge=1, le=100), after: str | None = Query(
                            None, description="the last id of the previous page"),
                        user: str = Depends(user_of)) -> JSONResponse:
        """The caller's jobs, newest first."""
        if status is not None and status not in STATUSES:
            raise RequestError(400, f"status {status!r} is not one of {', '.join(STATUSES)}", "status")
        after_seq = own_job(after, user).seq if after else None
        jobs = store.list(user=user, status=status, after_seq=after_seq, limit=limit + 1)
        more = len(jobs) > limit
        data = [view(j) for j in jobs[:limit]]
        return JSONResponse({"object": "list", "data": data, "has_more": more,
                             "last_id": data[-1]["id"] if data else None})

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    async def get_job(job_id: str, user: str = Depends(user_of)) -> JSONResponse:
        """One job: status, step / max_steps, latest training and validation metrics, ETA."""
        return JSONResponse(view(own_job(job_id, user)))  # a dashboard polls this: no response model

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"])
    async def cancel(job_id: str, user: str = Depends(user_of)) -> dict[str, Any]:
        """A queued job is cancelled at once; a running one gets SIGTERM and is cancelled when it stops."""
        job = own_job(job_id, user)
        if job.status in TERMINAL:
            raise RequestError(409, f"job {job_id} has already ended ({job.status})", "id", "job_ended")
        runner.cancel(job)
        return view(store.get(job.id) or job)

    @app.post("/v1/jobs/{job_id}/resume", tags=["jobs"])
    async def resume(job_id: str, user: str = Depends(user_of)) -> dict[str, Any]:
        """Queue a cancelled / interrupted / failed train job again; it continues from its last checkpoint."""
        job = own_job(job_id, user)
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
        return view(store.get(job.id) or job)

    @app.post("/v1/jobs/{job_id}/publish", tags=["jobs"])
    async def publish(job_id: str, request: Request, user: str = Depends(user_of)) -> dict[str, Any]:
        """Load a succeeded LoRA/DoRA train job's adapter into a running `lmforge serve` (one of the
        job server's --publish-url) as model `lora_name`."""
        job = own_job(job_id, user)
        if publisher is None:
            raise RequestError(409, "this job server publishes to no model server (its operator starts it "
                               "with --publish-url URL and the model server's admin key)", None, "no_publish")
        req = publisher.parse(await request.body())
        if job.kind != "train" or job.status != "succeeded":
            raise RequestError(409, f"job {job_id} ({job.kind}, {job.status}) has no finished adapter: only "
                               "a succeeded train job can be published", "id", "not_publishable")
        answer = await asyncio.to_thread(publisher.publish, jdir(job) / "run", req)
        return {"object": "lmforge.job.published", "id": job.id, "server_url": req.server_url,
                "lora_name": req.lora_name, "adapter": answer}

    @app.delete("/v1/jobs/{job_id}", tags=["jobs"])
    async def delete(job_id: str, artifacts: bool = False, user: str = Depends(user_of)) -> dict[str, Any]:
        """Forget a job that has ended; with artifacts=true its dir (run, logs, exports) goes too."""
        job = own_job(job_id, user)
        if job.status not in TERMINAL:
            raise RequestError(409, f"job {job_id} is {job.status}; cancel it first", "id", "job_active")
        users = [j for j in store.list(user=user) if j.source == job.id and j.status not in TERMINAL]
        if users:
            raise RequestError(409, f"job {users[0].id} ({users[0].kind}) is using job {job_id}; wait for it "
                               "or cancel it first", "id", "job_in_use")
        store.delete(job.id)
        progress.forget(job.id)
        if artifacts:
            await asyncio.to_thread(shutil.rmtree, jdir(job), True)
        return {"id": job.id, "object": "lmforge.job.deleted", "deleted": True,
                "artifacts_deleted": artifacts}

    @app.get("/v1/jobs/{job_id}/logs", tags=["jobs"])
    async def logs(job_id: str, tail: int = Query(100, ge=0, le=10000),
                   stream: str = Query("both", pattern="^(stdout|stderr|both)$"),
                   user: str = Depends(user_of)) -> dict[str, Any]:
        """The last `tail` lines of the job's stdout and/or stderr."""
        d = jdir(own_job(job_id, user))
        out: dict[str, Any] = {"object": "lmforge.job.logs", "id": job_id}
        for name, file in (("stdout", STDOUT), ("stderr", STDERR)):
            if stream in (name, "both"):
                out[name] = tail_lines(d / file, tail)
        return out

    def artifact_files(job: Job) -> dict[str, Path]:
        """name -> file: the job's logs and export, then its run dir's files (no checkpoints, data, dotfiles
        or links; at most three levels deep). A train job's config.yaml is the run's resolved config."""
        d = jdir(job)
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

    @app.get("/v1/jobs/{job_id}/artifacts", tags=["artifacts"])
    async def artifacts(job_id: str, user: str = Depends(user_of)) -> dict[str, Any]:
        """The job's downloadable files (the HF export appears as export.zip once an export job made it)."""
        files = await asyncio.to_thread(artifact_files, own_job(job_id, user))
        data = []
        for name, p in files.items():
            st = p.stat()
            data.append({"name": name, "bytes": st.st_size, "modified_at": int(st.st_mtime)})
        return {"object": "list", "data": data}

    @app.get("/v1/jobs/{job_id}/artifacts/{name:path}", tags=["artifacts"])
    async def artifact(job_id: str, name: str, user: str = Depends(user_of)):
        """One artifact's bytes, as they are at the moment of asking."""
        job = own_job(job_id, user)
        try:
            check_artifact_name(name)
        except ConfinementError as e:
            raise RequestError(400, str(e), "name", "bad_name") from None
        path = (await asyncio.to_thread(artifact_files, job)).get(name)
        if path is None:
            raise RequestError(404, f"job {job_id} has no artifact {name!r}", "name", "artifact_not_found")
        try:
            path = resolve_inside(jdir(job), str(path.relative_to(jdir(job))))  # no link out, at any level
        except ConfinementError as e:
            raise RequestError(404, str(e), "name", "artifact_not_found") from None
        return _snapshot(path, Path(name).name)

    @app.get("/v1/jobs/{job_id}/events", tags=["jobs"])
    async def events(job_id: str, request: Request, user: str = Depends(user_of)):
        """Server-sent events until the job ends: `status` (the job object at each change), `metrics` (each
        metrics.jsonl record, from the first), `log` ({stream, line}; from the last 64 KiB), then `end`."""
        job = own_job(job_id, user)
        return StreamingResponse(_events(job, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(job: Job, request: Request):
        d = jdir(job)
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
            now = store.get(job.id)
            if now is None:
                yield _sse("end", {"id": job.id, "status": "deleted"})
                return
            state = (now.status, now.attempts)
            if state != last:
                last = state
                yield _sse("status", view(now))
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

    from lmforge.api.dashboard import mount_dashboard  # the web page at /: a client of the routes above

    mount_dashboard(app)
    return app


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


def _lower_priority(by: int) -> None:
    """Raise the niceness of the calling thread only (Linux applies PRIO_PROCESS with who=0 per thread);
    threads it starts afterwards (asyncio.to_thread's pool) inherit it."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + by))
    except (AttributeError, OSError):  # not on this platform: same priority as the jobs
        pass


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
