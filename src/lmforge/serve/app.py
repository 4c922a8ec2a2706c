"""The HTTP side of `lmforge serve`: a FastAPI app with OpenAI's routes over an `Engine`.

    GET  /health                 no key needed
    GET  /v1/models              the served model (and /v1/models/{id})
    POST /v1/completions         prompt: a string, token ids, or a list of either
    POST /v1/chat/completions    messages rendered by the run's chat template

Every /v1 route needs `Authorization: Bearer KEY` (keys compared in constant time) unless the app was
made without keys; the check and a body size limit run before the body is read, in a plain ASGI
middleware. Errors are OpenAI's object {"error": {"message", "type", "param", "code"}}, with status
400 for bad requests (also malformed JSON and validation errors), 401, 404, 413 and 503. Streams are
server-sent events in OpenAI's chunk format ending with `data: [DONE]`; a client that disconnects
cancels its sequences.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from lmforge.data.chat_template import ChatTemplate, stop_ids
from lmforge.data.chat_tools import strings
from lmforge.data.template_pool import pool
from lmforge.errors import LmforgeError
from lmforge.eval.chat import PromptTooLong, chat_prompt_ids
from lmforge.serve.engine import Engine, EngineBusy, Event, SamplingParams
from lmforge.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
    usage,
)
from lmforge.serve.tools import (
    StreamParser,
    TemplateTools,
    ToolPlan,
    ToolsRefused,
    call_grammar,
    parse_reply,
    plan_tools,
)
from lmforge.utils.jsontext import BadJSON, loads

MAX_BODY_BYTES = 1 << 20
RENDER_WORKERS = 2  # processes rendering an untrusted chat template: one refused render holds up no one


class ApiError(HTTPException):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.message, self.code, self.param, self.type = message, code, param, type


def create_app(engine: Engine, tokenizer, template: ChatTemplate, *, model_name: str,
               api_keys: Sequence[str] | None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app serving `engine` (started and closed by the caller) under `model_name`.

    api_keys: the accepted keys; None serves without authentication (`--no-auth`)."""
    app = FastAPI(title="lmforge", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, keys=None if api_keys is None else [k.encode() for k in api_keys],
                       max_body=max_body_bytes)
    created = now()
    if not template.trusted:
        pool().resize(max(pool().size, RENDER_WORKERS))
    specials = tokenizer.special_tokens()
    chat_stops = frozenset(stop_ids(template, tokenizer))
    # A template's end of turn that is not one token (ChatML over a tokenizer that was never
    # fine-tuned) still ends the reply: as a stop string.
    eot = template.end_of_turn
    chat_stop_text = (eot,) if eot and tokenizer.token_id(eot) is None else ()
    template_tools = TemplateTools(template)  # its tool markup, learned on the first request with tools

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        if isinstance(e, ApiError):
            body = error_body(e.status_code, e.message, e.type, e.code, e.param)
        else:  # routing: 404 no such route, 405 wrong method
            body = error_body(e.status_code, str(e.detail))
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, "internal server error"), status_code=500)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "lmforge",
            "max_model_len": engine.max_len}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(model_id, model_name)
        return card

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _parse(await request.body(), CompletionRequest)
        _check_model(body.model, model_name)
        prompts = []
        for p in body.prompt_list():
            ids = (tokenizer.encode(p) or [tokenizer.eos_id]) if isinstance(p, str) else p  # "" -> EOS as BOS
            prompts.append(ids)
        params = _params(engine, body, prompts, body.max_tokens, frozenset({tokenizer.eos_id}), ())
        return await _respond(request, engine, body, prompts, params, model_name, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = _parse(await request.body(), ChatCompletionRequest)
        _check_model(body.model, model_name)
        messages = body.conversation()
        for i, m in enumerate(messages):
            bad = next((s for s in specials if s and any(s in t for t in strings(m))), None)
            if bad is not None:  # it would be encoded as the token itself and could forge a turn
                where = next(f for f in ("content", "tool_calls", "tool_call_id", "name")
                             if any(bad in t for t in strings(m.get(f))))
                raise ApiError(400, f"messages[{i}].{where} contains the control token {bad!r}",
                               param=f"messages.{i}.{where}")
        plan = await _tool_plan(body, template_tools, template, specials)
        try:  # in a thread: an untrusted template's render waits on its worker, not on the event loop
            ids = await asyncio.to_thread(chat_prompt_ids, template, tokenizer, messages, engine.max_len,
                                          plan.tools if plan is not None else None)
        except PromptTooLong as e:
            raise ApiError(400, str(e), code="context_length_exceeded", param="messages") from None
        except LmforgeError as e:  # the template refused the conversation, or ran past its budget
            raise ApiError(400, f"the chat template cannot render these messages: {e}",
                           param="messages") from None
        params = _params(engine, body, [ids], body.limit(), chat_stops, chat_stop_text)
        if plan is not None and plan.mode != "auto":  # the call forced by the grammar, so it always parses
            if params.grammar is not None:
                raise ApiError(400, "'tool_choice' forces a call and 'response_format' a reply format; a "
                               "reply can follow one of them: leave one out", param="tool_choice")
            try:
                params = replace(params, grammar=await asyncio.to_thread(call_grammar, tokenizer, plan))
            except ToolsRefused as e:
                raise ApiError(400, str(e), param=e.param) from None
        return await _respond(request, engine, body, [ids], params, model_name, chat=True, plan=plan)

    return app


async def _tool_plan(body: ChatCompletionRequest, template_tools: TemplateTools, template: ChatTemplate,
                     specials) -> ToolPlan | None:
    """How the request's tools are served (None: it has none, or tool_choice "none", which answers as if
    it had none), or a 400 naming the field that cannot be honoured."""
    mode = body.tool_mode()
    if mode is None:
        return None
    tools = body.tool_dicts()
    for i, t in enumerate(tools):
        bad = next((s for s in specials if s and any(s in x for x in strings(t))), None)
        if bad is not None:
            raise ApiError(400, f"tools[{i}] contains the control token {bad!r}", param=f"tools.{i}")
    try:  # the first time, rendering probes through the template (its worker for an untrusted one)
        markup = await asyncio.to_thread(template_tools.markup)
        only = body.tool_choice.function.name if mode == "named" else None
        return plan_tools(tools, mode, only, body.parallel_tool_calls, markup, template.name)
    except ToolsRefused as e:
        raise ApiError(400, str(e), param=e.param) from None


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise ApiError(404, f"The model `{name}` does not exist; this server serves `{served}`.",
                       code="model_not_found", param="model")


def _parse(raw: bytes, schema):
    """The validated request, or a 400 saying what is wrong with the body."""
    try:
        obj = loads(raw)
    except BadJSON as e:
        if e.path is not None:  # well-formed JSON, but text no encoder can take
            raise ApiError(400, e.why, param=e.path or None) from None
        raise ApiError(400, f"the request body is not valid JSON: {e.why}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {param}", param=param) from None
        parts = []
        for err in errors[:3]:
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        raise ApiError(400, "; ".join(parts), param=param) from None


def _params(engine: Engine, body, prompts: list[list[int]], limit: int | None, stop_ids_: frozenset[int],
            extra_stops: tuple[str, ...]) -> SamplingParams:
    """The engine's parameters, after checking the prompts and max_tokens against the context."""
    context = engine.max_len
    longest = max(map(len, prompts))
    if longest >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                       f"{longest} tokens, which leaves no room for a reply; shorten the prompt.",
                       code="context_length_exceeded", param="messages" if hasattr(body, "messages")
                       else "prompt")
    if limit is not None and longest + limit > context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you "
                       f"requested {longest + limit} tokens ({longest} in the prompt, {limit} for the "
                       "completion). Reduce the prompt or max_tokens.", code="context_length_exceeded",
                       param="max_tokens")
    return SamplingParams(max_tokens=limit if limit is not None else context, temperature=body.temperature,
                          top_p=body.top_p, top_k=body.resolved_top_k(), n=body.n, seed=body.seed,
                          stop=(*body.stop_list(), *extra_stops), stop_ids=stop_ids_)


async def _respond(request: Request, engine: Engine, body, prompts: list[list[int]], params: SamplingParams,
                   model_name: str, chat: bool, plan: ToolPlan | None = None):
    """Run the request on the engine; a JSON response, or an SSE stream with `stream`. plan: a chat
    request's tools, whose calls are parsed out of each reply."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event | None] = asyncio.Queue()
    try:
        handle = engine.submit(prompts, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
    except EngineBusy as e:
        raise ApiError(503, f"the server is overloaded: {e}", code="overloaded") from None
    except LmforgeError as e:
        raise ApiError(400, str(e), param="prompt") from None
    k = len(prompts) * params.n
    prompt_tokens = sum(map(len, prompts))
    rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
    obj = "chat.completion" if chat else "text_completion"
    if body.stream:
        return StreamingResponse(_stream(queue, handle, k, rid, created, model_name, chat, prompt_tokens,
                                         body.include_usage(), plan), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    texts, tokens, reasons = [""] * k, [0] * k, [None] * k
    watcher = asyncio.create_task(_on_disconnect(request, queue))
    try:
        left = k
        while left:
            ev = await queue.get()
            if ev is None:  # the client went away: nobody reads the answer
                return JSONResponse(error_body(400, "client disconnected"), status_code=400)
            if ev.error is not None:
                raise ApiError(500, "generation failed (see the server's log)", type="server_error")
            texts[ev.index] += ev.text
            tokens[ev.index] = ev.tokens
            if ev.finish_reason is not None:
                reasons[ev.index] = ev.finish_reason
                left -= 1
    finally:
        watcher.cancel()
        handle.cancel()  # a no-op once every choice has finished
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
        for c in choices if plan is not None else ():
            content, calls = parse_reply(c["message"]["content"], plan.markup, plan.names, plan.parallel)
            if calls:
                c["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                c["finish_reason"] = "tool_calls"
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
            "usage": usage(prompt_tokens, sum(tokens))}


async def _on_disconnect(request: Request, queue: asyncio.Queue) -> None:
    """Wake the handler with None when the client disconnects (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(None)
            return


async def _stream(queue: asyncio.Queue, handle, k: int, rid: str, created: int, model_name: str, chat: bool,
                  prompt_tokens: int, include_usage: bool, plan: ToolPlan | None = None):
    """Server-sent events: one chunk per piece of text or finish, then usage (if asked) and [DONE]. With
    tools, each choice's text goes through a StreamParser: content deltas, then tool_calls deltas."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(choices: list[dict]) -> str:
        data = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
                **extra}
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    tokens = [0] * k
    parsers = [StreamParser(plan.markup, plan.names, plan.parallel) for _ in range(k)] if plan else None
    try:
        if chat:  # OpenAI opens each choice with the assistant's role
            for i in range(k):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        left = k
        while left:
            ev = await queue.get()
            if ev.error is not None:
                body = error_body(500, "generation failed (see the server's log)", type="server_error")
                yield f"data: {json.dumps(body)}\n\n"
                break
            tokens[ev.index] = ev.tokens
            if parsers is not None:
                p = parsers[ev.index]
                for delta in p.feed(ev.text) + (p.finish() if ev.finish_reason is not None else []):
                    yield chunk([{"index": ev.index, "delta": delta, "logprobs": None,
                                  "finish_reason": None}])
                if ev.finish_reason is not None:
                    reason = "tool_calls" if p.parsed else ev.finish_reason
                    yield chunk([{"index": ev.index, "delta": {}, "logprobs": None, "finish_reason": reason}])
                    left -= 1
                continue
            if not ev.text and ev.finish_reason is None:
                continue
            choice = {"index": ev.index, "logprobs": None, "finish_reason": ev.finish_reason}
            if chat:
                choice["delta"] = {"content": ev.text} if ev.text else {}
            else:
                choice["text"] = ev.text
            yield chunk([choice])
            if ev.finish_reason is not None:
                left -= 1
        else:
            if include_usage:
                data = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                        "usage": usage(prompt_tokens, sum(tokens))}
                yield f"data: {json.dumps(data)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()


class _Guard:
    """ASGI middleware for /v1: the API key check, then the body size limit, before the body is read."""

    def __init__(self, app, keys: list[bytes] | None, max_body: int) -> None:
        self.app, self.keys, self.max_body = app, keys, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.keys is not None:
            problem = self._auth(headers.get(b"authorization"))
            if problem is not None:
                # Closing the connection: a body the client may still be sending is never read.
                return await _send_error(send, 401, problem, "invalid_api_key",
                                         {"www-authenticate": "Bearer", "connection": "close"})
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _send_error(send, 413, f"the request body exceeds {self.max_body} bytes",
                                     "request_too_large", {"connection": "close"})
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise ApiError(413, f"the request body exceeds {self.max_body} bytes",
                               code="request_too_large", headers={"connection": "close"})
            return message

        await self.app(scope, counted, send)

    def _auth(self, header: bytes | None) -> str | None:
        """Why the request is refused, or None for a valid key."""
        if not header:
            return ("You didn't provide an API key. You need to provide your API key in an Authorization "
                    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        scheme, _, key = header.partition(b" ")
        ok = False
        for k in self.keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(key.strip(), k)
        if scheme.lower() != b"bearer" or not ok:
            return "Incorrect API key provided."
        return None


async def _send_error(send, status: int, message: str, code: str, headers: dict[str, str]) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
