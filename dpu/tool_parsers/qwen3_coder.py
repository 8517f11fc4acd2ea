"""Qwen3-Coder's XML-style tool calls:

    some text<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    [1, 2]
    </parameter>
    </function>
    </tool_call>

Any number of ``<tool_call>`` blocks; the text outside them is content (the whitespace right
after a block is dropped). A parameter's value is the text between its tags, one newline
trimmed at each end, typed by the tool's schema as vLLM does: ``string`` stays text;
``integer``/``number``/``boolean`` are converted (the text kept when that fails); objects,
arrays and untyped values are read as JSON (then as a Python literal), else kept as text;
``null`` is null. A parameter the tool does not declare stays text. A missing
``</tool_call>`` at the end of the output is forgiven; a block without ``<function=…>`` is
content, as written.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from blink.dpu.tool_parsers.base import ParsedToolCall, ToolCallParser, skip_ws

START = "<tool_call>"
END = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                        re.DOTALL)


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    if value.lower() == "null":
        return None
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["string", "null"]: the first real type
        kind = next((k for k in kind if k != "null"), None)
    if schema is None or kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind in ("integer", "int"):
        try:
            return int(value)
        except ValueError:
            return value
    if kind in ("number", "float"):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in \
            value.lower() else number
    if kind in ("boolean", "bool"):
        low = value.lower()
        return low == "true" if low in ("true", "false") else value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return value


def parse_function_block(block: str, tools: list[dict[str, Any]] | None
                         ) -> tuple[str, str] | None:
    """``<function=f><parameter=p>v</parameter></function>`` → (name, JSON arguments)."""
    m = _FUNCTION.search(block)
    if m is None:
        return None
    name = m.group(1).strip()
    properties: dict[str, Any] = {}
    for tool in tools or []:
        function = tool.get("function", tool)
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    for p in _PARAMETER.finditer(m.group(2)):
        key, value = p.group(1).strip(), p.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = _typed(value, properties.get(key))
    try:
        return name, json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes)
        return None


class Qwen3CoderToolParser(ToolCallParser):
    name = "qwen3_coder"
    families = "Qwen3-Coder (XML-style <function=...> calls)"
    needs_special_tokens = True  # <tool_call> is an added token in Qwen's tokenizers
    wants_tools = True  # parameter values are typed by the tools' schemas

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.tools = tools
        self._mode = "content"  # content | call | after_call

    def _advance(self, final: bool) -> None:
        text = self._text
        while True:
            if self._mode == "content":
                i = self._content_until(START, final)
                if i < 0:
                    return
                self._mode = "call"
            elif self._mode == "call":
                body_at = self._call_start + len(START)
                end = text.find(END, body_at)
                if end < 0 and not final:
                    return  # the block is still being written
                body = text[body_at:end if end >= 0 else len(text)]
                stop = end + len(END) if end >= 0 else len(text)
                parsed = parse_function_block(body, self.tools)
                if parsed is None:
                    self.content += text[self._call_start:stop]  # not a call: as written
                else:
                    self.calls.append(ParsedToolCall(parsed[0], parsed[1],
                                                     raw=text[self._call_start:stop]))
                self._pos, self._mode = stop, "after_call"
            else:  # after_call: drop the whitespace between and after blocks
                self._pos = skip_ws(text, self._pos)
                if self._pos >= len(text):
                    return
                self._mode = "content"
