"""The machinery every tool-call parser shares: the parsed call, the incremental scanner of a
``{"name": ..., "arguments": ...}`` object, and the parser base class.

A parser is fed the choice's text piece by piece (:meth:`ToolCallParser.feed`, then
:meth:`ToolCallParser.finish`) and keeps two things that only ever grow: :attr:`content`
(the text meant for the user) and :attr:`calls` (the tool calls, each announced once its name
is complete, its ``arguments`` growing as the model writes them). The whole-text answer is
the state after ``finish()``; a stream sends the growth after each piece
(:class:`blink.dpu.tool_parsers.stream.ToolCallStream`). Both read the same state, so a
streamed answer and a whole one always agree, however the text was chunked.

Arguments are passed on as the model wrote them (the raw JSON text of the value), so the
streamed fragments are exactly the pieces of the final string; a string-valued ``arguments``
(``"arguments": "{\\"a\\": 1}"``) is decoded, and a call without arguments gets ``"{}"``.
Text that looked like the start of a call but turned out not to be one before its name was
complete goes back into the content; once a call is announced it stays, with the arguments
written until the text went wrong (or was cut by ``max_tokens``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar

_WS = " \t\r\n"
# the run of plain characters inside a JSON string (up to a quote or a backslash)
_STRING_RUN = re.compile(r'[^"\\]+')


@dataclass
class ParsedToolCall:
    """One tool call as parsed so far: ``name`` is final; ``arguments`` (JSON text) only grows."""

    name: str
    arguments: str = ""
    #: the call's text as the model wrote it (set once the call is complete): what becomes
    #: content if its arguments turn out not to be a JSON object
    raw: str = ""


def partial_prefix_len(text: str, start: int, tag: str) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of ``tag``
    (text that may still turn into ``tag`` and so must be held back)."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - k:]):
            return k
    return 0


def skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in _WS:
        pos += 1
    return pos


class JsonValueSkipper:
    """Walks one JSON value incrementally (strings, nesting, primitives) without building it;
    the caller records the consumed text if it wants it. Syntax inside is not checked: the
    value's end is what matters (a broken value reads as arguments written as they came)."""

    def __init__(self) -> None:
        self.done = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False  # a primitive (number, true, ...) at depth 0 has begun

    def advance(self, text: str, pos: int, final: bool) -> int:
        n = len(text)
        while pos < n and not self.done:
            c = text[pos]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.done = True
                else:
                    m = _STRING_RUN.match(text, pos)
                    pos = m.end() if m else pos + 1
                    continue
                pos += 1
                continue
            if c == '"':
                if self._started:  # "12"x: a primitive ends where a string would begin
                    self.done = True
                    break
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                if self._depth == 0:
                    self.done = True  # the closer of the enclosing object ends a primitive
                    break
                self._depth -= 1
                if self._depth == 0:
                    self.done = True
            elif self._depth == 0 and (c in _WS or c == ","):
                if self._started:
                    self.done = True
                    break
            elif self._depth == 0:
                self._started = True
            pos += 1
        if final and self._started and self._depth == 0 and not self._in_string:
            self.done = True
        return pos


class CallObjectScanner:
    """Scans one call object ``{"name": "...", "arguments": {...}}`` incrementally.

    ``arg_keys`` names the key(s) holding the arguments (``arguments``; Llama 3 writes
    ``parameters``); other keys are skipped. States: ``start`` (expects ``{``), ``key``,
    ``colon``, ``value``, ``after`` (``,`` or ``}``), then ``done`` or ``error``.
    """

    def __init__(self, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.arg_keys = arg_keys
        self.state = "start"
        self.name: str | None = None
        self.arguments = ""
        self.has_arguments = False
        self._key = ""
        self._after_comma = False  # a key must follow ("}" right after "," is an error)
        self._raw = ""  # the string being read (key, name or string-valued arguments)
        self._string_escape = False
        self._value: JsonValueSkipper | None = None
        self._value_kind = ""  # "name", "args", "args_string", "skip"

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def error(self) -> bool:
        return self.state == "error"

    def _read_string(self, text: str, pos: int) -> tuple[int, bool]:
        """Append a JSON string's raw characters to ``_raw``; (new pos, closed)."""
        n = len(text)
        while pos < n:
            c = text[pos]
            if self._string_escape:
                self._string_escape = False
                self._raw += c
            elif c == "\\":
                self._string_escape = True
                self._raw += c
            elif c == '"':
                return pos + 1, True
            else:
                m = _STRING_RUN.match(text, pos)
                end = m.end() if m else pos + 1
                self._raw += text[pos:end]
                pos = end
                continue
            pos += 1
        return pos, False

    def _decoded(self) -> str | None:
        try:
            value = json.loads('"' + self._raw + '"')
        except ValueError:
            return None
        return value if isinstance(value, str) else None

    def advance(self, text: str, pos: int, final: bool = False) -> int:
        """Consume what of ``text[pos:]`` can be consumed; returns the new position."""
        n = len(text)
        while pos < n and self.state not in ("done", "error"):
            state = self.state
            if state in ("start", "key", "colon", "after", "value_ws"):
                pos = skip_ws(text, pos)
                if pos >= n:
                    break
                c = text[pos]
                if state == "start":
                    self.state = "key" if c == "{" else "error"
                    pos += c == "{"
                elif state == "key":
                    if c == '"':
                        self._raw, self.state = "", "key_string"
                    elif c == "}" and not self._after_comma:
                        self.state = "done"
                    else:
                        self.state = "error"
                        break
                    pos += 1
                elif state == "colon":
                    if c != ":":
                        self.state = "error"
                        break
                    self.state = "value_ws"
                    pos += 1
                elif state == "value_ws":
                    self._start_value(c)
                    if self._value_kind in ("name", "args_string"):
                        pos += 1  # the opening quote
                elif state == "after":
                    if c == ",":
                        self.state, self._after_comma = "key", True
                    elif c == "}":
                        self.state = "done"
                    else:
                        self.state = "error"
                        break
                    pos += 1
            elif state == "key_string":
                pos, closed = self._read_string(text, pos)
                if closed:
                    key = self._decoded()
                    if key is None:
                        self.state = "error"
                        break
                    self._key = key
                    self.state = "colon"
            elif state == "string_value":
                pos, closed = self._read_string(text, pos)
                if closed:
                    value = self._decoded()
                    if value is None:
                        self.state = "error"
                        break
                    if self._value_kind == "name":
                        self.name = value
                    else:
                        self.arguments, self.has_arguments = value, True
                    self.state = "after"
            elif state == "value":
                assert self._value is not None
                start = pos
                pos = self._value.advance(text, pos, final)
                if self._value_kind == "args":
                    self.arguments += text[start:pos]
                if self._value.done:
                    self.state = "after"
        if final and self.state == "value" and self._value is not None:
            self._value.advance(text, pos, True)
            if self._value.done:
                self.state = "after"
        return pos

    def _start_value(self, first: str) -> None:
        self._raw, self._string_escape = "", False
        if self._key == "name":
            if first != '"':
                self.state = "error"
                return
            self._value_kind, self.state = "name", "string_value"
        elif self._key in self.arg_keys and not self.has_arguments:
            if first == '"':
                self._value_kind, self.state = "args_string", "string_value"
                return
            self._value_kind, self.state = "args", "value"
            self.has_arguments = True
            self._value = JsonValueSkipper()
        else:
            self._value_kind, self.state = "skip", "value"
            self._value = JsonValueSkipper()


class ToolCallParser:
    """Base of the incremental parsers (see the module docstring). Subclasses implement
    :meth:`_advance`, consuming ``self._text`` from ``self._pos`` as far as they can be sure
    of (all of it when ``final``), and use :meth:`_emit_content` / :meth:`_open_call` /
    :meth:`_close_call`."""

    #: the ``--tool-call-parser`` name
    name: ClassVar[str] = ""
    #: the model families whose output this parser reads (for docs and --help)
    families: ClassVar[str] = ""
    #: the markers it reads are special tokens: decode them (skip_special_tokens=False)
    needs_special_tokens: ClassVar[bool] = False
    #: the ids of this format's calls: "random" (OpenAI style) or "mistral" (9 alphanumerics,
    #: which Mistral's chat templates demand when the call is sent back)
    id_style: ClassVar[str] = "random"

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[ParsedToolCall] = []
        self.finished = False
        self._text = ""
        self._pos = 0
        self._scanner: CallObjectScanner | None = None
        self._call_start = 0  # where the current call's raw text began (for a fallback)
        self._call: ParsedToolCall | None = None

    def feed(self, text: str) -> None:
        """Add the next piece of the model's output."""
        if self.finished:
            raise RuntimeError("feed() after finish()")
        self._text += text
        self._advance(final=False)

    def finish(self) -> None:
        """The output is complete: release held-back text, close an unfinished call."""
        if not self.finished:
            self._advance(final=True)
            self.finished = True

    @classmethod
    def parse(cls, text: str) -> "ToolCallParser":
        """Parse a whole output (the same state a stream ends in)."""
        parser = cls()
        parser.feed(text)
        parser.finish()
        return parser

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def open_call(self) -> "ParsedToolCall | None":
        """The call still being written (its arguments may grow), if any."""
        return self._call

    # -- helpers for subclasses ----------------------------------------------------------
    def _emit_content(self, end: int) -> None:
        """``self._text[self._pos:end]`` is content."""
        if end > self._pos:
            self.content += self._text[self._pos:end]
            self._pos = end

    def _content_until(self, tag: str, final: bool) -> int:
        """Content mode: emit the text before the next ``tag`` as content and return where
        the tag starts (also remembered as ``_call_start``), or -1 when there is none yet
        (a tail that could begin the tag is held back unless the output is ``final``)."""
        text = self._text
        i = text.find(tag, self._pos)
        if i < 0:
            keep = 0 if final else partial_prefix_len(text, self._pos, tag)
            self._emit_content(len(text) - keep)
            return -1
        self._emit_content(i)
        self._call_start = i
        return i

    def _scan_call(self, final: bool, arg_keys: tuple[str, ...] = ("arguments", "parameters")
                   ) -> str:
        """Drive the call object starting at ``self._pos`` (a scanner is created on the first
        call). Returns "more" (need more text), "done" (a call was completed) or "failed"
        (no call: the raw text since ``_call_start`` is content again, or, for an announced
        call, the call ends as it is)."""
        if self._scanner is None:
            self._scanner = CallObjectScanner(arg_keys)
            self._call = None
        scanner = self._scanner
        self._pos = scanner.advance(self._text, self._pos, final)
        if scanner.name is not None and self._call is None:
            self._call = ParsedToolCall(scanner.name, scanner.arguments)
            self.calls.append(self._call)
        if self._call is not None:
            self._call.arguments = scanner.arguments
        if scanner.done or (final and self._call is not None) or (
                scanner.error and self._call is not None):
            if self._call is None:  # an object without a name is no call
                return self._fail_call()
            if not scanner.has_arguments:
                self._call.arguments = "{}"
            self._call.raw = self._text[self._call_start:self._pos]
            self._scanner, self._call = None, None
            return "done"
        if scanner.error or final:
            return self._fail_call()
        return "more"

    def _step_call_list(self, mode: str, final: bool, arg_keys: tuple[str, ...]) -> str | None:
        """One step through a JSON array of call objects whose ``[`` is consumed, in ``mode``
        "item" (a call object comes next) or "next" (a ``,`` or the ``]``). Returns the next
        mode: "item", "next", "end" (the ``]`` consumed), "content" (the rest is not calls),
        or None: wait for more text."""
        text = self._text
        if mode == "item":
            if self._scanner is None:  # between items (not inside a call's strings)
                self._pos = skip_ws(text, self._pos)
            if self._pos >= len(text) and not final:
                return None
            result = self._scan_call(final, arg_keys)
            if result == "more":
                return None
            return "next" if result == "done" else "content"
        pos = skip_ws(text, self._pos)
        if pos >= len(text):
            if final:
                self._pos = pos
            return None
        if text[pos] == ",":
            self._call_start = self._pos = pos + 1
            return "item"
        if text[pos] == "]":
            self._pos = pos + 1
            return "end"
        self._pos = pos
        return "content"

    def _fail_call(self) -> str:
        """The text since ``_call_start`` was not a call: it is content after all."""
        self._scanner, self._call = None, None
        self.content += self._text[self._call_start:self._pos]
        return "failed"
