"""The frontend's HTTP app: OpenAI-compatible endpoints over an :class:`EngineClient`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(stateless, :mod:`blink.dpu.responses`), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes), ``GET /version``, ``GET /health`` (503
while the engine's heartbeat is stale), ``GET|POST /ping`` (SageMaker's probe, as ``/health``)
and ``GET /metrics`` (Prometheus); any other path is a JSON 404 that lists these. Every
response carries ``x-request-id`` (the client's, or a new one), and one access-log line per
request names it (``blink.access``; off with ``--disable-log-requests``). With ``api_key``
set, ``/v1/*``, ``/tokenize``, ``/detokenize`` and the API docs (``/docs``, ``/redoc``,
``/openapi.json``; unless ``public_docs``) need ``Authorization: Bearer <key>``; ``/health``,
``/ping`` and ``/metrics`` stay open for probes and scrapers (as in vLLM). Every error is an OpenAI-style JSON body
(:mod:`blink.dpu.errors`), an unexpected exception included: it becomes a 500 that leaves the
keep-alive connection usable. Request bodies over ``RequestLimits.max_request_body_bytes`` get
a 413 before they are read.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.routing import APIRoute
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blink.dpu import errors
from blink.dpu.engine_client import EngineClient
from blink.dpu.errors import APIError
from blink.dpu.limits import RequestLimits
from blink.dpu.metrics import FrontendMetrics
from blink.dpu.protocol import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from blink.dpu import openapi
from blink.dpu.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
    DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest,
)
from blink.dpu.responses import ResponsesRequest
from blink.dpu.request_log import LoggedEngineClient, RequestLogConfig
from blink.dpu.responses import ResponsesServing
from blink.dpu.reasoning import REASONING_PARSERS
from blink.dpu.serving import OpenAIServing
from blink.dpu.tokenizer import Tokenizer
from blink.dpu.tool_calling import ToolCallingConfig
from blink.errors import BlinkError
from blink.logs import request_id as current_request_id
from blink.version import blink_version

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("blink.access")
#: a client's x-request-id is echoed if it is this tame (else a new one is made): no header
#: or log injection through it
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


class RequestIdMiddleware:
    """``x-request-id`` on every response (the client's when it is tame, else a new uuid4),
    :data:`blink.logs.request_id` set while the request is served (so log lines carry it),
    and one access-log line per request when ``log_requests``: client, method, path, status,
    duration (to the end of the body: a stream's whole length) and the id."""

    def __init__(self, app: ASGIApp, log_requests: bool = True,
                 skip_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.log_requests = log_requests
        self.skip_paths = skip_paths  # --disable-access-log-for-endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"")
        text = given.decode("latin-1")
        rid = text if _REQUEST_ID_RE.fullmatch(text) else uuid.uuid4().hex
        token = current_request_id.set(rid)
        start = time.perf_counter()
        # logged when nothing was sent: the client left first (nginx's 499); the error net
        # answers everything else, a 500 included
        status = 499

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.log_requests and scope.get("path", "") not in self.skip_paths:
                client = scope.get("client")
                where = f"{client[0]}:{client[1]}" if client else "-"
                query = scope.get("query_string", b"").decode("latin-1")
                path = scope.get("path", "") + (f"?{query}" if query else "")
                access_logger.info('%s "%s %s HTTP/%s" %d %.1fms request_id=%s', where,
                                   scope.get("method"), path, scope.get("http_version", "1.1"),
                                   status, (time.perf_counter() - start) * 1e3, rid)
            current_request_id.reset(token)


class Health(BaseModel):
    """``GET /health`` while the engine is healthy."""

    status: str = "ok"


class VersionInfo(BaseModel):
    """``GET /version``."""

    version: str


@dataclass(frozen=True)
class CorsOptions:
    """vLLM's CORS flags (``--allowed-origins`` etc.); no CORS headers at all without them."""

    allow_origins: list[str]
    allow_methods: list[str]
    allow_headers: list[str]
    allow_credentials: bool = False


class InternalErrorMiddleware:
    """Turns an exception that escaped every handler into a JSON 500, and does not re-raise.

    Starlette's own last-resort handler (``ServerErrorMiddleware``, where an
    ``exception_handler(Exception)`` lands) sends the 500 and then re-raises; uvicorn, seeing
    an exception after a response, closes the connection, so the client's *next* request on
    that keep-alive connection got ECONNRESET. Here the exception ends with this request.
    If the response had already started (a stream), its body is ended cleanly instead.

    A client that left before its request body was read (Starlette's ``ClientDisconnect``
    from ``request.body()``, also what a body past ``--http-body-timeout`` ends as) is no
    server error: nobody is there to answer, so it is counted
    (``blink:http_client_disconnects_total``) and logged at debug level, without a traceback.
    """

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            if self.metrics is not None:
                self.metrics.http_client_disconnects.inc()
            logger.debug("client left before its request body was read (%s %s)",
                         scope.get("method"), scope.get("path"))
            if started and not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as exc:  # the last resort: whatever a handler failed to handle
            logger.exception("unhandled error while serving %s %s", scope.get("method"),
                             scope.get("path"))
            if not started:
                response = errors.internal_error(
                    f"Internal server error: {type(exc).__name__}: {exc}").response()
                await response(scope, receive, send)
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})


class BodySizeLimitMiddleware:
    """413 for request bodies over ``limit`` bytes: at once when Content-Length says so, else
    as soon as the streamed body passes it (the handler never sees more)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                size = int(value) if value.isdigit() else None
                if size is not None and size > self.limit:
                    await errors.request_too_large(size, self.limit).response()(
                        scope, receive, send)
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    await self._drain(receive, message)
                    raise errors.request_too_large(None, self.limit)  # the app answers it
            return message

        await self.app(scope, limited_receive, send)

    async def _drain(self, receive: Receive, message: Message) -> None:
        """Read and drop the rest of a too-large streamed body (up to 4x the limit), so the
        client reads the 413: closing a socket with unread input resets the connection,
        and the reset can destroy the answer before the client reads it."""
        dropped = 0
        while message.get("more_body") and dropped <= 4 * self.limit:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))


def json_list_flag(args: argparse.Namespace, name: str) -> list[str] | None:
    """A flag holding a JSON list of strings (vLLM's CORS flags); None when not given."""
    raw = getattr(args, name, None)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BlinkError(f"--{name.replace('_', '-')} must be a JSON list of strings, for "
                         f"example '[\"*\"]' or '[\"https://app.example\"]'; got {raw!r}")
    return value


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """``create_app`` keyword arguments from ``blink serve`` flags (see blink/cli.py); a bad
    value is a :class:`BlinkError` naming the flag."""
    origins = json_list_flag(args, "allowed_origins")
    cors = None if origins is None else CorsOptions(
        allow_origins=origins, allow_methods=json_list_flag(args, "allowed_methods") or [],
        allow_headers=json_list_flag(args, "allowed_headers") or [],
        allow_credentials=bool(args.allow_credentials))
    if not args.max_request_body_mb > 0:
        raise BlinkError(f"--max-request-body-mb must be positive, got {args.max_request_body_mb:g}")
    if not args.chat_template_timeout > 0:
        raise BlinkError(
            f"--chat-template-timeout must be positive, got {args.chat_template_timeout:g}")
    try:
        tool_calling = ToolCallingConfig(
            enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
            tool_call_parser=getattr(args, "tool_call_parser", None),
            exclude_tools_when_tool_choice_none=bool(
                getattr(args, "exclude_tools_when_tool_choice_none", False)))
    except ValueError as e:
        raise BlinkError(str(e)) from None
    try:
        request_log = RequestLogConfig(
            enabled=bool(getattr(args, "enable_log_requests", False)),
            log_outputs=bool(getattr(args, "enable_log_outputs", False)),
            max_log_len=getattr(args, "max_log_len", None))
    except ValueError as e:
        raise BlinkError(str(e)) from None
    return {
        "cors": cors,
        "log_requests": not (args.disable_log_requests
                             or getattr(args, "disable_uvicorn_access_log", False)),
        "access_log_skip": frozenset(
            p.strip() for p in (getattr(args, "disable_access_log_for_endpoints", None) or "").split(",")
            if p.strip()),
        "request_log": request_log,
        "public_docs": bool(args.public_docs),
        "tool_calling": tool_calling,
        "reasoning_parser": getattr(args, "reasoning_parser", None),
        "scheduling_policy": getattr(args, "scheduling_policy", "fcfs") or "fcfs",
        "limits": RequestLimits(
            max_request_body_bytes=max(1, int(args.max_request_body_mb * (1 << 20))),
            chat_template_timeout_s=args.chat_template_timeout,
            grammar_compile_timeout_s=getattr(args, "grammar_compile_timeout", 1.0),
            grammar_compile_memory_mb=getattr(args, "grammar_compile_memory_mb", 1024.0),
            grammar_cache_mb=getattr(args, "grammar_cache_mb", 64.0),
            trust_request_chat_template=bool(args.trust_request_chat_template),
        ),
    }


def create_app(engine: EngineClient, tokenizer: Tokenizer, *,
               model_name: str | list[str] | tuple[str, ...] | None = None,
               api_key: str | None = None, limits: RequestLimits | None = None,
               public_docs: bool = False, cors: CorsOptions | None = None,
               log_requests: bool = True,
               tool_calling: ToolCallingConfig | None = None,
               access_log_skip: frozenset[str] = frozenset(),
               request_log: RequestLogConfig | None = None,
               reasoning_parser: str | None = None,
               scheduling_policy: str = "fcfs") -> FastAPI:
    """Build the app. ``model_name`` (default ``engine.model_name``): the name, or the list of
    names (``--served-model-name a b``, as vLLM), requests may ask for; /v1/models lists them
    all and answers carry the first; ``api_key`` turns on Bearer authentication (for the API docs too,
    unless ``public_docs``); ``limits`` bounds what one request may cost; ``cors`` adds CORS
    headers; ``log_requests`` writes the access log; ``tool_calling`` holds the tool-calling
    flags (``--enable-auto-tool-choice``, ``--tool-call-parser``); ``access_log_skip``: paths
    the access log leaves out; ``request_log``: per-request input/output logging
    (``--enable-log-requests``, :mod:`blink.dpu.request_log`); ``reasoning_parser``: a
    :data:`blink.dpu.reasoning.REASONING_PARSERS` name (``--reasoning-parser``);
    ``scheduling_policy``: the engine's (``--scheduling-policy``): under ``priority`` a
    request's ``priority`` reaches the engine, under ``fcfs`` a non-zero one is a 400."""
    names = ([model_name] if isinstance(model_name, str) else list(model_name or [])) or [
        engine.model_name]
    name = names[0]
    limits = limits or RequestLimits()
    metrics = FrontendMetrics(engine, name)
    logged = LoggedEngineClient(engine, request_log) if request_log and request_log.enabled else engine
    serving = OpenAIServing(logged, tokenizer, metrics, name, limits, tool_calling)
    serving.served_names = frozenset(names)  # every --served-model-name a request may use
    if reasoning_parser is not None:
        if reasoning_parser not in REASONING_PARSERS:
            raise BlinkError(f"--reasoning-parser must be one of "
                             f"{', '.join(REASONING_PARSERS)}, got {reasoning_parser!r}")
        serving.reasoning_parser = REASONING_PARSERS[reasoning_parser]
    if scheduling_policy not in ("fcfs", "priority"):
        raise BlinkError(f"--scheduling-policy must be fcfs or priority, got {scheduling_policy!r}")
    serving.priority_scheduling = scheduling_policy == "priority"
    responses = ResponsesServing(serving)
    docs_open = api_key is None or public_docs
    app = FastAPI(title="Blink", summary="OpenAI-compatible LLM serving (Blink frontend)",
                  docs_url="/docs" if docs_open else None,
                  redoc_url="/redoc" if docs_open else None,
                  openapi_url="/openapi.json" if docs_open else None)
    app.state.engine = engine
    app.state.tokenizer = tokenizer
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.limits = limits
    # Added last = outermost: the body limit applies before anything reads the body, and the
    # internal-error net catches whatever the app (or the limit) lets escape.
    app.add_middleware(BodySizeLimitMiddleware, limit=limits.max_request_body_bytes)
    if cors is not None:  # outside the body limit: a preflight is answered before it
        app.add_middleware(CORSMiddleware, allow_origins=cors.allow_origins,
                           allow_methods=cors.allow_methods, allow_headers=cors.allow_headers,
                           allow_credentials=cors.allow_credentials,
                           expose_headers=["x-request-id"])
    app.add_middleware(InternalErrorMiddleware, metrics=metrics)
    # Outermost: the id is on every answer, the 500s of the error net included.
    app.add_middleware(RequestIdMiddleware, log_requests=log_requests, skip_paths=access_log_skip)

    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Constant-time comparison: the key must not leak through response timing.
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    api_key.encode()):
            raise errors.unauthorized()

    auth = [Depends(require_api_key)]
    # What /openapi.json says each route answers besides 200 (blink.dpu.openapi)
    authed = (401,) if api_key is not None else ()
    openapi.install(app, [ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                          CompletionResponse, ResponsesRequest, TokenizeCompletionRequest,
                          TokenizeChatRequest, DetokenizeRequest])

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    def endpoints() -> list[str]:
        out = []
        for route in app.routes:
            if isinstance(route, APIRoute) or route.path in ("/docs", "/redoc", "/openapi.json"):
                methods = sorted(getattr(route, "methods", None) or {"GET"} - {"HEAD"})
                out += [f"{m} {route.path.replace(':path}', '}')}" for m in methods if m != "HEAD"]
        return out

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route, not a handler's 404
            return APIError(
                404, f"{request.method} {request.url.path} is not an endpoint of this server. "
                f"It serves: {', '.join(endpoints())}.", type="not_found_error").response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind,
                        headers=dict(exc.headers or {})).response()

    if not docs_open:
        # The same pages FastAPI serves, behind the key (the schema lists every parameter).
        @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
        async def openapi_schema() -> JSONResponse:
            return JSONResponse(app.openapi())

        @app.get("/docs", dependencies=auth, include_in_schema=False)
        async def swagger_docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

        @app.get("/redoc", dependencies=auth, include_in_schema=False)
        async def redoc_docs() -> HTMLResponse:
            return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    @app.post("/v1/chat/completions", dependencies=auth,
              openapi_extra=openapi.json_body(ChatCompletionRequest),
              responses={**openapi.json_or_stream(ChatCompletionResponse, "The completion"),
                         **openapi.errors(400, *authed, 404, 413)})
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @app.post("/v1/completions", dependencies=auth,
              openapi_extra=openapi.json_body(CompletionRequest),
              responses={**openapi.json_or_stream(CompletionResponse, "The completion"),
                         **openapi.errors(400, *authed, 404, 413)})
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/responses", dependencies=auth,
              openapi_extra=openapi.json_body(ResponsesRequest),
              responses={**openapi.json_or_stream(None, "The response object"),
                         **openapi.errors(400, *authed, 404, 413)})
    async def create_response(request: Request) -> Response:
        return await responses.create(request)

    def model_card(served: str = name) -> ModelCard:
        return ModelCard(id=served, root=name, max_model_len=engine.max_model_len)

    @app.get("/v1/models", dependencies=auth, responses=openapi.errors(*authed))
    async def models() -> ModelList:
        return ModelList(data=[model_card(n) for n in names])

    @app.get("/v1/models/{model_id:path}", dependencies=auth,
             responses=openapi.errors(*authed, 404))
    async def model(model_id: str) -> ModelCard:
        if model_id not in names:
            raise errors.model_not_found(model_id)
        return model_card(model_id)

    @app.get("/version", responses=openapi.errors())
    async def version() -> VersionInfo:
        return VersionInfo(version=blink_version())

    @app.post("/tokenize", dependencies=auth,
              openapi_extra=openapi.json_body(TokenizeCompletionRequest, TokenizeChatRequest),
              responses=openapi.errors(400, *authed, 404, 413))
    async def tokenize(request: Request) -> TokenizeResponse:
        return await serving.tokenize(request)

    @app.post("/detokenize", dependencies=auth,
              openapi_extra=openapi.json_body(DetokenizeRequest),
              responses=openapi.errors(400, *authed, 404, 413))
    async def detokenize(request: Request) -> DetokenizeResponse:
        return await serving.detokenize(request)

    @app.get("/health", responses=openapi.errors())
    async def health() -> Health:
        """200 ``{"status": "ok"}`` while the engine is healthy; 503 (an OpenAI-style error)
        while it starts, stalls, restarts or is gone (docs/architecture.md, "Engine health")."""
        if not engine.is_healthy():
            raise errors.engine_unavailable("The engine is not healthy (heartbeat stale).")
        return Health()

    @app.get("/ping", responses=openapi.errors())
    async def ping() -> Health:
        """SageMaker's health probe, as vLLM serves it (GET and POST): the same answer as
        ``/health``; open without the API key, like ``/health``."""
        return await health()

    @app.post("/ping", responses=openapi.errors())
    async def ping_post() -> Health:
        """``POST /ping``: the same as ``GET /ping`` (SageMaker probes with either)."""
        return await health()

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition: vLLM's series under `blink:`, "
                             "Blink's own (engine, ring, HTTP connections, host threads)",
              "content": {"text/plain": {"schema": {"type": "string"}}}},
        **openapi.errors()})
    async def prometheus_metrics() -> Response:
        metrics.before_scrape()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
