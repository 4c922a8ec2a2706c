"""The job server's HTTP edge: one error shape, the request-body limit, and the exception handlers that
put every failure into that shape.

Errors are {"error": {"message", "type", "param", "code"}} (OpenAI's shape); a 500 says only "internal
server error", never a traceback.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lmforge.jobserver.jobs import RequestError

MAX_BODY_BYTES = 1 << 20


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class BodyLimit:
    """Refuse a body over `limit` bytes (413) by its Content-Length or while it streams in."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope["headers"]:
            if k == b"content-length" and (not v.isdigit() or int(v) > self.limit):
                return await error_response(413, f"the request body is larger than {self.limit} bytes",
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


def install_error_handlers(app: FastAPI) -> None:
    """Answer every exception a route raises in the one error shape."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        if e.status == 429:
            headers = {"Retry-After": str(e.code)}
            return error_response(429, str(e), None, "rate_limited", headers)
        return error_response(e.status, str(e), e.param, e.code, headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"][1:]) or None
        return error_response(400, f"{param}: {first['msg']}", param)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return error_response(500, "internal server error")
