"""Who is calling: the bearer-token dependency of every /v1 route (tokens are made by `lmforge jobs
token create`; jobserver/auth.py checks them)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from lmforge.jobserver.auth import authenticate
from lmforge.jobserver.jobs import RequestError
from lmforge.jobserver.store import Store


def bearer_user(store: Store) -> Callable[..., Awaitable[str]]:
    """A FastAPI dependency: the user whose token the request carries, or a 401."""
    bearer = HTTPBearer(auto_error=False, description="a token from `lmforge jobs token create`")

    async def user_of(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:  # noqa: B008
        # async: a sync dependency would cost a hop to the thread pool on every request (the lookup is ~10 us)
        user = authenticate(store, f"Bearer {cred.credentials}" if cred else None)
        if user is None:
            raise RequestError(401, "a valid bearer token is required (Authorization: Bearer <token>; "
                               "`lmforge jobs token create` makes one)", code="invalid_token")
        return user

    return user_of
