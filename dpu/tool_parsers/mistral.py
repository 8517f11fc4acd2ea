"""Mistral tool calls, after the ``[TOOL_CALLS]`` control token:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

as Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct and Mistral Nemo write them, and the
newer form of Mistral Small 3.2, Magistral and Devstral (tokenizer v11 and later):

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

Text before the first ``[TOOL_CALLS]`` is content. Call ids are 9 alphanumeric characters,
which Mistral's chat templates require when the calls are sent back.
"""
from __future__ import annotations

from blink.dpu.tool_parsers.base import (
    JsonValueSkipper,
    ParsedToolCall,
    ToolCallParser,
    skip_ws,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
# a function name in the [ARGS] form may not be longer (OpenAI's limit is 64)
_MAX_NAME = 256


class MistralToolParser(ToolCallParser):
    name = "mistral"
    families = "Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo, Mistral Small 3.x, Magistral"
    needs_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens
    id_style = "mistral"

    def __init__(self) -> None:
        super().__init__()
        # content | open | array_item | array_next | named | named_args | after
        self._mode = "content"
        self._args: JsonValueSkipper | None = None

    def open_call(self) -> ParsedToolCall | None:
        return self.calls[-1] if self._mode == "named_args" else self._call

    def _advance(self, final: bool) -> None:
        text = self._text
        while True:
            mode = self._mode
            if mode == "content":
                i = self._content_until(TOOL_CALLS, final)
                if i < 0:
                    return
                self._pos, self._mode = i + len(TOOL_CALLS), "open"
            elif mode == "open":
                pos = skip_ws(text, self._pos)
                if pos >= len(text):
                    if final:
                        self._pos = pos  # a bare [TOOL_CALLS] at the end: nothing to call
                    return
                if text[pos] == "[":
                    self._pos, self._mode = pos + 1, "array_item"
                elif text[pos] == "{":
                    self._pos, self._mode = pos, "array_item"  # a single object, no list
                else:
                    self._pos, self._mode = pos, "named"
            elif mode == "array_item":
                if self._scanner is None:  # between items (not inside a call's strings)
                    self._pos = skip_ws(text, self._pos)
                if self._pos >= len(text) and not final:
                    return
                if self._scanner is None and self._pos < len(text) and \
                        text[self._pos] == "]" and not self.calls:
                    self._pos, self._mode = self._pos + 1, "after"  # "[]": no calls
                    continue
                result = self._scan_call(final, ("arguments", "parameters"))
                if result == "more":
                    return
                self._mode = "array_next" if result == "done" else "content"
            elif mode == "array_next":
                pos = skip_ws(text, self._pos)
                if pos >= len(text):
                    return
                if text[pos] == ",":
                    self._call_start = pos + 1
                    self._pos, self._mode = pos + 1, "array_item"
                elif text[pos] == "]":
                    self._pos, self._mode = pos + 1, "after"
                else:
                    self._pos, self._mode = pos, "after"
            elif mode == "named":
                i = text.find(ARGS, self._pos)
                if i < 0 or i - self._pos > _MAX_NAME:
                    waiting = len(text) - self._pos <= _MAX_NAME
                    if final or not waiting:
                        self.content += text[self._call_start:self._pos]
                        self._mode = "content"
                        continue
                    return
                name = text[self._pos:i].strip()
                if not name:
                    self.content += text[self._call_start:self._pos]
                    self._mode = "content"
                    continue
                self.calls.append(ParsedToolCall(name))
                self._pos = skip_ws(text, i + len(ARGS))
                self._args, self._mode = JsonValueSkipper(), "named_args"
            elif mode == "named_args":
                assert self._args is not None
                call = self.calls[-1]
                if self._pos >= len(text) and not final:
                    return
                start = self._pos
                self._pos = self._args.advance(text, self._pos, final)
                call.arguments += text[start:self._pos]
                if not (self._args.done or final):
                    return
                if not call.arguments:
                    call.arguments = "{}"
                call.raw = text[self._call_start:self._pos]
                self._args, self._mode = None, "after"
            else:  # after: another [TOOL_CALLS] may follow; other text is content
                self._pos = skip_ws(text, self._pos)
                if self._pos >= len(text):
                    return
                if text.startswith(TOOL_CALLS, self._pos):
                    self._mode = "content"
                elif not final and TOOL_CALLS.startswith(text[self._pos:]):
                    return
                else:
                    self._mode = "content"
