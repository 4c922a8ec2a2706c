"""GET /health: answers without a token (a load balancer's probe)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter


def health_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health", tags=["server"])
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    return router
