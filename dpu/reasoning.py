"""Reasoning parsers (``--reasoning-parser``): a thinking model's ``<think>…</think>`` text
split from its answer, whole or streamed.

``deepseek_r1`` (DeepSeek-R1 and its distills): everything up to ``</think>`` is reasoning;
the opening ``<think>`` may be missing (the chat template writes it into the prompt), and an
output without ``</think>`` is all reasoning (vLLM's reading). ``qwen3`` (Qwen3, QwQ): the
reasoning is the ``<think>…</think>`` block the output opens with, or, when the rendered
prompt already ends with an open ``<think>`` (Qwen3-Thinking-2507's templates), the text up to
``</think>``; ``chat_template_kwargs: {"enable_thinking": false}`` turns it off (the template
then renders an empty block and the whole output is the answer).

The parser is incremental (:meth:`ReasoningParser.feed`): each piece of output is split
into its reasoning part and its content part, holding back only text that may still be a
tag, so a streamed answer and a whole one agree however the text was chunked. The content
(whitespace right after ``</think>`` dropped) is what the tool-call parser then reads.

A JSON constraint (structured outputs, a forced tool choice) starts after the reasoning
(:func:`after_thinking`): the grammar lets the model think freely up to ``</think>``, then
holds it to the schema.
"""
from __future__ import annotations

from typing import Any, ClassVar

from blink.dpu.tool_parsers.base import partial_prefix_len

START = "<think>"
END = "</think>"


class ReasoningParser:
    """Splits one choice's output into reasoning and content (see the module docstring)."""

    #: the ``--reasoning-parser`` name
    name: ClassVar[str] = ""
    #: the model families whose output it reads
    families: ClassVar[str] = ""
    #: reasoning is open from the first token even without ``<think>`` in the output
    open_without_tag: ClassVar[bool] = False

    def __init__(self, prompt_opens_thinking: bool = False) -> None:
        self.reasoning = ""
        self.content = ""
        self.ended = False  # ``</think>`` seen (or the output is known to have no reasoning)
        self._open = self.open_without_tag or prompt_opens_thinking
        self._mode = "start"  # start | reasoning | content_start | content
        self._buf = ""

    @classmethod
    def active(cls, chat_template_kwargs: dict | None) -> bool:
        """Whether this request's output holds reasoning at all."""
        return True

    @property
    def opens_at_start(self) -> bool:
        """The output is reasoning from its first token, without writing ``<think>``."""
        return self._open

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Add a piece of output; returns (new reasoning, new content)."""
        self._buf += text
        reasoning, content = "", ""
        while True:
            buf = self._buf
            if self._mode == "start":
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    self._buf = stripped[len(START):]
                    self._mode = "reasoning"
                    continue
                if not final and START.startswith(stripped):
                    break  # "" or a prefix of <think>: wait
                self._mode = "reasoning" if self._open else "content_start"
                if self._mode == "content_start":
                    self.ended = True
                continue
            if self._mode == "reasoning":
                i = buf.find(END)
                if i >= 0:
                    reasoning += buf[:i]
                    self._buf = buf[i + len(END):]
                    self._mode, self.ended = "content_start", True
                    continue
                keep = 0 if final else partial_prefix_len(buf, 0, END)
                reasoning += buf[:len(buf) - keep]
                self._buf = buf[len(buf) - keep:]
                break
            if self._mode == "content_start":
                stripped = buf.lstrip()
                if not stripped:
                    self._buf = ""
                    break
                self._buf, self._mode = stripped, "content"
                continue
            content += buf
            self._buf = ""
            break
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    families = "DeepSeek-R1 and its distills"
    open_without_tag = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    families = "Qwen3, QwQ (enable_thinking honoured)"

    @classmethod
    def active(cls, chat_template_kwargs: dict | None) -> bool:
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


#: ``--reasoning-parser`` name → parser class
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block."""
    i = prompt_tail.rfind(START)
    return i >= 0 and END not in prompt_tail[i:]


def after_thinking(so: Any, special_id: Any, opened: bool) -> Any:
    """A structured-output constraint ``so`` (a JSON schema or ``json_object``: structured
    outputs, a forced tool choice) that starts after the reasoning: ``<think>`` (unless
    ``opened``: the prompt or the parser's reading opens it), free text up to ``</think>`` (a
    lazy lexeme: it ends at the first ``</think>``), optional whitespace, then ``so``'s JSON.
    None for kinds this cannot wrap (regex, choice, Lark grammars, structural tags).
    ``special_id(text)``: the token id of ``text`` when it is one special token."""
    from blink.dpu.tool_calling import _lark_json, _literal
    from blink.shared.structured_outputs import StructuredOutputs

    if so.kind not in ("json", "json_object"):
        return None
    schema = so.schema_dict() if so.kind == "json" else {"type": "object"}
    if not isinstance(schema, dict):
        return None
    opener = "" if opened else _literal(START, special_id) + " "
    lark = (f"start: {opener}thinking answer | {opener}thinking SPACE answer\n"
            f"thinking[lazy]: THOUGHT {_literal(END, special_id)}\n"
            f"THOUGHT: /(.|\\n)*/\n"
            f"SPACE: /[ \\t\\r\\n]+/\n"
            f"answer: {_lark_json(schema)}\n")
    return StructuredOutputs(grammar=lark)
