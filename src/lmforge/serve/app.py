"""The HTTP side of `lmforge serve`: a FastAPI app with OpenAI's routes over an `Engine`.

    GET  /health                 no key needed
    GET  /v1/models              the served model (and /v1/models/{id})
    POST /v1/completions         prompt: a string, token ids, or a list of either
    POST /v1/chat/completions    messages rendered by the run's chat template
    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}, and /v1/unload_lora_adapter {"lora_name"}:
                                 only with an admin key, which they need instead of an API key

With adapters (serve/adapters.py) the request's `model` is the base's name or an adapter's, and
/v1/models lists the adapters too, each with its `parent` (vLLM's shape).

Every /v1 route needs `Authorization: Bearer KEY` (keys compared in constant time) unless the app was
made without keys; the check and a body size limit run before the body is read, in a plain ASGI
middleware. Errors are OpenAI's object {"error": {"message", "type", "param", "code"}}, with status
400 for bad requests (also malformed JSON and validation errors), 401, 404, 413 and 503. Streams are
server-sent events in OpenAI's chunk format ending with `data: [DONE]`; a client that disconnects
cancels its sequences.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import re
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
from lmforge.serve.grammar import GrammarError, json_grammar, regex_grammar
from lmforge.serve.logprobs import Shaper, TokenText, merge
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
ADMIN_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # their own key, not the API keys
RENDER_WORKERS = 2  # processes rendering an untrusted chat template: one refused render holds up no one
GRAMMAR_TIMEOUT_S = 10.0  # compiling a response_format (llguidance's fuel limits keep it far below)


class ApiError(HTTPException):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.message, self.code, self.param, self.type = message, code, param, type


def create_app(engine: Engine, tokenizer, template: ChatTemplate, *, model_name: str,
               api_keys: Sequence[str] | None, max_body_bytes: int = MAX_BODY_BYTES,
               admin_key: str | None = None) -> FastAPI:
    """The app serving `engine` (started and closed by the caller) under `model_name`.

    api_keys: the accepted keys; None serves without authentication (`--no-auth`). admin_key: enables
    the adapter admin routes (the engine's `adapters` must be set), which accept only it."""
    app = FastAPI(title="lmforge", docs_url=None, redoc_url=None, openapi_url=None)
    adapters = engine.adapters
    admin = admin_key is not None and adapters is not None
    app.add_middleware(_Guard, keys=None if api_keys is None else [k.encode() for k in api_keys],
                       max_body=max_body_bytes, own_auth=ADMIN_ROUTES if admin else ())
    created = now()
    if not template.trusted:
        pool().resize(max(pool().size, RENDER_WORKERS))
    token_text = TokenText(tokenizer)
    _add_error_handlers(app)
    _add_model_routes(app, engine, model_name, created)
    if admin:
        _add_admin_routes(app, adapters, admin_key.encode(), model_name)
    _add_completions_route(app, engine, tokenizer, model_name, token_text)
    _add_chat_route(app, engine, tokenizer, template, model_name, token_text)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; anything unexpected a bare 500 (no trace leaves the server)."""

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


def _add_model_routes(app: FastAPI, engine: Engine, model_name: str, created: int) -> None:
    """GET /health, /v1/models and /v1/models/{id}: what is served (the base and its adapters)."""
    adapters = engine.adapters
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "lmforge",
            "max_model_len": engine.max_len}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # Counts only (no prompts): how much of the prompts the prefix cache served.
        cache = getattr(engine, "prefix_cache", None)
        return {"status": "ok"} if cache is None else {"status": "ok", "prefix_cache": cache.stats.as_dict()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card, *(adapters.cards() if adapters is not None else ())]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        adapter = _route(model_id, model_name, adapters)
        return card if adapter is None else adapter.card(model_name)


def _add_admin_routes(app: FastAPI, adapters, secret: bytes, model_name: str) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which take the admin key `secret` only."""
    from lmforge.serve.adapters import LoadAdapterRequest, UnloadAdapterRequest

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        _check_admin(request, secret)
        body = _parse(await request.body(), LoadAdapterRequest)
        try:  # in a thread: reading an adapter takes a while and must not hold up the event loop
            adapter = await asyncio.to_thread(adapters.load, body.lora_name, body.lora_path)
        except LmforgeError as e:
            raise ApiError(400, str(e), param=getattr(e, "param", "lora_path")) from None
        return {"object": "lora_adapter", "id": adapter.name, "kind": adapter.kind, "rank": adapter.rank,
                "parent": model_name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        _check_admin(request, secret)
        body = _parse(await request.body(), UnloadAdapterRequest)
        try:
            adapters.unload(body.lora_name)
        except KeyError:
            raise ApiError(404, f"no adapter named `{body.lora_name}` is loaded", code="model_not_found",
                           param="lora_name") from None
        return {"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"}


def _add_completions_route(app: FastAPI, engine: Engine, tokenizer, model_name: str,
                           token_text: TokenText) -> None:
    """POST /v1/completions: raw prompts (text or token ids), with echo and logprobs."""
    adapters = engine.adapters

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _parse(await request.body(), CompletionRequest)
        adapter = _route(body.model, model_name, adapters)
        prompts = []
        for p in body.prompt_list():
            ids = (tokenizer.encode(p) or [tokenizer.eos_id]) if isinstance(p, str) else p  # "" -> EOS as BOS
            prompts.append(ids)
        params = _params(engine, body, prompts, body.max_tokens, frozenset({tokenizer.eos_id}), ())
        if adapter is not None:
            params = dataclasses.replace(params, adapter=adapter)
        k, shaper = body.logprobs_k(), None
        if k is not None or body.echo:
            echo = None
            if body.echo:  # the prompt as given, or the text of its token ids
                echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in body.prompt_list()]
            shaper = Shaper(token_text, chat=False, k=k, n=body.n, echo=echo)
            params = dataclasses.replace(params, logprobs=k, prompt_logprobs=k if body.echo else None)
        return await _respond(request, engine, body, prompts, params, body.model, chat=False, shaper=shaper)


def _add_chat_route(app: FastAPI, engine: Engine, tokenizer, template: ChatTemplate, model_name: str,
                    token_text: TokenText) -> None:
    """POST /v1/chat/completions: messages rendered by the run's chat template, with tools,
    response_format and logprobs."""
    adapters = engine.adapters
    specials = tokenizer.special_tokens()
    chat_stops = frozenset(stop_ids(template, tokenizer))
    # A template's end of turn that is not one token (ChatML over a tokenizer that was never
    # fine-tuned) still ends the reply: as a stop string.
    eot = template.end_of_turn
    chat_stop_text = (eot,) if eot and tokenizer.token_id(eot) is None else ()
    template_tools = TemplateTools(template)  # its tool markup, learned on the first request with tools

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = _parse(await request.body(), ChatCompletionRequest)
        adapter = _route(body.model, model_name, adapters)
        messages = body.conversation()
        _refuse_control_tokens(messages, specials)
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
        if adapter is not None:
            params = dataclasses.replace(params, adapter=adapter)
        if body.response_format is not None and body.response_format.type != "text":
            grammar = await _response_grammar(body.response_format, tokenizer)
            params = dataclasses.replace(params, grammar=grammar)
        if plan is not None and plan.mode != "auto":  # the call forced by the grammar, so it always parses
            if params.grammar is not None:
                raise ApiError(400, "'tool_choice' forces a call and 'response_format' a reply format; a "
                               "reply can follow one of them: leave one out", param="tool_choice")
            try:
                params = replace(params, grammar=await asyncio.to_thread(call_grammar, tokenizer, plan))
            except ToolsRefused as e:
                raise ApiError(400, str(e), param=e.param) from None
        shaper = None
        if (k := body.logprobs_k()) is not None:
            shaper = Shaper(token_text, chat=True, k=k)
            params = dataclasses.replace(params, logprobs=k)
        return await _respond(request, engine, body, [ids], params, body.model, chat=True, shaper=shaper,
                              plan=plan)


def _refuse_control_tokens(messages: list[dict[str, Any]], specials) -> None:
    """A 400 naming the first message field that holds a control token's text: it would be encoded as
    the token itself and could forge a turn."""
    for i, m in enumerate(messages):
        bad = next((s for s in specials if s and any(s in t for t in strings(m))), None)
        if bad is not None:
            where = next(f for f in ("content", "tool_calls", "tool_call_id", "name")
                         if any(bad in t for t in strings(m.get(f))))
            raise ApiError(400, f"messages[{i}].{where} contains the control token {bad!r}",
                           param=f"messages.{i}.{where}")


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


def _route(name: str, served: str, adapters):
    """The adapter a request's `model` names, None for the base (404 for anything else)."""
    if name == served or adapters is None:
        _check_model(name, served)
        return None
    adapter = adapters.get(name)
    if adapter is None:
        names = ", ".join(f"`{n}`" for n in [served, *adapters.names()])
        raise ApiError(404, f"The model `{name}` does not exist; this server serves {names}.",
                       code="model_not_found", param="model")
    return adapter


def _check_admin(request: Request, secret: bytes) -> None:
    """The admin routes take the admin key (not an API key) as the bearer token."""
    scheme, _, key = request.headers.get("authorization", "").encode().partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), secret):
        raise ApiError(401, "the adapter admin routes need the admin key: Authorization: Bearer ADMIN_KEY",
                       code="invalid_api_key", headers={"www-authenticate": "Bearer"})


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
        if param is None:  # a check across fields: its message begins with the field it refuses
            named = re.match(r"Value error, '(\w+)'", first["msg"])
            param = named.group(1) if named else None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {param}", param=param) from None
        parts = []
        for err in errors[:3]:
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        raise ApiError(400, "; ".join(parts), param=param) from None


async def _response_grammar(fmt, tokenizer):
    """The grammar of a response_format, compiled off the event loop within GRAMMAR_TIMEOUT_S; a schema
    or pattern that does not compile is a 400 naming response_format."""
    if fmt.type == "regex":
        job = (regex_grammar, tokenizer, fmt.regex)
    elif fmt.type == "json_object":
        job = (json_grammar, tokenizer, None)
    else:
        spec = fmt.json_schema
        job = (json_grammar, tokenizer, spec.schema_ if spec.schema_ is not None else {}, bool(spec.strict))
    try:
        return await asyncio.wait_for(asyncio.to_thread(*job), GRAMMAR_TIMEOUT_S)
    except TimeoutError:
        raise ApiError(400, f"response_format: the grammar did not compile within {GRAMMAR_TIMEOUT_S:g} s",
                       param="response_format") from None
    except LmforgeError as e:  # GrammarError, or the structured extra missing
        where = "" if isinstance(e, GrammarError) else "this server cannot constrain output: "
        raise ApiError(400, f"response_format: {where}{e}", param="response_format") from None


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
                          stop=(*body.stop_list(), *extra_stops), stop_ids=stop_ids_,
                          logit_bias=_bias(body, engine.vocab_size),
                          presence_penalty=body.presence_penalty or 0.0,
                          frequency_penalty=body.frequency_penalty or 0.0)


def _bias(body, vocab_size: int) -> tuple[tuple[int, float], ...]:
    pairs = body.bias_pairs()
    bad = next((t for t, _ in pairs if t >= vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"logit_bias names token {bad}, outside this model's vocabulary of {vocab_size} "
                       "tokens", param="logit_bias")
    return pairs


async def _respond(request: Request, engine: Engine, body, prompts: list[list[int]], params: SamplingParams,
                   model_name: str, chat: bool, shaper: Shaper | None = None, plan: ToolPlan | None = None):
    """Run the request on the engine; a JSON response, or an SSE stream with `stream`. shaper: the
    logprobs (and echoed prompts) of the reply, when the request asks. plan: a chat request's tools,
    whose calls are parsed out of each reply."""
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
                                         body.include_usage(), shaper, plan), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    texts, tokens, reasons = [""] * k, [0] * k, [None] * k
    pieces: list[list[dict]] = [[] for _ in range(k)]
    watcher = asyncio.create_task(_on_disconnect(request, queue))
    try:
        left = k
        while left:
            ev = await queue.get()
            if ev is None:  # the client went away: nobody reads the answer
                return JSONResponse(error_body(400, "client disconnected"), status_code=400)
            if ev.error is not None:
                raise ApiError(500, "generation failed (see the server's log)", type="server_error")
            text = ev.text
            if shaper is not None:
                text, piece = shaper.event(ev.index, text, ev.logprobs, ev.prompt_logprobs)
                if piece is not None:
                    pieces[ev.index].append(piece)
            texts[ev.index] += text
            tokens[ev.index] = ev.tokens
            if ev.finish_reason is not None:
                reasons[ev.index] = ev.finish_reason
                left -= 1
    finally:
        watcher.cancel()
        handle.cancel()  # a no-op once every choice has finished
    lps = [merge(p) if shaper is not None and shaper.k is not None else None for p in pieces]
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp,
                    "finish_reason": r} for i, (t, r, lp) in enumerate(zip(texts, reasons, lps))]
        for c in choices if plan is not None else ():
            content, calls = parse_reply(c["message"]["content"], plan.markup, plan.names, plan.parallel)
            if calls:
                c["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                c["finish_reason"] = "tool_calls"
    else:
        choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, lps))]
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
                  prompt_tokens: int, include_usage: bool, shaper: Shaper | None = None,
                  plan: ToolPlan | None = None):
    """Server-sent events: one chunk per piece of text or finish, then usage (if asked) and [DONE]. With
    tools, each choice's text goes through a StreamParser: content deltas, then tool_calls deltas.

    Logprobs with tools: a chunk lists the tokens generated since the choice's previous chunk (so its
    tokens' text may run ahead of its content, never behind). Tokens whose text the parser holds back
    wholly (what may begin a call) send no chunk: they ride with the next one (the one releasing that
    text, a tool_calls delta, or the finish); tokens turned into a tool_calls delta (the call's markup
    too) ride with it. No token is dropped (vLLM drops the held ones with their chunk), and the chunks'
    lists add up to the unstreamed reply's logprobs."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(choices: list[dict]) -> str:
        data = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
                **extra}
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    tokens = [0] * k
    parsers = [StreamParser(plan.markup, plan.names, plan.parallel) for _ in range(k)] if plan else None
    held: list[list[dict]] = [[] for _ in range(k)]  # with tools and logprobs: entries not yet sent

    def take(i: int) -> dict | None:
        if not held[i]:
            return None
        out, held[i] = {"content": held[i]}, []
        return out

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
                if shaper is not None:
                    _, piece = shaper.event(ev.index, ev.text, ev.logprobs, ev.prompt_logprobs)
                    held[ev.index] += piece["content"]
                for delta in p.feed(ev.text) + (p.finish() if ev.finish_reason is not None else []):
                    yield chunk([{"index": ev.index, "delta": delta, "logprobs": take(ev.index),
                                  "finish_reason": None}])
                if ev.finish_reason is not None:
                    reason = "tool_calls" if p.parsed else ev.finish_reason
                    yield chunk([{"index": ev.index, "delta": {}, "logprobs": take(ev.index),
                                  "finish_reason": reason}])
                    left -= 1
                continue
            text, piece = ev.text, None
            if shaper is not None:
                text, piece = shaper.event(ev.index, text, ev.logprobs, ev.prompt_logprobs)
            if not text and ev.finish_reason is None:
                continue
            choice = {"index": ev.index, "logprobs": piece, "finish_reason": ev.finish_reason}
            if chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
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

    def __init__(self, app, keys: list[bytes] | None, max_body: int, own_auth: Sequence[str] = ()) -> None:
        self.app, self.keys, self.max_body, self.own_auth = app, keys, max_body, frozenset(own_auth)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.keys is not None and scope["path"] not in self.own_auth:
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
