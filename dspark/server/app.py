"""The OpenAI-compatible HTTP app: ``build_app(engine_client, served_model_name, api_key=None)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{model}``,
``GET /health``, ``GET /metrics`` (Prometheus), ``GET /version`` and ``GET /debug/kv`` (KV-cache
integrity and queue sizes, for tests and operators).

Every error is OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON and invalid values (the message names the field), 401 for a missing or wrong API key, 404 for
an unknown model or route, 405 for a wrong method, 413 for a body over the limit, 422 for a body that
does not match the schema (wrong types, missing fields), 503 when the engine has failed. A client
mistake never yields a 5xx.

A client that disconnects (streaming or not) has its engine requests aborted at once, which frees
their KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.engine.llm_engine import RequestOutput
from dspark.sampling_params import InvalidRequestError
from dspark.server.engine_client import EngineClient, EngineDeadError, GenerationSpec, PromptTooLongError, RequestGroup
from dspark.server.defaults import DEFAULT_MAX_BODY_BYTES
from dspark.server.metrics import ServerMetrics
from dspark.server.protocol import (
    BadRequest,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    now,
    random_id,
)

logger = logging.getLogger("dspark.server")

_DRAIN_LIMIT = 64 * 2**20  # an oversized body is read (and dropped) up to this much before the 413
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_STATUS_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
_ERROR_RESPONSES = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 422, 503)}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type or _STATUS_TYPE.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# ---------------------------------------------------------------------- ASGI middleware
class GuardMiddleware:
    """Pure ASGI: API-key check, body-size limit (413) and HTTP request counting.

    The body of a POST is read here (up to the limit) and replayed to the app, so the 413 is sent
    before FastAPI parses anything; later ``receive`` calls go to the server (disconnect detection).
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        status_box = [500]

        async def send_counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, send_counted, path)
        finally:
            self.metrics.observe_http(path, status_box[0])

    async def _handle(self, scope: dict, receive: Any, send: Any, path: str) -> None:
        if self.api_key is not None and (path.startswith("/v1") or path.startswith("/debug")):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                msg = ("Missing API key: send 'Authorization: Bearer <key>'." if not auth else
                       "Incorrect API key provided.")
                resp = error_response(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        if scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                await error_response(400, "invalid Content-Length header")(scope, receive, send)
                return
            if n > self.max_body_bytes:
                await self._drain(receive)
                await self._too_large(n, scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, size)
                await self._too_large(size, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _drain(self, receive: Any, seen: int = 0) -> None:
        while seen < _DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _too_large(self, size: int, scope: dict, receive: Any, send: Any) -> None:
        resp = error_response(413, f"request body too large: {size} bytes exceeds the limit of "
                                   f"{self.max_body_bytes} bytes", code="request_too_large")
        await resp(scope, receive, send)


# ---------------------------------------------------------------------- helpers
def _all_field_names() -> frozenset[str]:
    from pydantic import BaseModel

    from dspark.server import protocol

    names: set[str] = set()
    for obj in vars(protocol).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not BaseModel:
            names.update(obj.model_fields)
    return frozenset(names)


_FIELD_NAMES = _all_field_names()
_UNSUPPORTED = {
    "logit_bias": "logit_bias is not supported (send null or {})",
    "suffix": "suffix is not supported (send null or '')",
    "tools": "tools are not supported (send null or [])",
    "tool_choice": "tool_choice is not supported (send null or 'none')",
    "response_format": "only response_format {'type': 'text'} is supported",
}


def _validation_message(errors: list[dict]) -> tuple[int, str, str | None]:
    """Turn pydantic/FastAPI errors into (status, message, param)."""
    if not errors:
        return 422, "invalid request", None
    for e in errors:
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx") or {}
            detail = ctx.get("error") or e.get("msg", "")
            return 400, f"malformed JSON in the request body: {detail}", None
    for e in errors:
        if e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body",):
            return 400, "the request body must be a JSON object", None
    parts: list[str] = []
    first_param = None
    for e in errors:
        loc = _field_path(e.get("loc", ()))
        where = ".".join(loc) or "body"
        first_param = first_param or (where if loc else None)
        if loc and loc[0] in _UNSUPPORTED:
            part = f"{loc[0]}: {_UNSUPPORTED[loc[0]]}"
        else:
            part = f"{where}: {e.get('msg', 'invalid')}"
        if part not in parts:
            parts.append(part)
    more = f" (and {len(parts) - 8} more errors)" if len(parts) > 8 else ""
    return 422, "; ".join(parts[:8]) + more, first_param


def _field_path(loc: Any) -> list[str]:
    """The request-field part of a pydantic error location: drops 'body' and union-member tags such as
    'constrained-str' or 'list[int]', keeping field names and list indices."""
    out = []
    for x in loc:
        if isinstance(x, int):
            out.append(str(x))
        elif x != "body" and x in _FIELD_NAMES:
            out.append(x)
    return out


def _sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _watch_disconnect(request: Request, on_disconnect: Any) -> None:
    """Wait for the client to go away (the body has been read already), then call ``on_disconnect``."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # the server's receive failed: treat as gone
        on_disconnect()


class _ChoiceState:
    """Streaming text of one choice. Text is sent from ``out.text`` (the engine's full text), holding
    back len(longest stop string) - 1 characters while unfinished, so text a stop string later cuts is
    never sent."""

    __slots__ = ("sent", "holdback", "num_tokens", "finish_reason", "stop_reason", "started", "offset")

    def __init__(self, holdback: int) -> None:
        self.sent = 0
        self.holdback = holdback
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.started = False
        self.offset = 0  # text offset of the next logprob token (completions)

    def advance(self, out: RequestOutput) -> str:
        text = out.text
        end = len(text) if out.finished else max(self.sent, len(text) - self.holdback)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        self.num_tokens = len(out.token_ids)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
        return delta


# ---------------------------------------------------------------------- the app
def build_app(engine_client: EngineClient, served_model_name: str | list[str] | None = None,
              api_key: str | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              metrics: ServerMetrics | None = None) -> FastAPI:
    if isinstance(served_model_name, (list, tuple)):
        names = [n for n in served_model_name if n] or [engine_client.model_name]
    else:
        names = [served_model_name or engine_client.model_name]
    model_name = names[0]
    accepted = set(names)
    metrics = metrics or ServerMetrics(model_name, engine_client)
    metrics.engine_client = engine_client
    if engine_client.observer is None:
        engine_client.observer = metrics
    created = now()
    in_flight = [0]  # generation handlers between submit and their last output
    tokenizer = engine_client.tokenizer
    max_model_len = engine_client.max_model_len

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine_client.start()
        watch = sys.modules.get("dspark.kernels.compile_watch")  # loaded by a CUDA engine (kernels/compile_watch.py)
        if watch is not None:
            watch.arm()  # serving: a Triton compile from now on is a stall the warm-up missed, logged
        try:
            yield
        finally:
            await engine_client.shutdown()

    app = FastAPI(
        title="dspark OpenAI-compatible server",
        version=_version(),
        lifespan=lifespan,
        description="OpenAI-compatible completions and chat completions served by the dspark engine.",
    )
    app.state.engine_client = engine_client
    app.state.metrics = metrics
    app.state.served_model_names = names
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        status, msg, param = _validation_message(list(exc.errors()))
        return error_response(status, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and msg == "Not Found":
            msg = "no such route"
        if getattr(exc, "model_not_found", False):
            return error_response(404, msg, param="model", code="model_not_found")
        return error_response(exc.status_code, msg, headers=getattr(exc, "headers", None))

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), getattr(exc, "param", None))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), code="engine_unavailable")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal server error: {type(exc).__name__}")

    def check_model(model: str | None) -> None:
        if model is not None and model not in accepted:
            raise ModelNotFound(model)

    # ------------------------------------------------------------------ plain routes
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not engine_client.alive:
            return error_response(503, "the engine is not running", code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _card(name: str) -> ModelCard:
        return ModelCard(id=name, created=created, root=engine_client.model_name, max_model_len=max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[_card(n) for n in names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def get_model(model: str) -> ModelCard:
        check_model(model)
        return _card(model)

    @app.get("/debug/kv", responses=_ERROR_RESPONSES)
    async def debug_kv() -> dict:
        """KV-cache integrity check (``check_integrity``) and queue sizes, read between engine steps."""
        state = await engine_client.debug_state()
        state["engine_alive"] = engine_client.alive
        state["http_generations_in_flight"] = in_flight[0]
        return state

    # ------------------------------------------------------------------ generation helpers
    def decode_token(tid: int) -> str:
        if tokenizer is None:
            return f"<{tid}>"
        try:
            return tokenizer.decode([tid])
        except Exception:
            return f"<{tid}>"

    def prompt_error(exc: InvalidRequestError, param: str) -> InvalidRequestError:
        if isinstance(exc, PromptTooLongError) or getattr(exc, "param", None) is None:
            return BadRequest(str(exc), param)
        return exc

    async def submit(specs: list[GenerationSpec], param: str) -> RequestGroup:
        try:
            return await engine_client.submit(specs)
        except InvalidRequestError as e:
            raise prompt_error(e, param) from None

    async def run_group(request: Request, group: RequestGroup, t0: float,
                        on_output: Any) -> None:
        """Feed every output of ``group`` to ``on_output``, aborting on disconnect or error, and record
        latency metrics per engine request."""
        watcher = asyncio.create_task(_watch_disconnect(request, group.abort))
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        in_flight[0] += 1
        try:
            async for out in group.outputs():
                t = time.perf_counter()
                if out.delta_token_ids:
                    rid = out.request_id
                    if rid not in first:
                        first[rid] = t
                    elif rid in last:
                        metrics.observe_itl(t - last[rid], len(out.delta_token_ids))
                    last[rid] = t
                if out.finished and out.finish_reason != "abort":
                    ttft = first[out.request_id] - t0 if out.request_id in first else None
                    metrics.observe_request(ttft, t - t0, len(out.token_ids))
                await on_output(out)
        finally:
            in_flight[0] -= 1
            watcher.cancel()
            group.abort()  # no-op when all finished

    # ------------------------------------------------------------------ /v1/completions
    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        check_model(body.model)
        params = body.to_sampling_params()
        prompts = body.prompts()
        seeds = body.seeds()
        req_id = random_id("cmpl")
        specs = []
        for pi, p in enumerate(prompts):
            for i, seed in enumerate(seeds):
                sp = params if seed == params.seed else replace(params, seed=seed)
                specs.append(GenerationSpec(f"{req_id}-{pi}-{i}", sp, prompt=p,
                                            fill_max_tokens=body.max_tokens is None, prompt_key=pi))
        group = await submit(specs, "prompt")
        holdback = max((len(s) for s in params.stop), default=1) - 1
        states = {rid: _ChoiceState(holdback) for rid in group.request_ids}
        want_lp = params.logprobs is not None
        created_at = now()

        def prompt_text(rid: str) -> str:
            pi = int(rid.rsplit("-", 2)[1])
            p = prompts[pi]
            if isinstance(p, str):
                return p
            return tokenizer.decode(p) if tokenizer is not None else ""

        def lp_entries(st: _ChoiceState, entries: list[dict]) -> CompletionLogprobs:
            res = CompletionLogprobs()
            for e in entries:
                tok = decode_token(e["token"])
                res.tokens.append(tok)
                res.token_logprobs.append(e["logprob"])
                top = {decode_token(t): lp for t, lp in e["top"]}
                top.setdefault(tok, e["logprob"])
                res.top_logprobs.append(top)
                res.text_offset.append(st.offset)
                st.offset += len(tok)
            return res

        def usage() -> UsageInfo:
            p = sum(len(group.prompt_token_ids[f"{req_id}-{pi}-0"]) for pi in range(len(prompts)))
            c = sum(s.num_tokens for s in states.values())
            return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

            async def events() -> AsyncIterator[str]:
                chunks: asyncio.Queue = asyncio.Queue()

                async def on_output(out: RequestOutput) -> None:
                    rid = out.request_id
                    st = states[rid]
                    prefix = ""
                    if body.echo and not st.started:
                        prefix = prompt_text(rid)
                    st.started = True
                    delta = st.advance(out)
                    lps = lp_entries(st, out.logprobs or []) if want_lp else None
                    if not (prefix or delta or out.finished or (lps and lps.tokens)):
                        return
                    choice = {"index": group.index[rid], "text": prefix + delta,
                              "logprobs": lps.model_dump() if lps else None,
                              "finish_reason": out.finish_reason if out.finished else None,
                              "stop_reason": out.stop_reason if out.finished else None}
                    chunk = {"id": req_id, "object": "text_completion", "created": created_at,
                             "model": model_name, "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = usage().model_dump() if continuous else None
                    await chunks.put(_sse(chunk))

                async for item in _pump(run_group(request, group, t0, on_output), chunks):
                    yield item
                if include_usage:
                    yield _sse({"id": req_id, "object": "text_completion", "created": created_at,
                                "model": model_name, "choices": [], "usage": usage().model_dump()})
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        texts: dict[str, list[str]] = {rid: [] for rid in group.request_ids}
        lp_all: dict[str, CompletionLogprobs] = {rid: CompletionLogprobs() for rid in group.request_ids}

        async def collect(out: RequestOutput) -> None:
            st = states[out.request_id]
            st.advance(out)
            if out.finished:
                texts[out.request_id] = [out.text]
            if want_lp and out.logprobs:
                part = lp_entries(st, out.logprobs)
                acc = lp_all[out.request_id]
                acc.tokens += part.tokens
                acc.token_logprobs += part.token_logprobs
                acc.top_logprobs += part.top_logprobs
                acc.text_offset += part.text_offset

        await run_group(request, group, t0, collect)
        choices = []
        for rid in group.request_ids:
            st = states[rid]
            text = "".join(texts[rid])
            if body.echo:
                text = prompt_text(rid) + text
            choices.append(CompletionChoice(index=group.index[rid], text=text,
                                            logprobs=lp_all[rid] if want_lp else None,
                                            finish_reason=st.finish_reason, stop_reason=st.stop_reason))
        return CompletionResponse(id=req_id, created=created_at, model=model_name, choices=choices, usage=usage())

    # ------------------------------------------------------------------ /v1/chat/completions
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        check_model(body.model)
        params = body.to_sampling_params()
        conversation = body.conversation()
        req_id = random_id("chatcmpl")
        specs = []
        for i, seed in enumerate(body.seeds()):
            sp = params if seed == params.seed else replace(params, seed=seed)
            specs.append(GenerationSpec(f"{req_id}-{i}", sp, messages=conversation,
                                        fill_max_tokens=not body.explicit_max_tokens))
        group = await submit(specs, "messages")
        holdback = max((len(s) for s in params.stop), default=1) - 1
        states = {rid: _ChoiceState(holdback) for rid in group.request_ids}
        want_lp = params.logprobs is not None
        created_at = now()

        def chat_lps(entries: list[dict]) -> list[ChatTokenLogprob]:
            res = []
            for e in entries:
                tok = decode_token(e["token"])
                tops = []
                for t, lp in e["top"]:
                    s = decode_token(t)
                    tops.append(TopLogprob(token=s, logprob=lp, bytes=list(s.encode("utf-8", "replace"))))
                res.append(ChatTokenLogprob(token=tok, logprob=e["logprob"],
                                            bytes=list(tok.encode("utf-8", "replace")), top_logprobs=tops))
            return res

        def usage() -> UsageInfo:
            p = len(group.prompt_token_ids[group.request_ids[0]])
            c = sum(s.num_tokens for s in states.values())
            return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

            def chunk(choices: list[dict], with_usage: bool = True) -> str:
                c: dict[str, Any] = {"id": req_id, "object": "chat.completion.chunk", "created": created_at,
                                     "model": model_name, "choices": choices}
                if include_usage and with_usage:
                    c["usage"] = usage().model_dump() if continuous else None
                return _sse(c)

            async def events() -> AsyncIterator[str]:
                chunks: asyncio.Queue = asyncio.Queue()
                for rid in group.request_ids:  # the role comes first, as OpenAI sends it
                    yield chunk([{"index": group.index[rid], "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])

                async def on_output(out: RequestOutput) -> None:
                    st = states[out.request_id]
                    delta = st.advance(out)
                    lps = chat_lps(out.logprobs or []) if want_lp else None
                    if not (delta or out.finished or lps):
                        return
                    choice = {"index": group.index[out.request_id],
                              "delta": {"content": delta} if delta else {},
                              "logprobs": {"content": [x.model_dump() for x in lps]} if lps else None,
                              "finish_reason": out.finish_reason if out.finished else None}
                    if out.finished:
                        choice["stop_reason"] = out.stop_reason
                    await chunks.put(chunk([choice]))

                async for item in _pump(run_group(request, group, t0, on_output), chunks):
                    yield item
                if include_usage:
                    yield _sse({"id": req_id, "object": "chat.completion.chunk", "created": created_at,
                                "model": model_name, "choices": [], "usage": usage().model_dump()})
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        final: dict[str, RequestOutput] = {}
        lp_all: dict[str, list[ChatTokenLogprob]] = {rid: [] for rid in group.request_ids}

        async def collect(out: RequestOutput) -> None:
            states[out.request_id].advance(out)
            if want_lp and out.logprobs:
                lp_all[out.request_id] += chat_lps(out.logprobs)
            if out.finished:
                final[out.request_id] = out

        await run_group(request, group, t0, collect)
        choices = []
        for rid in group.request_ids:
            st = states[rid]
            out = final.get(rid)
            choices.append(ChatChoice(
                index=group.index[rid],
                message=ChatResponseMessage(content=out.text if out else ""),
                logprobs=ChatLogprobs(content=lp_all[rid]) if want_lp else None,
                finish_reason=st.finish_reason, stop_reason=st.stop_reason))
        return ChatCompletionResponse(id=req_id, created=created_at, model=model_name, choices=choices,
                                      usage=usage())

    return app


class ModelNotFound(StarletteHTTPException):
    model_not_found = True

    def __init__(self, model: str) -> None:
        super().__init__(404, f"The model `{model}` does not exist.")


_END = object()  # _pump's end-of-stream marker


async def _pump(producer: Any, chunks: asyncio.Queue) -> AsyncIterator[str]:
    """Run ``producer`` (which puts SSE strings on ``chunks``) and yield the strings as they come.
    If the consumer stops (client gone: the generator is closed or cancelled), the producer is
    cancelled, and its ``finally`` aborts the engine requests. An engine failure mid-stream becomes
    an error event. One queue read per chunk: the producer's end (or its exception) is an item too."""

    async def run() -> None:
        try:
            await producer
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            chunks.put_nowait(e)
        finally:
            chunks.put_nowait(_END)

    task = asyncio.ensure_future(run())
    try:
        while True:
            item = await chunks.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                status = 503 if isinstance(item, EngineDeadError) else 500
                if status == 500:
                    logger.error("stream failed", exc_info=item)
                yield _sse(error_body(status, str(item) or type(item).__name__))
                return
            yield item
    finally:
        if not task.done():
            task.cancel()  # run_group's finally aborts the engine requests


def _version() -> str:
    try:
        from dspark import __version__

        return __version__
    except Exception:
        return "unknown"
