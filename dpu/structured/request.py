"""The request fields that ask for structured outputs -> one :class:`StructuredOutputs`.

Accepted, as vLLM names them: ``response_format`` ``{"type": "json_object"}`` and
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the schema is
always enforced, so ``strict`` false gets the strict behaviour) and ``{"type":
"structural_tag", "structures", "triggers"}``, ``structured_outputs`` (``json``, ``regex``,
``choice``, ``json_object``, ``grammar``, ``structural_tag`` and the whitespace options) and
the older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (with
``guided_whitespace_pattern`` for JSON). Refused with a 400 naming the field: other
``response_format`` types, and more than one constraint at once.
"""
from __future__ import annotations

from typing import Any

from blink.shared.structured_outputs import StructuredOutputs, StructuredOutputsError


class StructuredRequestError(StructuredOutputsError):
    """A structured-output request field is invalid; ``param`` names it (for the 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _build(param: str, **kwargs: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kwargs)
    except StructuredOutputsError as exc:
        raise StructuredRequestError(f"{param}: {exc}", param) from None


def _response_format(rf: dict[str, Any]) -> StructuredOutputs | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _build("response_format", json_object=True)
    if kind == "structural_tag":
        return _build("response_format", structural_tag=rf)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredRequestError(
                "response_format.json_schema must be an object with a 'schema'.", "response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredRequestError(
                "response_format.json_schema.strict must be a boolean.", "response_format")
        schema = spec.get("schema")
        if schema is None:
            raise StructuredRequestError(
                "response_format.json_schema.schema is required.", "response_format")
        return _build("response_format", json=schema)
    raise StructuredRequestError(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object', "
        "'json_schema' or 'structural_tag'.", "response_format")


def structured_outputs_of(req: Any) -> StructuredOutputs | None:
    """The constraint a chat or completions request asks for, or None."""
    ws = getattr(req, "guided_whitespace_pattern", None)
    given: list[tuple[str, StructuredOutputs]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        so = _response_format(rf)
        if so is not None:
            given.append(("response_format", so))
    if getattr(req, "structured_outputs", None) is not None:
        try:
            given.append(("structured_outputs", StructuredOutputs.from_dict(req.structured_outputs)))
        except StructuredOutputsError as exc:
            raise StructuredRequestError(str(exc), "structured_outputs") from None
    if getattr(req, "guided_json", None) is not None:
        given.append(("guided_json", _build("guided_json", json=req.guided_json,
                                            whitespace_pattern=ws)))
    elif ws is not None:
        raise StructuredRequestError(
            "guided_whitespace_pattern applies to guided_json only (structured_outputs takes "
            "whitespace_pattern).", "guided_whitespace_pattern")
    if getattr(req, "guided_regex", None) is not None:
        given.append(("guided_regex", _build("guided_regex", regex=req.guided_regex)))
    if getattr(req, "guided_choice", None) is not None:
        given.append(("guided_choice", _build("guided_choice", choice=tuple(req.guided_choice))))
    if getattr(req, "guided_grammar", None) is not None:
        given.append(("guided_grammar", _build("guided_grammar", grammar=req.guided_grammar)))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise StructuredRequestError(
            f"give at most one structured-output constraint, got {names}.", given[1][0])
    return given[0][1] if given else None
