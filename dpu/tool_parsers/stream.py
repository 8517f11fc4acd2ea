"""A parser's growing state turned into OpenAI's answer shapes: the whole message's
``content`` + ``tool_calls``, or stream deltas (content pieces; each call once it is
complete: ``index``, ``id``, ``type``, ``function.name`` and its whole ``function.arguments``).

A call reaches the client only once it is complete and its arguments are a JSON object, so
the arguments a client gets always parse (an empty text counts as ``{}``); a call that is
cut (by ``length``) or whose arguments are not a JSON object becomes plain content, as its
raw text (vLLM does the same)."""
from __future__ import annotations

import secrets
import string
import uuid
import json
from dataclasses import dataclass, field
from typing import Any

from blink.dpu.tool_parsers.base import ToolCallParser

_ALPHANUMERIC = string.ascii_letters + string.digits


def make_tool_call_id(style: str = "random") -> str:
    """A new call id: ``chatcmpl-tool-<32 hex>`` (vLLM's), or for Mistral 9 alphanumerics."""
    if style == "mistral":
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """What one piece of output adds: content text and tool-call deltas (OpenAI's
    ``delta.tool_calls`` items as dicts)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def arguments_object(arguments: str) -> str | None:
    """``arguments`` when it is a JSON object's text ("" reads as ``{}``), else None."""
    if not arguments.strip():
        return "{}"
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    return arguments if isinstance(value, dict) else None


class ToolCallStream:
    """Feeds a parser and reports what is new since the last call (see the module docstring).

    ``max_calls`` (1 when the request sets ``parallel_tool_calls: false``) keeps only the
    first calls, as vLLM does."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.ids: list[str] = []
        self._content_sent = 0
        self._settled = 0  # parser calls decided so far (valid: sent; invalid: content)
        self._valid: list[Any] = []  # the calls that reach the client, with their arguments
        self._rejected = ""  # raw text of calls that became content

    @property
    def calls(self) -> list[Any]:
        return self._valid if self.max_calls is None else self._valid[: self.max_calls]

    @property
    def content(self) -> str:
        """The content so far: the parser's, then the raw text of rejected calls."""
        return self.parser.content + self._rejected

    def _settle(self, final: bool) -> tuple[list[Any], str]:
        """Decide the calls that are complete: (newly valid calls, newly rejected text)."""
        calls = self.parser.calls
        open_call = self.parser.open_call()
        new_valid, rejected = [], ""
        while self._settled < len(calls):
            call = calls[self._settled]
            if not final and call is open_call:
                break  # still being written
            self._settled += 1
            arguments = arguments_object(call.arguments)
            if arguments is None:
                rejected += call.raw or call.arguments  # what the model wrote
            else:
                call.arguments = arguments
                new_valid.append(call)
        return new_valid, rejected

    def step(self, text: str, final: bool = False) -> ToolCallDelta:
        """Feed ``text`` (and finish when ``final``); return the growth."""
        if text:
            self.parser.feed(text)
        if final:
            self.parser.finish()
        new_valid, rejected = self._settle(final)
        self._rejected += rejected
        delta = ToolCallDelta(content=self.content[self._content_sent:])
        self._content_sent = len(self.content)
        self._valid += new_valid
        for index, call in enumerate(self.calls):
            if index == len(self.ids):
                self.ids.append(make_tool_call_id(self.parser.id_style))
                delta.tool_calls.append({
                    "index": index, "id": self.ids[index], "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}})
        return delta

    def message_tool_calls(self) -> list[dict[str, Any]]:
        """The finished calls as a message's ``tool_calls`` (after the final :meth:`step`)."""
        while len(self.ids) < len(self.calls):
            self.ids.append(make_tool_call_id(self.parser.id_style))
        return [{"id": self.ids[i], "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(self.calls)]
