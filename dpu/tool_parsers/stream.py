"""A parser's growing state turned into OpenAI's answer shapes: the whole message's
``content`` + ``tool_calls``, or stream deltas (content pieces; for each call first
``index``, ``id``, ``type`` and ``function.name``, then ``function.arguments`` fragments)."""
from __future__ import annotations

import secrets
import string
import uuid
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


class ToolCallStream:
    """Feeds a parser and reports what is new since the last call (see the module docstring).

    ``max_calls`` (1 when the request sets ``parallel_tool_calls: false``) keeps only the
    first calls, as vLLM does."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.ids: list[str] = []
        self._content_sent = 0
        self._args_sent: list[int] = []

    @property
    def calls(self) -> list[Any]:
        calls = self.parser.calls
        return calls if self.max_calls is None else calls[: self.max_calls]

    def step(self, text: str, final: bool = False) -> ToolCallDelta:
        """Feed ``text`` (and finish when ``final``); return the growth."""
        if text:
            self.parser.feed(text)
        if final:
            self.parser.finish()
        delta = ToolCallDelta(content=self.parser.content[self._content_sent:])
        self._content_sent = len(self.parser.content)
        for index, call in enumerate(self.calls):
            if index == len(self.ids):
                self.ids.append(make_tool_call_id(self.parser.id_style))
                self._args_sent.append(len(call.arguments))
                delta.tool_calls.append({
                    "index": index, "id": self.ids[index], "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self._args_sent[index]:
                delta.tool_calls.append({
                    "index": index,
                    "function": {"arguments": call.arguments[self._args_sent[index]:]}})
                self._args_sent[index] = len(call.arguments)
        return delta

    def message_tool_calls(self) -> list[dict[str, Any]]:
        """The finished calls as a message's ``tool_calls`` (after the final :meth:`step`)."""
        while len(self.ids) < len(self.calls):
            self.ids.append(make_tool_call_id(self.parser.id_style))
        return [{"id": self.ids[i], "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(self.calls)]
