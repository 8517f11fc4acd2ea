"""The generic tool-call format, for chat templates that never render ``tools`` (llama.cpp's
"generic" handler does the same): Blink writes the tools into the system prompt itself, the
grammar constrains the answer to one JSON object, and this parser reads it:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    {"response": "It is sunny in Paris."}

- :func:`generic_system_prompt`: the instructions and the tool definitions (JSON), added to
  the conversation's first system message (or as one, first).
- :func:`generic_schema`: either object, the calls' names and arguments checked against the
  tools' parameter schemas (``parallel_tool_calls: false``: at most one call).
- :func:`generic_messages`: a history in this format: an assistant turn's ``tool_calls``
  become its content (``{"tool_calls": [...]}``), a ``tool`` result a user turn
  (``{"tool_response": {"tool_call_id": ..., "content": ...}}``): templates without tool
  support know only plain roles and contents.
- :class:`GenericToolParser`: calls from ``tool_calls``; ``response`` is the content, its
  JSON string decoded as it streams.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from blink.dpu.tool_parsers.base import JsonValueSkipper, ToolCallParser, skip_ws
from blink.dpu.tool_parsers.forced import hoist_defs

GENERIC_INSTRUCTIONS = (
    "Respond in JSON format, either with `tool_calls` (a request to call tools) or with "
    "`response` (a reply to the user's request).\n"
    "You can call any of the following tools to satisfy the user's requests:\n{tools}\n"
    'Tool call syntax: {{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments '
    'as a JSON object>}}}}]}}\n'
    'Reply syntax: {{"response": "<your reply>"}}'
)


def generic_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text that tells the model the tools and the answer format."""
    listed = json.dumps([t["function"] for t in tools], indent=2, ensure_ascii=False)
    return GENERIC_INSTRUCTIONS.format(tools=listed)


def generic_schema(tools: list[dict[str, Any]], single_call: bool = False,
                   response_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON schema of a generic answer: ``{"tool_calls": [...]}`` (names and arguments
    valid against the tools) or ``{"response": "..."}`` (with a ``response_schema``, the
    request's response format: ``{"response": <a value valid against it>}``)."""
    alternatives, defs = hoist_defs(tools)
    if response_schema is not None and ("$defs" in response_schema or "definitions" in response_schema):
        response_schema = dict(response_schema)
        for key in ("$defs", "definitions"):  # their $refs point at the document's top
            for name, sub in (response_schema.pop(key, None) or {}).items():
                if name in defs and defs[name] != sub:
                    raise ValueError(f"the tools and the response format define "
                                     f"'{key}.{name}' differently")
                defs[name] = sub
        if "definitions" in json.dumps(response_schema):
            response_schema = json.loads(json.dumps(response_schema).replace(
                '"#/definitions/', '"#/$defs/'))
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": a["name"], "arguments": a["parameters"]},
         "required": ["name", "arguments"]} for a in alternatives]}}
    if single_call:
        calls["maxItems"] = 1
    schema: dict[str, Any] = {"anyOf": [
        {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]},
        {"type": "object", "properties": {"response": response_schema or {"type": "string"}},
         "required": ["response"]},
    ]}
    if defs:
        schema["$defs"] = defs
    return schema


def generic_messages(messages: Sequence[Mapping[str, Any]],
                     tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tools in the system prompt and tool turns in the generic format."""
    from blink.dpu.chat_template import ChatTemplateError  # jinja2 only when rendering

    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        msg = dict(message)
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            calls = []
            for j, call in enumerate(msg.pop("tool_calls")):
                function = call.get("function") or {}
                args = function.get("arguments")
                try:  # "" and null mean no arguments, as in vLLM
                    args = (json.loads(args) if args.strip() else {}) if isinstance(args, str) \
                        else ({} if args is None else args)
                except ValueError as e:
                    raise ChatTemplateError(f"messages[{i}].tool_calls[{j}].function.arguments "
                                            f"is not valid JSON: {e}") from None
                calls.append({"name": function.get("name"), "arguments": args})
            msg["content"] = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        elif msg.get("role") == "tool":
            content = msg.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            response = {"tool_call_id": msg.get("tool_call_id"), "content": content}
            msg = {"role": "user", "content": json.dumps({"tool_response": response},
                                                         ensure_ascii=False)}
        out.append(msg)
    prompt = generic_system_prompt(tools)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prompt}")
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


# The opening of either answer, up to its value: what decides the mode.
_OPENING = re.compile(r'\s*\{\s*"(tool_calls|response)"\s*:\s*')
_OPENINGS = ('{"tool_calls":', '{"response":')


class GenericToolParser(ToolCallParser):
    """Reads the generic format (module docstring); anything else is plain content."""

    name = "generic"
    families = "any model (tools in the system prompt, JSON answers; llama.cpp's generic format)"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "open"  # open | item | next | close | response | value | content
        self._raw = ""  # the response string's undecoded body so far
        self._value: JsonValueSkipper | None = None  # a non-string response (a response format)

    def _advance(self, final: bool) -> None:
        text = self._text
        while True:
            mode = self._mode
            if mode == "open":
                m = _OPENING.match(text, self._pos)
                if m is None or m.end() == len(text):  # the value has not begun yet
                    compact = "".join(text[self._pos:].split())
                    if not final and any(o.startswith(compact) or compact.startswith(o)
                                         for o in _OPENINGS):
                        return  # may still become an answer
                    self._mode = "content"
                    continue
                first = text[m.end()]
                if m.group(1) == "response" and first == '"':
                    self._pos, self._mode = m.end() + 1, "response"
                elif m.group(1) == "response":  # a JSON value (the request's response format)
                    self._pos, self._mode = m.end(), "value"
                    self._value = JsonValueSkipper()
                elif m.group(1) == "tool_calls" and first == "[":
                    self._pos, self._mode = m.end() + 1, "item"
                    self._call_start = self._pos
                else:
                    self._mode = "content"
            elif mode in ("item", "next"):
                mode = self._step_call_list(mode, final, ("arguments",))
                if mode is None:
                    return
                self._mode = "close" if mode == "end" else mode
            elif mode == "close":  # the object's closing brace, then nothing but blanks
                pos = skip_ws(text, self._pos)
                if pos < len(text) and text[pos] == "}":
                    pos = skip_ws(text, pos + 1)
                self._pos = pos
                if pos < len(text):
                    self._mode = "content"
                    continue
                return
            elif mode == "response":
                if self._read_response(final):
                    self._mode = "close"
                    continue
                return
            elif mode == "value":  # the value's own JSON text is the content
                assert self._value is not None
                end = self._value.advance(text, self._pos, final)
                self.content += text[self._pos:end]
                self._pos = end
                if self._value.done:
                    self._mode = "close"
                    continue
                return
            else:
                self._emit_content(len(text))
                return

    def _read_response(self, final: bool) -> bool:
        """Decode the response string's body into the content as far as it is safe; True
        when the closing quote was read."""
        text, pos, n = self._text, self._pos, len(self._text)
        closed = False
        while pos < n:
            c = text[pos]
            pos += 1
            if c == '"' and not _odd_backslashes(self._raw):
                closed = True
                break
            self._raw += c
        self._pos = pos
        raw = self._raw
        cut = len(raw) if closed or final else _decodable_prefix(raw)
        if cut:
            try:
                self.content += json.loads('"' + raw[:cut] + '"')
            except ValueError:  # not a valid JSON string (unconstrained output): as written
                self.content += raw[:cut]
            self._raw = raw[cut:]
        return closed


def _odd_backslashes(raw: str) -> bool:
    """Whether ``raw`` ends inside an escape (an odd run of backslashes)."""
    return (len(raw) - len(raw.rstrip("\\"))) % 2 == 1


def _decodable_prefix(raw: str) -> int:
    """Length of the longest prefix of a JSON string body that ends between escapes (a
    ``\\uD8xx`` high surrogate waits for its low half)."""
    i, n = 0, len(raw)
    while i < n:
        if raw[i] != "\\":
            i += 1
            continue
        if i + 1 >= n:
            return i
        if raw[i + 1] != "u":
            i += 2
            continue
        if i + 6 > n:
            return i
        try:
            high = 0xD800 <= int(raw[i + 2:i + 6], 16) < 0xDC00
        except ValueError:
            high = False
        if high and i + 12 > n:
            return i
        i += 12 if high else 6
    return n
