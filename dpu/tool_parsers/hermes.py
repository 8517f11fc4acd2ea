"""Hermes-style tool calls, as Qwen2.5, Qwen3, QwQ and NousResearch's Hermes models write them:

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Any number of ``<tool_call>`` blocks; the text outside them is content (the whitespace right
after a block is dropped). A missing ``</tool_call>`` at the end of the output is forgiven.
"""
from __future__ import annotations

from blink.dpu.tool_parsers.base import ToolCallParser, skip_ws

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolCallParser):
    name = "hermes"
    families = "Qwen2.5, Qwen3, QwQ, Hermes 2/3"
    needs_special_tokens = True  # Hermes 2 Pro's <tool_call> is an added special token

    def __init__(self) -> None:
        super().__init__()
        self._mode = "content"  # content | call | end_tag | after_call

    def _advance(self, final: bool) -> None:
        text = self._text
        while True:
            if self._mode == "content":
                i = self._content_until(START, final)
                if i < 0:
                    return
                self._pos = skip_ws(text, i + len(START))
                if self._pos >= len(text) and not final:
                    self._pos = i  # wait for the object (the tag is held back)
                    return
                self._mode = "call"
            elif self._mode == "call":
                result = self._scan_call(final)
                if result == "more":
                    return
                self._mode = "end_tag" if result == "done" else "content"
            elif self._mode == "end_tag":
                pos = skip_ws(text, self._pos)
                if text.startswith(END, pos):
                    self._pos, self._mode = pos + len(END), "after_call"
                elif not final and END.startswith(text[pos:]):
                    return  # the end tag may still be arriving
                else:
                    self._mode = "after_call"  # no end tag: take the call as it is
            else:  # after_call: drop the whitespace between and after blocks
                self._pos = skip_ws(text, self._pos)
                if self._pos >= len(text):
                    return
                self._mode = "content"
