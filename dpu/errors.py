"""OpenAI-style API errors.

Every error response has the shape OpenAI clients parse, plus vLLM's ``"object": "error"``::

    {"object": "error",
     "error": {"message": "...", "type": "invalid_request_error", "param": "temperature",
               "code": null}}

Handlers raise :class:`APIError`; one exception handler in the app turns it into the response.
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError


class ErrorDetail(BaseModel):
    """The ``error`` object of an error answer."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """An error answer's body, as every route sends it (the published schema)."""

    object: str = "error"
    error: ErrorDetail


class APIError(Exception):
    """An error answer: HTTP status, OpenAI error type, and the offending parameter if any."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"object": "error",
                "error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model",
                    code="model_not_found")


def unauthorized() -> APIError:
    # RFC 6750: a 401 names the scheme the client should use.
    return APIError(401, "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'.",
                    type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def request_too_large(size: int | None, limit: int) -> APIError:
    """413 for a body over the limit (``size`` is None when it was cut off while reading)."""
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    # Connection: close, as the rest of the body is not read.
    return APIError(413, f"The request body is too large ({got}); this server accepts at most "
                    f"{limit} bytes (blink serve --max-request-body-mb).",
                    code="request_too_large", headers={"Connection": "close"})


def overloaded(message: str, retry_after_s: float) -> APIError:
    # Retry-After takes whole seconds; never advertise 0 (clients would hammer us).
    seconds = max(1, int(retry_after_s + 0.999))
    return APIError(503, message, type="overloaded_error", code="engine_overloaded",
                    headers={"Retry-After": str(seconds)})


def engine_unavailable(message: str, retry_after_s: float | None = None) -> APIError:
    """503 ``engine_unavailable``; with ``Retry-After`` while the engine is being restarted."""
    headers = None if retry_after_s is None else {"Retry-After": str(max(1, int(retry_after_s + 0.999)))}
    return APIError(503, message, type="service_unavailable_error", code="engine_unavailable",
                    headers=headers)


def internal_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def context_length_exceeded(max_model_len: int, prompt_len: int,
                            max_tokens: int | None) -> APIError:
    """vLLM's wording, so clients that parse it (to shrink the request) keep working."""
    if max_tokens is None:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, "
                   f"you requested {prompt_len} tokens in the messages, Please reduce the "
                   f"length of the messages.")
    else:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, "
                   f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                   f"messages, {max_tokens} in the completion). Please reduce the length of "
                   f"the messages or completion.")
    return APIError(400, message, param="messages" if max_tokens is None else "max_tokens",
                    code="context_length_exceeded")


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """Drop pydantic's union-branch tags (``'str'``, ``'list[int]'``) from an error location."""
    out: list[str] = []
    for part in loc:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif part in {"str", "int", "float", "bool"} or "[" in str(part) or part[:1].isupper():
            continue
        else:
            out.append(("." if out else "") + str(part))
    return out


def from_validation_error(exc: ValidationError) -> APIError:
    """A pydantic request-validation failure as a 400 naming the first bad field."""
    first = exc.errors()[0]
    kind = first["type"]
    if kind == "json_invalid":
        return bad_request(f"Invalid JSON body: {first['msg'].removeprefix('Invalid JSON: ')}")
    if kind == "model_type" and not first["loc"]:
        return bad_request("The request body must be a JSON object.")
    path = "".join(_field_path(first["loc"]))
    param = path or None
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{path}'.", param=param)
    # A union reports one error per branch; name the field once with the first reason.
    return bad_request(f"Invalid value for '{path}': {first['msg']}.", param=param)
