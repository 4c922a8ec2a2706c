"""Rating studies (human evaluation, jobserver/rating.py) and their page.

    POST   /v1/studies                           create: prompts and two systems' answers (or train jobs)
    GET    /v1/studies                           the studies the caller owns or rates
    GET    /v1/studies/{id}                      a rater: progress and next item; the owner: labels too
    GET    /v1/studies/{id}/items/{index}        a rater: the prompt, answers A and B, their saved choice
    POST   /v1/studies/{id}/items/{index}        a rater: {choice: A | B | tie, comment} (idempotent)
    GET    /v1/studies/{id}/results?format=      the owner: win rates, CIs, kappa (json or markdown)
    GET    /v1/studies/{id}/pairs                the owner: preference pairs JSONL for `lmforge dpo`
    DELETE /v1/studies/{id}                      the owner: the study, its items and ratings
    GET    /rate                                 the rating page (no data; it asks for a token)

A study someone neither owns nor rates is "not found", as a missing one; a rater gets nothing that says
which run wrote which answer, and the owner (unless listed as a rater) cannot rate.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, PlainTextResponse, Response

from lmforge.jobserver.dashboard import _HEADERS, STATIC
from lmforge.jobserver.jobs import RequestError, _source
from lmforge.jobserver.rating import (
    CHOICES,
    MAX_COMMENT_CHARS,
    RatingStore,
    Study,
    check_study_id,
    choice_of,
    parse_study,
    winner_of,
    x_is_a,
)
from lmforge.jobserver.rating_gen import start_filling
from lmforge.jobserver.rating_stats import markdown, pairs_jsonl, preference_pairs, results
from lmforge.jobserver.routes.state import JobsState


class _Access:
    """Who sees what of a study: the role checks and the two views (a rater's: nothing about the runs)."""

    def __init__(self, ratings: RatingStore) -> None:
        self.ratings = ratings

    def study(self, study_id: str, user: str, role: str) -> Study:
        """The study, if `user` has `role` in it ("rater", "owner" or "any"); else 404, as a missing one."""
        check_study_id(study_id)
        s = self.ratings.get(study_id)
        if s is None or not ((role in ("owner", "any") and s.owner == user)
                             or (role in ("rater", "any") and user in s.raters)):
            raise RequestError(404, f"no study {study_id!r}" + (" that you rate" if s and s.owner == user
                                                                 else ""), "id", "study_not_found")
        return s

    def rater_view(self, s: Study, user: str) -> dict[str, Any]:
        rated = [r["idx"] for r in self.ratings.ratings(s.id, user)]
        todo = sorted(set(range(s.n_items)) - set(rated))
        return {"id": s.id, "object": "lmforge.study", "name": s.name, "status": s.status, "items": s.n_items,
                "rated": sorted(rated), "next": todo[0] if todo else None}

    def owner_view(self, s: Study) -> dict[str, Any]:
        done: dict[str, int] = {r: 0 for r in s.raters}
        for row in self.ratings.ratings(s.id):
            done[row["rater"]] = done.get(row["rater"], 0) + 1
        return {"id": s.id, "object": "lmforge.study", "name": s.name, "status": s.status, "error": s.error,
                "items": s.n_items, "labels": s.labels, "sources": s.sources, "raters": s.raters,
                "progress": done, "created_at": int(s.created_at)}

    def view(self, s: Study, user: str) -> dict[str, Any]:
        out = self.owner_view(s) if s.owner == user else {}
        if user in s.raters:
            out.update(self.rater_view(s, user))
        out["role"] = [r for r, ok in (("owner", s.owner == user), ("rater", user in s.raters)) if ok]
        return out

    def item(self, s: Study, index: int, user: str):
        """The item's row and whether X is answer A for `user`; 409 while the answers are being made."""
        if s.status != "ready":
            raise RequestError(409, f"study {s.id} is {s.status}" + (f": {s.error}" if s.error else
                               "; its answers are being generated"), "id", "study_not_ready")
        row = self.ratings.item(s.id, index) if 0 <= index < s.n_items else None
        if row is None:
            raise RequestError(404, f"study {s.id} has items 0-{s.n_items - 1}; no item {index}", "index",
                               "item_not_found")
        return row, x_is_a(s.secret, user, index)


def _json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not JSON: {e}") from None


def rating_router(state: JobsState, user_of: Callable, ratings: RatingStore) -> APIRouter:
    """The study routes and the /rate page; `user_of` is the bearer-token dependency."""
    router = APIRouter()
    access = _Access(ratings)
    _study_routes(router, state, user_of, access)
    _rater_routes(router, user_of, access)
    _owner_routes(router, user_of, access)

    @router.get("/rate", include_in_schema=False)
    async def page() -> FileResponse:
        # the page holds no data (it asks for a token), like the dashboard's, with the same headers
        return FileResponse(STATIC / "rate.html", media_type="text/html", headers=_HEADERS)

    return router


def _study_routes(router: APIRouter, state: JobsState, user_of: Callable, access: _Access) -> None:
    ratings = access.ratings

    @router.post("/v1/studies", status_code=201, tags=["rating"])
    async def create(request: Request, user: str = Depends(user_of)) -> dict[str, Any]:
        """A study of two systems' answers to the same prompts: each side {label, answers} (a list or JSONL
        text with an "answer" per line) or {job} (a finished train job of yours; the server generates)."""
        req = parse_study(_json_body(await request.body()), user)
        runs = {}
        for side, spec in req["sides"].items():
            if spec["job"] is not None:
                try:
                    job = _source(spec["job"], user, state.store.get, state.workspace)
                except RequestError as e:
                    raise RequestError(e.status, f"{side}.job: {e}", f"{side}.job", e.code) from None
                if job.status != "succeeded":  # a run still training would answer from a moving checkpoint
                    raise RequestError(409, f"{side}.job: job {job.id} is {job.status}; a study needs a "
                                       "train job that succeeded", f"{side}.job", "source_not_ready")
                runs[side] = state.job_dir(job) / "run"
        s = await asyncio.to_thread(ratings.create, req)
        if runs:
            start_filling(ratings, s.id, runs, req["prompts"], req["max_new_tokens"],
                          state.limits.max_memory_per_job, state.limits.max_threads_per_job,
                          state.workspace / "rating-work")
        return access.view(s, user)

    @router.get("/v1/studies", tags=["rating"])
    async def list_studies(user: str = Depends(user_of)) -> dict[str, Any]:
        """The studies you own or rate, newest first."""
        return {"object": "list", "data": [access.view(s, user) for s in ratings.visible(user)]}

    @router.get("/v1/studies/{study_id}", tags=["rating"])
    async def get_study(study_id: str, user: str = Depends(user_of)) -> dict[str, Any]:
        """For a rater: the items rated and the next one; for the owner: labels, status and progress."""
        return access.view(access.study(study_id, user, "any"), user)

    @router.delete("/v1/studies/{study_id}", tags=["rating"])
    async def delete(study_id: str, user: str = Depends(user_of)) -> dict[str, Any]:
        """Delete the study, its items and its ratings (refused while its answers are being generated)."""
        s = access.study(study_id, user, "owner")
        if s.status == "generating":
            raise RequestError(409, f"study {s.id} is generating its answers; delete it when that ends", "id",
                               "study_generating")
        await asyncio.to_thread(ratings.delete, s.id)
        return {"id": s.id, "object": "lmforge.study.deleted", "deleted": True}


def _rater_routes(router: APIRouter, user_of: Callable, access: _Access) -> None:
    ratings = access.ratings

    @router.get("/v1/studies/{study_id}/items/{index}", tags=["rating"])
    async def get_item(study_id: str, index: int, user: str = Depends(user_of)) -> dict[str, Any]:
        """The prompt and the two answers in your order for this item (the same every time you ask)."""
        s = access.study(study_id, user, "rater")
        row, x_first = access.item(s, index, user)
        mine = [r for r in ratings.ratings(s.id, user) if r["idx"] == index]
        a, b = (row["answer_x"], row["answer_y"]) if x_first else (row["answer_y"], row["answer_x"])
        return {"index": index, "items": s.n_items, "prompt": row["prompt"], "a": a, "b": b,
                "choice": choice_of(mine[0]["winner"], x_first) if mine else None,
                "comment": mine[0]["comment"] if mine else ""}

    @router.post("/v1/studies/{study_id}/items/{index}", tags=["rating"])
    async def rate(study_id: str, index: int, request: Request,
                   user: str = Depends(user_of)) -> dict[str, Any]:
        """Save your choice on this item: {"choice": "A" | "B" | "tie", "comment": "..."}; the same request
        again changes nothing, another choice replaces the first."""
        s = access.study(study_id, user, "rater")
        _, x_first = access.item(s, index, user)
        body = _json_body(await request.body())
        if not isinstance(body, dict) or set(body) - {"choice", "comment"}:
            raise RequestError(400, 'the body is {"choice": "A" | "B" | "tie", "comment": "..."}', "choice")
        choice, comment = body.get("choice"), body.get("comment", "")
        if choice not in CHOICES:
            raise RequestError(400, f"choice: one of {', '.join(CHOICES)}, not {choice!r}", "choice")
        if not isinstance(comment, str) or len(comment) > MAX_COMMENT_CHARS:
            raise RequestError(400, f"comment: text of at most {MAX_COMMENT_CHARS} characters", "comment")
        await asyncio.to_thread(ratings.rate, s.id, user, index, winner_of(choice, x_first), comment)
        return {"index": index, "choice": choice, "comment": comment, **access.rater_view(s, user)}


def _owner_routes(router: APIRouter, user_of: Callable, access: _Access) -> None:
    ratings = access.ratings

    @router.get("/v1/studies/{study_id}/results", tags=["rating"])
    async def get_results(study_id: str, format: str = Query("json", pattern="^(json|markdown)$"),
                          user: str = Depends(user_of)):
        """Win rate of X over Y (ties half; 95% Wilson interval) pooled and per rater, and Cohen's (two
        raters) or Fleiss' (more) kappa; format=markdown for a report."""
        s = access.study(study_id, user, "owner")
        res = results(s, ratings.ratings(s.id))
        if format == "markdown":
            return PlainTextResponse(markdown(res), media_type="text/markdown; charset=utf-8")
        return res

    @router.get("/v1/studies/{study_id}/pairs", tags=["rating"])
    async def get_pairs(study_id: str, user: str = Depends(user_of)) -> Response:
        """Preference pairs {prompt, chosen, rejected} as JSONL (`lmforge dpo`'s data): one per item that
        its raters' non-tie choices favour one way."""
        s = access.study(study_id, user, "owner")
        body = pairs_jsonl(preference_pairs(ratings.items(s.id), ratings.ratings(s.id)))
        return Response(body, media_type="application/x-ndjson", headers={
            "Content-Disposition": f'attachment; filename="{s.id}-pairs.jsonl"'})
