"""Tool-call parsers: the model's text → OpenAI ``tool_calls``, whole or streamed.

``--tool-call-parser NAME`` picks one of :data:`TOOL_PARSERS` for ``tool_choice="auto"``
(``generic``, :mod:`~blink.dpu.tool_parsers.generic`, is also what ``auto`` uses with a chat
template that never renders tools, whatever the flag names);
forced choices (``required``, a named function) are constrained to JSON by the grammar and
read by :mod:`blink.dpu.tool_parsers.forced` whatever the flag is. Every parser is
incremental (:mod:`blink.dpu.tool_parsers.base`), and :class:`ToolCallStream` turns its
state into message fields or stream deltas.
"""
from __future__ import annotations

from blink.dpu.tool_parsers.base import ParsedToolCall, ToolCallParser
from blink.dpu.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    named_schema,
    required_schema,
)
from blink.dpu.tool_parsers.generic import (
    GenericToolParser,
    generic_messages,
    generic_schema,
)
from blink.dpu.tool_parsers.hermes import HermesToolParser
from blink.dpu.tool_parsers.llama3_json import Llama3JsonToolParser
from blink.dpu.tool_parsers.mistral import MistralToolParser
from blink.dpu.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from blink.dpu.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from blink.dpu.tool_parsers.stream import ToolCallDelta, ToolCallStream, make_tool_call_id

#: ``--tool-call-parser`` name → parser class
TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        PythonicToolParser, Llama4PythonicToolParser, Qwen3CoderToolParser,
                        GenericToolParser)
}

__all__ = [
    "TOOL_PARSERS", "GenericToolParser", "HermesToolParser", "Llama3JsonToolParser",
    "Llama4PythonicToolParser", "MistralToolParser", "PythonicToolParser", "Qwen3CoderToolParser",
    "NamedToolParser", "ParsedToolCall", "RequiredToolParser", "ToolCallDelta",
    "ToolCallParser", "ToolCallStream", "generic_messages", "generic_schema",
    "make_tool_call_id", "named_schema", "required_schema",
]
