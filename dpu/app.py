"""The frontend's HTTP app: OpenAI-compatible endpoints over an :class:`EngineClient`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes), ``GET /health`` (503 while the engine's
heartbeat is stale) and ``GET /metrics`` (Prometheus). With ``api_key`` set, ``/v1/*``,
``/tokenize`` and ``/detokenize`` need ``Authorization: Bearer <key>``; ``/health`` and
``/metrics`` stay open for probes and scrapers (as in vLLM). Every error is an OpenAI-style JSON
body (:mod:`blink.dpu.errors`).
"""
from __future__ import annotations

import logging
import secrets

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from blink.dpu import errors
from blink.dpu.engine_client import EngineClient
from blink.dpu.errors import APIError
from blink.dpu.metrics import FrontendMetrics
from blink.dpu.protocol import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from blink.dpu.serving import OpenAIServing
from blink.dpu.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def create_app(engine: EngineClient, tokenizer: Tokenizer, *, model_name: str | None = None,
               api_key: str | None = None) -> FastAPI:
    """Build the app. ``model_name`` (default ``engine.model_name``) is the only name
    requests may ask for; ``api_key`` turns on Bearer authentication."""
    name = model_name or engine.model_name
    metrics = FrontendMetrics(engine, name)
    serving = OpenAIServing(engine, tokenizer, metrics, name)
    app = FastAPI(title="Blink", summary="OpenAI-compatible LLM serving (Blink frontend)")
    app.state.engine = engine
    app.state.tokenizer = tokenizer
    app.state.metrics = metrics
    app.state.serving = serving

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

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return errors.internal_error(f"Internal server error: {type(exc).__name__}: {exc}"
                                     ).response()

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
