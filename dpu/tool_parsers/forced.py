"""The outputs of a forced tool choice, which the grammar constrains to JSON (so they are read
the same whatever ``--tool-call-parser`` is):

- ``tool_choice="required"``: a JSON array of ``{"name": <a tool>, "parameters": <its
  arguments>}`` objects, at least one (vLLM's schema, :func:`required_schema`);
- a named function: the arguments object itself (the function's parameter schema).
"""
from __future__ import annotations

from typing import Any

from blink.dpu.tool_parsers.base import ParsedToolCall, ToolCallParser, skip_ws


def hoist_defs(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per tool, ``{"name": <a schema allowing only its name>, "parameters": <its parameter
    schema>}``, and the parameter schemas' ``$defs`` hoisted into one dict (their ``$ref``
    point at the document's top, where the caller puts them)."""
    defs: dict[str, Any] = {}
    out = []
    for tool in tools:
        function = tool["function"]
        params = dict(function.get("parameters") or {"type": "object", "properties": {}})
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise ValueError(f"tools define '$defs.{name}' differently; "
                                 "one schema per name is supported")
            defs[name] = schema
        out.append({"name": {"type": "string", "enum": [function["name"]]}, "parameters": params})
    return out, defs


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of a ``required`` answer: a non-empty array of calls, each naming one
    of ``tools`` with arguments valid against that tool's parameter schema (as vLLM builds
    it). Parameter schemas' ``$defs`` are hoisted to the top, where their ``$ref`` point."""
    named, defs = hoist_defs(tools)
    alternatives = [{"properties": {"name": a["name"], "parameters": a["parameters"]},
                     "required": ["name", "parameters"]} for a in named]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": alternatives}}
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a named function's answer: its parameters (any object if none)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


class RequiredToolParser(ToolCallParser):
    """Reads ``[{"name": ..., "parameters": {...}}, ...]``; anything else is content (only
    possible when the output was not constrained)."""

    name = "required"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "open"  # open | item | next | content

    def _advance(self, final: bool) -> None:
        text = self._text
        while True:
            if self._mode == "open":
                pos = skip_ws(text, self._pos)
                if pos >= len(text):
                    if final:
                        self._emit_content(len(text))
                    return
                if text[pos] != "[":
                    self._mode = "content"
                    continue
                self._call_start = self._pos
                self._pos, self._mode = pos + 1, "item"
            elif self._mode in ("item", "next"):
                mode = self._step_call_list(self._mode, final, ("parameters", "arguments"))
                if mode is None:
                    return
                if mode == "end":  # what follows the array is content
                    self._pos, mode = skip_ws(text, self._pos), "content"
                self._mode = mode
            else:
                self._emit_content(len(text))
                return


class NamedToolParser(ToolCallParser):
    """The whole output is the arguments of ``function_name`` (surrounding whitespace
    dropped); the call is announced with the first non-blank character."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def open_call(self) -> ParsedToolCall | None:
        return self.calls[0] if self.calls and not self.finished else None

    def _advance(self, final: bool) -> None:
        text = self._text
        end = len(text.rstrip())  # trailing whitespace waits (and is dropped at the end)
        start = skip_ws(text, self._pos) if not self.calls else self._pos
        if start >= end:
            if final and not self.calls:
                self.calls.append(ParsedToolCall(self.function_name, "{}"))
            return
        if not self.calls:
            self.calls.append(ParsedToolCall(self.function_name))
        self.calls[0].arguments += text[start:end]
        self._pos = end
