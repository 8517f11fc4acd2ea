"""Llama 3.1/3.2/3.3 JSON tool calls (Meta's "JSON based tool calling" format):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

The output is a tool call when it starts (after whitespace) with ``<|python_tag|>`` or with
``{``; several calls may follow each other, separated by ``;``. ``arguments`` is read as well
as ``parameters``. Anything else is plain content. A ``{...}`` that turns out not to be a call
(no ``name``) is content too.
"""
from __future__ import annotations

from blink.dpu.tool_parsers.base import ToolCallParser, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolCallParser):
    name = "llama3_json"
    families = "Llama 3.1, 3.2, 3.3 (JSON tool calls)"
    needs_special_tokens = True  # <|python_tag|> is a special token

    def __init__(self) -> None:
        super().__init__()
        self._mode = "lead"  # lead | call | between | content

    def _advance(self, final: bool) -> None:
        text = self._text
        while True:
            if self._mode == "lead":
                pos = skip_ws(text, self._pos)
                rest = text[pos:]
                if rest.startswith(PYTHON_TAG):
                    self._call_start = self._pos
                    self._pos, self._mode = skip_ws(text, pos + len(PYTHON_TAG)), "call"
                elif rest.startswith("{"):
                    self._call_start = self._pos
                    self._pos, self._mode = pos, "call"
                elif not final and (not rest or PYTHON_TAG.startswith(rest)):
                    return  # not decided yet
                else:
                    self._mode = "content"
            elif self._mode == "call":
                if self._pos >= len(text) and not final:
                    return
                result = self._scan_call(final)
                if result == "more":
                    return
                self._mode = "between" if result == "done" else "content"
            elif self._mode == "between":
                pos = skip_ws(text, self._pos)
                if pos < len(text) and text[pos] == ";":
                    pos = skip_ws(text, pos + 1)
                if pos >= len(text):
                    if final:
                        self._pos = pos
                    return
                if text[pos] == "{":
                    self._call_start, self._pos, self._mode = pos, pos, "call"
                else:
                    self._pos, self._mode = pos, "content"
            else:
                self._emit_content(len(text))
                return
