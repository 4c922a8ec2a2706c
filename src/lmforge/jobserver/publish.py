"""POST /v1/jobs/{id}/publish {"server_url", "lora_name"}: a finished LoRA / DoRA train job's adapter
onto a running `lmforge serve`, through that server's admin route /v1/load_lora_adapter (vLLM's shape).

The operator names the model servers this job server may publish to (`lmforge jobs --publish-url
URL`, repeatable) and holds their admin key (`--publish-key`, default $LMFORGE_ADMIN_KEY): a user
names one of those URLs, never an address of their own choosing, so the key goes nowhere else and the
job server cannot be made to call arbitrary hosts. The model server reads the adapter from the job's
run dir, so its `--adapter-root` must contain this job server's workspace jobs/ dir (the same
filesystem); it checks the adapter against its base and refuses a mismatch, which is answered here
with its message."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmforge.errors import LmforgeError
from lmforge.jobserver.jobs import RequestError

TIMEOUT_S = 300.0  # reading an adapter from a run dir loads its checkpoint


class PublishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    server_url: str = Field(max_length=2048, description="one of the job server's --publish-url")
    lora_name: str = Field(max_length=128, description="the model name the adapter is served under")


def normalize_url(url: str, what: str = "--publish-url") -> str:
    """http(s)://host[:port] of a model server, without a trailing / or /v1 (both forms are accepted)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LmforgeError(f"{what} {url!r}: give the model server's URL, e.g. http://127.0.0.1:8000/v1")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise LmforgeError(f"{what} {url!r}: no credentials, query or fragment in the URL (the admin key "
                           "is sent as a header)")
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc.lower(), path, "", ""))


class Publisher:
    """Where this job server may publish adapters, and the admin key it sends there."""

    def __init__(self, urls: Sequence[str], key: str | None) -> None:
        if not urls:
            raise LmforgeError("give at least one --publish-url")
        if not key or key != key.strip() or not key.isprintable():
            raise LmforgeError("publishing needs the model server's admin key: --publish-key KEY or "
                               "$LMFORGE_ADMIN_KEY (printable, no surrounding spaces)")
        self.urls = tuple(dict.fromkeys(normalize_url(u) for u in urls))
        self.key = key

    def parse(self, raw: bytes) -> PublishRequest:
        try:
            req = PublishRequest.model_validate_json(raw or b"{}")
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            param = ".".join(str(x) for x in first["loc"]) or None
            raise RequestError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None
        try:
            url = normalize_url(req.server_url, "server_url")
        except LmforgeError as e:
            raise RequestError(400, str(e), "server_url") from None
        if url not in self.urls:
            raise RequestError(400, f"server_url {req.server_url!r} is not a model server this job server "
                               f"publishes to; it publishes to {', '.join(self.urls)}", "server_url",
                               "unknown_server")
        return req.model_copy(update={"server_url": url})

    def publish(self, run_dir: Path, req: PublishRequest) -> dict[str, Any]:
        """Ask the model server to load the adapter of `run_dir` as req.lora_name; its answer."""
        body = json.dumps({"lora_name": req.lora_name, "lora_path": str(run_dir)}).encode()
        http = urllib.request.Request(f"{req.server_url}/v1/load_lora_adapter", data=body, method="POST",
                                      headers={"Content-Type": "application/json",
                                               "Authorization": f"Bearer {self.key}"})
        try:
            with _opener().open(http, timeout=TIMEOUT_S) as r:
                return json.loads(r.read(1 << 20))
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read(1 << 16))["error"]
                message, param = str(err["message"]), err.get("param")
            except (ValueError, KeyError, TypeError):
                message, param = f"HTTP {e.code}", None
            if e.code in (401, 404):  # our key, or a server without the admin routes: the operator's setup
                raise RequestError(502, f"the model server at {req.server_url} refused to load adapters "
                                   f"({e.code}: {message}); it needs --adapter-root and the admin key "
                                   "this job server holds", "server_url", "publish_refused") from None
            status = e.code if 400 <= e.code < 500 else 502
            raise RequestError(status, f"the model server refused the adapter: {message}",
                               "lora_name" if param == "lora_name" else None, "publish_refused") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise RequestError(502, f"cannot reach the model server at {req.server_url}: {reason}",
                               "server_url", "server_unreachable") from None


def _opener() -> urllib.request.OpenerDirector:
    """No proxies from the environment and no redirects: the key goes to the configured URL only."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    return urllib.request.build_opener(urllib.request.ProxyHandler({}), NoRedirect)
