"""The request side of tool calling: which tools a chat request offers, what ``tool_choice``
means for it, and what that asks of the template, the sampler and the output parser.

Rules (vLLM's, whose wording clients already recognise):

- ``tool_choice`` defaults to ``"auto"`` when ``tools`` are given, else ``"none"``; a
  ``tool_choice`` other than ``"none"`` without ``tools`` is a 400; ``"required"`` with an
  empty ``tools`` list behaves as ``"none"`` (as OpenAI does).
- ``"auto"`` needs the server flags ``--enable-auto-tool-choice`` and ``--tool-call-parser``
  (400 with vLLM's message otherwise); the model writes calls in its own format and the
  parser reads them.
- ``"required"`` and a named function (``{"type": "function", "function": {"name": ...}}``,
  400 if no tool has that name) are enforced by the grammar: the output is constrained to
  vLLM's JSON (an array of ``{"name", "parameters"}`` calls; the named function's
  arguments) and read as such, whatever ``--tool-call-parser`` is.
- ``"none"``: no call is parsed; the tools are still rendered into the prompt (vLLM's
  default) unless ``--exclude-tools-when-tool-choice-none``.
- ``parallel_tool_calls: false`` keeps only the first call (vLLM).
- Finish reason ``"tool_calls"`` when ``auto``/``required`` produced calls and the model
  stopped by itself; a named choice finishes with ``"stop"`` (as OpenAI's API does).

Tools are validated: only ``function`` tools, names unique and non-empty, ``parameters`` a
JSON schema (checked against its meta-schema) of type object; each problem is a 400 naming
the field. A model whose chat template never mentions ``tools`` cannot see them, so
``"auto"`` with such a template uses the generic format (llama.cpp's): the tools go into the
system prompt and the answer is constrained to JSON (:mod:`blink.dpu.tool_parsers.generic`);
``--tool-call-parser generic`` picks that format for every template.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from blink.dpu.errors import bad_request
from blink.dpu.tool_parsers import (
    TOOL_PARSERS,
    GenericToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolCallParser,
    ToolCallStream,
    generic_schema,
    named_schema,
    required_schema,
)
from blink.dpu.tool_parsers.forced import hoist_defs
from blink.shared.structured_outputs import StructuredOutputs, StructuredOutputsError

#: Most tools one request may offer (OpenAI's limit).
MAX_TOOLS = 128
#: Longest function name accepted (OpenAI allows 64; some agent frameworks prefix names).
MAX_FUNCTION_NAME = 256

# vLLM's wording
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'

ToolChoice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolCallingConfig:
    """The server's tool-calling flags (``blink serve``)."""

    #: ``--enable-auto-tool-choice``: let the model decide to call tools (``tool_choice="auto"``)
    enable_auto_tool_choice: bool = False
    #: ``--tool-call-parser``: the format ``auto`` calls are read in (a :data:`TOOL_PARSERS` key)
    tool_call_parser: str | None = None
    #: ``--exclude-tools-when-tool-choice-none``: do not render tools for ``tool_choice="none"``
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools and ``tool_choice`` ask for."""

    choice: ToolChoice
    #: the tools, validated, as the chat template receives them (None: render no tools)
    template_tools: list[dict[str, Any]] | None = None
    #: the named function (choice "named")
    function_name: str | None = None
    #: the grammar a forced choice puts on the output (choice "required" / "named")
    structured_outputs: StructuredOutputs | None = None
    #: the parser of ``auto`` output
    parser_class: type[ToolCallParser] | None = None
    #: ``parallel_tool_calls: false``
    single_call: bool = False
    #: the generic format: the tools Blink writes into the system prompt itself (None: the
    #: template gets them, or none are shown)
    system_tools: list[dict[str, Any]] | None = None

    def as_generic(self) -> "ToolPlan":
        """This ``auto`` plan in the generic format (a template that never renders tools)."""
        assert self.choice == "auto" and self.template_tools is not None
        return _generic_plan(self.template_tools, self.single_call)

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def needs_special_tokens(self) -> bool:
        """The auto parser reads markers that are special tokens (they must be decoded)."""
        return self.parser_class is not None and self.parser_class.needs_special_tokens

    def new_stream(self) -> ToolCallStream | None:
        """A fresh parser for one choice's output (None when no calls are parsed)."""
        parser: ToolCallParser
        if self.choice == "auto":
            assert self.parser_class is not None
            # a parser that types arguments by the tools' schemas (qwen3_coder) gets them
            parser = self.parser_class(self.template_tools or self.system_tools) \
                if getattr(self.parser_class, "wants_tools", False) else self.parser_class()
        elif self.choice == "required":
            parser = RequiredToolParser()
        elif self.choice == "named":
            assert self.function_name is not None
            parser = NamedToolParser(self.function_name)
        else:
            return None
        return ToolCallStream(parser, max_calls=1 if self.single_call else None)

    def finish_reason(self, engine_reason: str | None, made_calls: bool) -> str | None:
        """The choice's finish reason: "tool_calls" when auto/required calls ended the turn."""
        if made_calls and engine_reason == "stop" and self.choice in ("auto", "required"):
            return "tool_calls"
        return engine_reason


NO_TOOLS = ToolPlan(choice="none")


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool | None, config: ToolCallingConfig) -> ToolPlan:
    """Validate a chat request's tool fields against the server's flags (400 on a problem)."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise bad_request(f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, "
                          '"none", "auto" or "required" are supported.', param="tool_choice")
    if not isinstance(tool_choice, (str, dict)):
        raise bad_request(f"Invalid value for `tool_choice`: {tool_choice!r}. {_NAMED_USAGE}",
                          param="tool_choice")
    if tool_choice != "none" and tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    validated = validate_tools(tools) if tools is not None else None
    if tool_choice == "required" and not validated:
        tool_choice = "none"  # OpenAI: nothing to require
    single = parallel_tool_calls is False
    if tool_choice == "none":
        keep = validated if validated and not config.exclude_tools_when_tool_choice_none \
            else None
        return ToolPlan(choice="none", template_tools=keep)
    assert validated is not None
    if tool_choice == "auto":
        if not config.enable_auto_tool_choice or config.tool_call_parser is None:
            raise bad_request(AUTO_NEEDS_FLAGS, param="tool_choice")
        if TOOL_PARSERS[config.tool_call_parser] is GenericToolParser:
            return _generic_plan(validated, single)
        return ToolPlan(choice="auto", template_tools=validated, single_call=single,
                        parser_class=TOOL_PARSERS[config.tool_call_parser])
    if tool_choice == "required":
        return ToolPlan(choice="required", template_tools=validated, single_call=single,
                        structured_outputs=_constraint(required_schema(validated)))
    name = _named_function(tool_choice)
    tool = next((t for t in validated if t["function"]["name"] == name), None)
    if tool is None:
        raise bad_request("The tool specified in `tool_choice` does not match any of the "
                          "specified `tools`", param="tool_choice")
    return ToolPlan(choice="named", template_tools=validated, function_name=name,
                    structured_outputs=_constraint(named_schema(tool)))


def _generic_plan(tools: list[dict[str, Any]], single: bool) -> ToolPlan:
    """``auto`` in the generic format: the tools in the system prompt (not the template's
    ``tools``), the answer constrained to ``{"tool_calls": [...]}`` or ``{"response": ...}``."""
    return ToolPlan(choice="auto", system_tools=tools, single_call=single,
                    parser_class=GenericToolParser,
                    structured_outputs=_constraint(generic_schema(tools, single)))


def _named_function(choice: dict[str, Any]) -> str:
    if choice.get("type", "function") != "function":
        raise bad_request(f"Invalid `type` in `tool_choice`: {choice.get('type')!r}. "
                          f"{_NAMED_USAGE}", param="tool_choice")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                          f"{_NAMED_USAGE}", param="tool_choice")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                          f"{_NAMED_USAGE}", param="tool_choice")
    return name


def _constraint(schema: dict[str, Any]) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=schema)
    except StructuredOutputsError as e:
        raise bad_request(f"The tools cannot be enforced: {e}", param="tools") from None


def validate_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as the template and the grammar get them; a 400 names the first problem."""
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"At most {MAX_TOOLS} tools are supported, got {len(tools)}.",
                          param="tools")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type", "function")
        if kind != "function":
            raise bad_request(f"{where}.type: only 'function' tools are supported, got "
                              f"{kind!r}.", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function must be an object with a 'name'.",
                              param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_FUNCTION_NAME:
            raise bad_request(f"{where}.function.name must be a non-empty string of at most "
                              f"{MAX_FUNCTION_NAME} characters.", param=f"{where}.function.name")
        if name in seen:
            raise bad_request(f"{where}.function.name: the tool name {name!r} is given twice.",
                              param=f"{where}.function.name")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string.",
                              param=f"{where}.function.description")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"{where}.function.strict must be a boolean.",
                              param=f"{where}.function.strict")
        params = function.get("parameters")
        if params is not None:
            problem = _schema_problem(json.dumps(params, sort_keys=True)) \
                if isinstance(params, dict) else "it must be a JSON schema object"
            if problem:
                raise bad_request(f"{where}.function.parameters is not a valid JSON schema: "
                                  f"{problem}", param=f"{where}.function.parameters")
        fn = {k: v for k, v in function.items() if v is not None}
        out.append({"type": "function", "function": fn})
    return out


#: The deepest parameter schema accepted, in levels of JSON nesting. Real tool schemas stay
#: far below it; the bound keeps the (recursive) meta-schema check well inside Python's
#: recursion limit, so the answer does not depend on how deep the caller's stack is or on
#: a library that raised the limit.
MAX_SCHEMA_DEPTH = 64


def json_depth(value: Any) -> int:
    """Levels of nesting of a parsed JSON value (a scalar is 0), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


@lru_cache(maxsize=256)
def _schema_problem(schema_json: str) -> str | None:
    """Why a function's parameter schema is refused (None: fine). Cached: agents send the
    same tools with every turn."""
    import jsonschema  # pure Python; imported on first use

    schema = json.loads(schema_json)
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        return f"it is nested too deeply ({depth} levels; at most {MAX_SCHEMA_DEPTH})"
    kind = schema.get("type")
    if kind is not None and kind != "object":
        return f"a function's parameters must be of type 'object', got {kind!r}"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path)
        return f"{e.message}" + (f" (at {path})" if path else "")
    except RecursionError:  # the meta-schema check recurses per level of the schema
        return "it is nested too deeply"
    return None


# -- tools and a response format in one request ------------------------------------------------

#: JSON layout inside the combined grammars (the same as :mod:`blink.dpu.structured.grammar`'s
#: default for schemas: ``json.dumps``' separators, no other whitespace)
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body for a JSON value valid against ``schema`` (as it is served)."""
    from blink.dpu.structured.grammar import served_schema

    served = served_schema(schema)
    return "%json " + json.dumps({**served, "x-guidance": _JSON_LAYOUT}, ensure_ascii=False)


def _call_object_schema(tools: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One call as the parser reads it: ``{"name": <a tool>, key: <its arguments>}``."""
    named, defs = hoist_defs(tools)
    schema: dict[str, Any] = {"anyOf": [
        {"type": "object", "properties": {"name": a["name"], key: a["parameters"]},
         "required": ["name", key]} for a in named]}
    if defs:
        schema["$defs"] = defs
    return schema


def _literal(text: str, special_id: Any) -> str:
    """A Lark item matching ``text``: the special token itself when ``text`` is one
    (``special_id(text)`` gives its id), else the characters."""
    token = special_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)


def _calls_grammar(parser: str, tools: list[dict[str, Any]], single: bool,
                   special_id: Any) -> str | None:
    """Lark rules ``calls: ...`` for one or more calls (one with ``single``) written as the
    ``auto`` parser reads them; None for a parser without a call grammar."""
    if parser == "hermes":
        call = _lark_json(_call_object_schema(tools, "arguments"))
        more = "" if single else ' ("\\n"? call)*'
        start, end = _literal("<tool_call>", special_id), _literal("</tool_call>", special_id)
        return (f"calls: call{more}\n"
                f'call: {start} "\\n" callobj "\\n" {end}\n'
                f"callobj: {call}\n")
    if parser == "llama3_json":
        call = _lark_json(_call_object_schema(tools, "parameters"))
        more = "" if single else ' ("; " callobj)*'
        return (f'calls: {_literal("<|python_tag|>", special_id)}? callobj{more}\n'
                f"callobj: {call}\n")
    if parser == "mistral":
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": _call_object_schema(tools, "arguments")}
        array["$defs"] = array["items"].pop("$defs", {})
        if single:
            array["maxItems"] = 1
        return f'calls: {_literal("[TOOL_CALLS]", special_id)} {_lark_json(array)}\n'
    return None


def with_response_format(plan: ToolPlan, response: StructuredOutputs,
                         special_id: Any) -> StructuredOutputs:
    """The constraint of a request with tools and a response format, with OpenAI's meaning:
    the tool grammar while the model calls tools, the response schema for its final answer.

    - ``none``: the response format alone;
    - ``required`` / a named function: the call grammar alone (the turn is a call; the
      response format applies to the answer that follows the tool results);
    - ``auto``: either calls, as the parser reads them, or the answer (a 400 for a parser
      without a call grammar, or a response format that is not a JSON schema).
    ``special_id(text)``: the token id of ``text`` when the tokenizer has it as one special
    token, else None."""
    if plan.choice == "none":
        return response
    if plan.choice in ("required", "named"):
        assert plan.structured_outputs is not None
        return plan.structured_outputs
    if response.kind not in ("json", "json_object"):
        raise bad_request("With tools, the response format must be a JSON schema or "
                          f"json_object, got {response.kind}.", param="response_format")
    answer = response.schema_dict() if response.kind == "json" else {"type": "object"}
    if not isinstance(answer, dict):
        raise bad_request("With tools, the response format's schema must be an object.",
                          param="response_format")
    tools = plan.system_tools or plan.template_tools or []
    if plan.parser_class is GenericToolParser:
        try:
            schema = generic_schema(tools, plan.single_call, response_schema=answer)
        except ValueError as e:
            raise bad_request(str(e), param="response_format") from None
        return _constraint(schema)
    name = plan.parser_class.name if plan.parser_class is not None else None
    calls = _calls_grammar(name or "", tools, plan.single_call, special_id)
    if calls is None:
        raise bad_request(f"tools together with a response format need a tool-call parser "
                          f"with a call grammar (hermes, llama3_json, mistral or generic); "
                          f"this server uses {name!r}.", param="response_format")
    lark = f"start: answer | calls\nanswer: {_lark_json(answer)}\n{calls}"
    try:
        return StructuredOutputs(grammar=lark)
    except StructuredOutputsError as e:
        raise bad_request(f"The tools cannot be enforced: {e}", param="tools") from None
