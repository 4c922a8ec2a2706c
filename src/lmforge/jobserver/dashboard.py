"""The dashboard of `lmforge jobs`: one static page (static/index.html, app.js, app.css and a vendored
uPlot 1.6.32, MIT) that is a thin client of the job API.

The page and its files need no token: they hold no data. The page asks for a bearer token, keeps it in
sessionStorage and sends it on every /v1 call (the event stream is read with fetch(), since EventSource
cannot send an Authorization header), so the API's auth and ownership rules are the dashboard's too.

    GET /                 the page
    GET /static/{file}    its scripts, styles and the charting library
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"

# The page runs only its own files: no inline script or style, no other origin, not framed. Data shown on
# it is inserted as text (never as HTML), and this policy is the second line should that ever slip.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'")
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


class _Static(StaticFiles):
    """StaticFiles that adds the page's security headers to every file it serves."""

    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        response.headers.update(_HEADERS)
        return response


def mount_dashboard(app: FastAPI) -> None:
    """Serve the dashboard page at / and its files under /static on `app` (the job server)."""

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=_HEADERS)

    app.mount("/static", _Static(directory=STATIC, html=False), name="dashboard-static")
