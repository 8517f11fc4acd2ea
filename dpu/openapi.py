"""What ``/openapi.json`` says about the frontend's API: request bodies, answers, errors.

The OpenAI routes read their bodies themselves (the size and JSON-shape bounds come first, big
bodies are parsed in the worker pool: :mod:`blink.dpu.serving`), so FastAPI cannot see their
request models. They are published here instead: each route names its body's pydantic model
(:func:`json_body`), :func:`install` puts those models' JSON schemas into the document's
components, and every route lists the error answers it can give (:func:`errors`), each an
OpenAI-style :class:`blink.dpu.errors.ErrorResponse`. Client generators and schemathesis
(``tests/test_openapi_schema.py``) then see the real API.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from blink.dpu.errors import ErrorResponse

_ERRORS = {
    400: "Invalid request: a field's value, the JSON, a limit (OpenAI-style error naming the "
         "parameter)",
    401: "Missing or wrong API key (`Authorization: Bearer KEY`)",
    404: "The model (or endpoint) does not exist",
    408: "The request's head or body did not arrive in time (--http-header-timeout, "
         "--http-body-timeout); the connection is closed",
    413: "The request body is larger than --max-request-body-mb",
    500: "An internal error (the keep-alive connection stays usable)",
    503: "The engine is unavailable, restarting or full, or the server holds --max-connections "
         "connections (Retry-After says when to retry)",
}
#: answers any request can get: the connection-level ones (blink.dpu.http_server) and the
#: error net's 500
COMMON = (408, 500, 503)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of these error statuses (plus :data:`COMMON`)."""
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]}
            for status in sorted({*statuses, *COMMON})}


def json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is one of ``models`` (read by the route
    itself; their schemas are added by :func:`install`)."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


#: one server-sent event of a stream: ``data`` holds a JSON chunk (or ``[DONE]``)
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}}}


def json_or_stream(model: type[BaseModel] | None, what: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or with ``"stream": true`` server-sent events."""
    json_schema: dict[str, Any] = {"$ref": f"#/components/schemas/{model.__name__}"} \
        if model is not None else {"type": "object"}
    return {200: {"description": f"{what}; with `\"stream\": true` a stream of server-sent "
                                 f"events ending with `data: [DONE]`",
                  "content": {"application/json": {"schema": json_schema},
                              "text/event-stream": {"schema": _SSE_EVENT}}}}


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` (``/openapi.json``) carry ``models``' JSON schemas as components
    (the request bodies :func:`json_body` names, the answers :func:`json_or_stream` names)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                                 description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, definition in body.pop("$defs", {}).items():
                    components.setdefault(name, definition)
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
