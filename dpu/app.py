"""The frontend's HTTP app: OpenAI-compatible endpoints over an :class:`EngineClient`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes), ``GET /health`` (503 while the engine's
heartbeat is stale) and ``GET /metrics`` (Prometheus). With ``api_key`` set, ``/v1/*``,
``/tokenize``, ``/detokenize`` and the API docs (``/docs``, ``/redoc``, ``/openapi.json``; unless
``public_docs``) need ``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open for
probes and scrapers (as in vLLM). Every error is an OpenAI-style JSON body
(:mod:`blink.dpu.errors`), an unexpected exception included: it becomes a 500 that leaves the
keep-alive connection usable. Request bodies over ``RequestLimits.max_request_body_bytes`` get
a 413 before they are read.
"""
from __future__ import annotations

import argparse
import logging
import secrets
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blink.dpu import errors
from blink.dpu.engine_client import EngineClient
from blink.dpu.errors import APIError
from blink.dpu.limits import RequestLimits
from blink.dpu.metrics import FrontendMetrics
from blink.dpu.protocol import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from blink.dpu.serving import OpenAIServing
from blink.dpu.tokenizer import Tokenizer
from blink.dpu.tool_calling import ToolCallingConfig
from blink.errors import BlinkError

logger = logging.getLogger(__name__)


class InternalErrorMiddleware:
    """Turns an exception that escaped every handler into a JSON 500, and does not re-raise.

    Starlette's own last-resort handler (``ServerErrorMiddleware``, where an
    ``exception_handler(Exception)`` lands) sends the 500 and then re-raises; uvicorn, seeing
    an exception after a response, closes the connection, so the client's *next* request on
    that keep-alive connection got ECONNRESET. Here the exception ends with this request.
    If the response had already started (a stream), its body is ended cleanly instead.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """``create_app`` keyword arguments from ``blink serve`` flags (see blink/cli.py); a bad
    value is a :class:`BlinkError` naming the flag."""
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
    return {
        "public_docs": bool(args.public_docs),
        "tool_calling": tool_calling,
        "limits": RequestLimits(
            max_request_body_bytes=max(1, int(args.max_request_body_mb * (1 << 20))),
            chat_template_timeout_s=args.chat_template_timeout,
            trust_request_chat_template=bool(args.trust_request_chat_template),
        ),
    }


def create_app(engine: EngineClient, tokenizer: Tokenizer, *, model_name: str | None = None,
               api_key: str | None = None, limits: RequestLimits | None = None,
               public_docs: bool = False,
               tool_calling: ToolCallingConfig | None = None) -> FastAPI:
    """Build the app. ``model_name`` (default ``engine.model_name``) is the only name
    requests may ask for; ``api_key`` turns on Bearer authentication (for the API docs too,
    unless ``public_docs``); ``limits`` bounds what one request may cost; ``tool_calling``
    holds the tool-calling flags (``--enable-auto-tool-choice``, ``--tool-call-parser``)."""
    name = model_name or engine.model_name
    limits = limits or RequestLimits()
    metrics = FrontendMetrics(engine, name)
    serving = OpenAIServing(engine, tokenizer, metrics, name, limits, tool_calling)
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
    app.add_middleware(InternalErrorMiddleware)

    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Constant-time comparison: the key must not leak through response timing.
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    api_key.encode()):
            raise errors.unauthorized()

    auth = [Depends(require_api_key)]

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
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

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=name,
                                         max_model_len=engine.max_model_len)])

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> TokenizeResponse:
        return await serving.tokenize(request)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> DetokenizeResponse:
        return await serving.detokenize(request)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy():
            return errors.engine_unavailable(
                "The engine is not healthy (heartbeat stale).").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
