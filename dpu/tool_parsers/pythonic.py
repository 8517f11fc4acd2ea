"""Pythonic tool calls, as Llama 3.2 / Llama 4 and other models prompted with vLLM's pythonic
templates write them: the whole answer is a Python list of calls with keyword arguments,

    [get_weather(city="Paris", days=[1, 2]), get_time()]

(``llama4_pythonic``: Llama 4 may wrap it in ``<|python_start|>`` … ``<|python_end|>``).
Arguments are Python literals (strings, numbers, ``True``/``False``/``None``, lists, dicts),
passed on as JSON. As in vLLM, an answer is calls only when it opens with the list; any other
answer is content, streamed as it comes. A list that does not parse as calls (positional
arguments, expressions, ``[1, 2]``) is content too, as written; text after the list is content.
"""
from __future__ import annotations

import ast
import json
from typing import Any

from blink.dpu.tool_parsers.base import ParsedToolCall, ToolCallParser

PY_START = "<|python_start|>"
PY_END = "<|python_end|>"


def parse_pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """``[f(a=1), g()]`` → [(name, JSON arguments)], or None when it is not such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        arguments: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                arguments[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        try:
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        except (TypeError, ValueError):  # a set, bytes, complex: not JSON
            return None
    return calls


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


class PythonicToolParser(ToolCallParser):
    name = "pythonic"
    families = "Llama 3.2 / Llama 4 with pythonic templates, ToolACE"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # start | calls | content

    def _advance(self, final: bool) -> None:
        text = self._text
        if self._mode == "start":
            lead = text[self._pos:].lstrip()
            if not lead:
                if final:
                    self._emit_content(len(text))
                return
            if lead.startswith("[") or lead.startswith(PY_START):
                self._mode, self._call_start = "calls", self._pos
            elif not final and PY_START.startswith(lead):
                return  # may still become <|python_start|>
            else:
                self._mode = "content"
        if self._mode == "content":
            self._emit_content(len(text))
            return
        body = text[self._call_start:].strip()
        tagged = body.startswith(PY_START)
        if tagged:
            body = body[len(PY_START):]
        end = body.find(PY_END)
        rest_at = None
        if end >= 0:
            body, rest_at = body[:end], text.find(PY_END, self._call_start) + len(PY_END)
        elif not final and (tagged or not body.rstrip().endswith("]")):
            return  # the list (or the tagged block) is not closed yet
        calls = parse_pythonic_calls(body)
        if calls is None:
            if not final and rest_at is None:
                return  # a "]" inside the arguments: wait for more
            self._mode = "content"  # not calls: the text is content, as written
            self._emit_content(len(text))
            return
        raw = text[self._call_start:rest_at if rest_at is not None else len(text)]
        for name, arguments in calls:
            self.calls.append(ParsedToolCall(name, arguments, raw=raw))
        self._pos = rest_at if rest_at is not None else len(text)
        self._mode = "content"  # whatever follows the list is content
        self._emit_content(len(text))


class Llama4PythonicToolParser(PythonicToolParser):
    name = "llama4_pythonic"
    families = "Llama 4 (pythonic calls, <|python_start|> tags)"
    needs_special_tokens = True  # <|python_start|> / <|python_end|> are special tokens
