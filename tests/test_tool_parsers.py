"""The tool-call parsers (blink.dpu.tool_parsers): whole-text results for each format, and
streamed results that equal them however the text is chunked (at every boundary, one
character at a time, inside the tags), with OpenAI-shaped deltas."""
from __future__ import annotations

import json
from typing import Any

import pytest

from blink.dpu.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    Llama4PythonicToolParser,
    MistralToolParser,
    NamedToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    RequiredToolParser,
    ToolCallParser,
    ToolCallStream,
    required_schema,
)

WEATHER = {"city": "Paris", "days": [1, 2], "opts": {"unit": "c", "note": "a \"}\" and ]"}}
W = json.dumps(WEATHER)

QWEN3_CODER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"},
                                         "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "flag": {"type": "boolean"}, "zip": {"type": "string"},
        "x": {"type": ["string", "null"]}}}}},
]

# (parser factory, output text, expected content, expected [(name, arguments dict)])
CASES: list[tuple[Any, str, str, list[tuple[str, Any]]]] = [
    (HermesToolParser, "plain answer, no call", "plain answer, no call", []),
    (HermesToolParser, f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
     "", [("get_weather", WEATHER)]),
    (HermesToolParser,
     f'Let me check.\n<tool_call>\n{{"name": "a", "arguments": {W}}}\n</tool_call>\n'
     f'<tool_call>\n{{"arguments": {{}}, "name": "b"}}\n</tool_call>',
     "Let me check.\n", [("a", WEATHER), ("b", {})]),
    (HermesToolParser, '<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "",
     [("f", {"x": 1})]),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"x": 1}}', "", [("f", {"x": 1})]),
    (HermesToolParser, "a <tool_call> not json </tool_call> b",
     "a <tool_call> not json </tool_call> b", []),
    (HermesToolParser, 'x <tool_call>{"arguments": {}}</tool_call>',
     'x <tool_call>{"arguments": {}}</tool_call>', []),
    (HermesToolParser, "ends with a partial tag <tool_c", "ends with a partial tag <tool_c", []),
    (Llama3JsonToolParser, f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}', "",
     [("get_weather", WEATHER)]),
    (Llama3JsonToolParser, ' {"name": "f", "parameters": {"x": 1}}; {"name": "g", '
     '"parameters": {}}', "", [("f", {"x": 1}), ("g", {})]),
    (Llama3JsonToolParser, "The answer is 4.", "The answer is 4.", []),
    (Llama3JsonToolParser, '{"answer": 4}', '{"answer": 4}', []),
    (MistralToolParser, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}]', "",
     [("get_weather", WEATHER)]),
    (MistralToolParser, 'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, '
     '{"name": "g", "arguments": {}}]', "Sure ", [("f", {"x": 1}), ("g", {})]),
    (MistralToolParser, f'[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]g[ARGS]{{}}', "",
     [("get_weather", WEATHER), ("g", {})]),
    (MistralToolParser, "no [TOOL_ calls here", "no [TOOL_ calls here", []),
    (RequiredToolParser, f'[{{"name": "get_weather", "parameters": {W}}}, '
     '{"name": "g", "parameters": {}}]', "", [("get_weather", WEATHER), ("g", {})]),
    (RequiredToolParser, "not an array", "not an array", []),
    (lambda: NamedToolParser("get_weather"), f"  {W}\n", "", [("get_weather", WEATHER)]),
    (PythonicToolParser, '[get_weather(city="Paris", days=[1, 2], opts={"unit": "c", '
     '"note": "a \\"}\\" and ]"}), get_time()]', "",
     [("get_weather", WEATHER), ("get_time", {})]),
    (PythonicToolParser, "  [f(x=1, ok=True, none=None, s='q')]",
     "", [("f", {"x": 1, "ok": True, "none": None, "s": "q"})]),
    (PythonicToolParser, "The answer is [4].", "The answer is [4].", []),
    (PythonicToolParser, "[1, 2]", "[1, 2]", []),
    (PythonicToolParser, "[f(1)]", "[f(1)]", []),  # positional arguments: not a call
    (PythonicToolParser, "[f(x=1)", "[f(x=1)", []),  # cut: content, as written
    (Llama4PythonicToolParser, '<|python_start|>[get_weather(city="Paris")]<|python_end|>', "",
     [("get_weather", {"city": "Paris"})]),
    (Llama4PythonicToolParser, "<|python_st", "<|python_st", []),
    (lambda: Qwen3CoderToolParser(QWEN3_CODER_TOOLS),
     "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
     "\n<parameter=days>\n[1, 2]\n</parameter>\n<parameter=opts>\n" + json.dumps(WEATHER["opts"])
     + "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>"
     "\n</tool_call>", "Let me check.\n", [("get_weather", WEATHER), ("get_time", {})]),
    (lambda: Qwen3CoderToolParser(QWEN3_CODER_TOOLS),
     "<tool_call><function=f><parameter=n>\n7\n</parameter><parameter=flag>true</parameter>"
     "<parameter=zip>\n01234\n</parameter><parameter=x>null</parameter></function>",
     "", [("f", {"n": 7, "flag": True, "zip": "01234", "x": None})]),
    (Qwen3CoderToolParser, "<tool_call>\n<function=f>\n<parameter=a>\n1 < 2\n</parameter>\n"
     "</function>\n</tool_call>", "", [("f", {"a": "1 < 2"})]),  # undeclared: text
    (Qwen3CoderToolParser, "a <tool_call> no function </tool_call> b",
     "a <tool_call> no function </tool_call>b", []),
    (Qwen3CoderToolParser, "ends with a partial tag <tool_c", "ends with a partial tag <tool_c", []),
]


def _check(parser: ToolCallParser, content: str, calls: list[tuple[str, Any]]) -> None:
    assert parser.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls


@pytest.mark.parametrize("make,text,content,calls", CASES)
def test_whole_text(make: Any, text: str, content: str, calls: list) -> None:
    parser = make()
    parser.feed(text)
    parser.finish()
    _check(parser, content, calls)


def _stream(make: Any, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Stream ``pieces``; rebuild content and calls from the deltas alone, checking their
    OpenAI shape (name and id first, then argument fragments, indices in order)."""
    stream = ToolCallStream(make())
    content, calls = "", []
    for i, piece in enumerate(pieces + [""]):
        delta = stream.step(piece, final=i == len(pieces))
        content += delta.content
        for tc in delta.tool_calls:
            if tc["index"] == len(calls):
                assert tc["type"] == "function" and tc["id"] and tc["function"]["name"]
                calls.append({"id": tc["id"], "name": tc["function"]["name"],
                              "arguments": tc["function"]["arguments"]})
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                assert tc["function"]["arguments"]
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert [c["id"] for c in calls] == [m["id"] for m in stream.message_tool_calls()]
    return content, calls


@pytest.mark.parametrize("make,text,content,calls", CASES)
def test_streamed_at_every_boundary(make: Any, text: str, content: str, calls: list) -> None:
    whole = make()
    whole.feed(text)
    whole.finish()
    expected_args = [c.arguments for c in whole.calls]
    chunkings = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    chunkings += [[text[i:i + 3] for i in range(0, len(text), 3)]]
    for pieces in chunkings:
        got_content, got_calls = _stream(make, pieces)
        assert got_content == content, pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls, pieces
        assert [c["arguments"] for c in got_calls] == expected_args  # the very same strings


def test_content_streams_before_the_call_and_tags_are_held() -> None:
    """Content streams as it comes; a call reaches the client once complete, whole."""
    stream = ToolCallStream(HermesToolParser())
    assert stream.step("Checking").content == "Checking"
    assert stream.step(" now <tool").content == " now "  # "<tool" may start a tag
    d = stream.step('_call>{"name": "f", "argu')
    assert d.content == "" and d.tool_calls == []  # the call is not complete yet
    d = stream.step('ments": {"x": 1')
    assert d.tool_calls == []
    d = stream.step("}}</tool_call>", final=True)
    assert d.tool_calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert stream.message_tool_calls()[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


@pytest.mark.parametrize("text,content", [
    ('<tool_call>{"name": "f", "arguments": {"x": 1', '<tool_call>{"name": "f", "arguments": {"x": 1'),
    ('<tool_call>{"name": "f", "arguments": {"city": Paris}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"city": Paris}}'),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}'),
])
def test_calls_whose_arguments_are_not_a_json_object_become_content(text, content) -> None:
    """A call cut by max_tokens, or with arguments that are not a JSON object (Hermes'
    ``{"city": Paris}``), never reaches the client as a call: its text is content. Both in
    one piece and streamed."""
    for pieces in ([text], list(text)):
        stream = ToolCallStream(HermesToolParser())
        got_content, got_calls = "", []
        for i, piece in enumerate(pieces):
            d = stream.step(piece, final=i == len(pieces) - 1)
            got_content += d.content
            got_calls += d.tool_calls
        assert got_calls == [] and stream.message_tool_calls() == []
        assert got_content.startswith(content), got_content


def test_empty_arguments_are_an_empty_object() -> None:
    stream = ToolCallStream(HermesToolParser())
    stream.step('<tool_call>{"name": "f", "arguments": ""}</tool_call>', final=True)
    assert stream.message_tool_calls()[0]["function"] == {"name": "f", "arguments": "{}"}


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    stream = ToolCallStream(RequiredToolParser(), max_calls=1)
    d = stream.step('[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {}}]', True)
    assert [tc["function"]["name"] for tc in d.tool_calls] == ["f"]
    assert len(stream.message_tool_calls()) == 1


def test_mistral_ids_are_nine_alphanumerics() -> None:
    stream = ToolCallStream(MistralToolParser())
    stream.step('[TOOL_CALLS][{"name": "f", "arguments": {}}]', final=True)
    (call,) = stream.message_tool_calls()
    assert len(call["id"]) == 9 and call["id"].isalnum()
    hermes = ToolCallStream(HermesToolParser())
    hermes.step('<tool_call>{"name": "f", "arguments": {}}</tool_call>', final=True)
    assert hermes.message_tool_calls()[0]["id"].startswith("chatcmpl-tool-")


def test_registry_names() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "generic", "pythonic",
                                 "llama4_pythonic", "qwen3_coder"}


def test_required_schema_matches_vllms_shape() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "required": ["x"],
        "$defs": {"X": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "g"}}]
    schema = required_schema(tools)
    assert schema["minItems"] == 1 and "X" in schema["$defs"]
    jsonschema.validate([{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}],
                        schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"x": "1"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "$defs" in tools[0]["function"]["parameters"]  # the request's tools are not changed


# -- property: any calls, any content, any chunking ----------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_TRICKY = st.text(alphabet=st.sampled_from(list('ab "\\}]{[,:<>/\n') + ["é", "😀"]),
                  max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | _TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
    max_leaves=8)
_ARGS = st.dictionaries(_TRICKY, _JSON, max_size=4)
_NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)
_CALLS = st.lists(st.tuples(_NAME, _ARGS), min_size=1, max_size=3)


def _render(fmt: str, calls: list[tuple[str, dict]], spaced: bool) -> str:
    sep = ", " if spaced else ","
    dump = (lambda v: json.dumps(v, ensure_ascii=False)) if spaced else \
        (lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":")))
    if fmt == "hermes":
        return "".join(f'<tool_call>\n{{"name": {dump(n)}, "arguments": {dump(a)}}}\n'
                       f"</tool_call>\n" for n, a in calls)
    if fmt == "llama3_json":
        return "<|python_tag|>" + "; ".join(f'{{"name": {dump(n)}, "parameters": {dump(a)}}}'
                                           for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS][" + sep.join(f'{{"name": {dump(n)}, "arguments": {dump(a)}}}'
                                         for n, a in calls) + "]"
    return "[" + sep.join(f'{{"name": {dump(n)}, "parameters": {dump(a)}}}'
                          for n, a in calls) + "]"


_FACTORIES = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
              "mistral": MistralToolParser, "required": RequiredToolParser}


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(sorted(_FACTORIES)), calls=_CALLS, spaced=st.booleans(),
       prefix=_TRICKY, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_calls_any_chunking(fmt: str, calls: list, spaced: bool, prefix: str,
                                cuts: list[int]) -> None:
    text = _render(fmt, calls, spaced)
    # content before the calls, where the format allows it (and without marker text)
    lead = prefix.replace("<", "").replace("[", "") if fmt in ("hermes", "mistral") else ""
    text = lead + text
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    content, got = _stream(_FACTORIES[fmt], pieces)
    assert content == lead
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls


_IDENT = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: not __import__("keyword").iskeyword(s))
_PY_CALLS = st.lists(st.tuples(_IDENT, st.dictionaries(_IDENT, _JSON, max_size=3)),
                     min_size=1, max_size=3)
# a parameter's text: anything but the tags that end it
_PARAM_TEXT = _TRICKY.filter(lambda s: "</parameter" not in s and "<parameter=" not in s
                             and "</function" not in s and not s.strip().lower() == "null")


@settings(max_examples=100, deadline=None)
@given(calls=_PY_CALLS, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_pythonic_any_calls_any_chunking(calls: list, cuts: list[int]) -> None:
    text = "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                           for n, a in calls) + "]"
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    content, got = _stream(PythonicToolParser, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(_IDENT, st.dictionaries(_IDENT, _PARAM_TEXT, max_size=3)),
                      min_size=1, max_size=3),
       lead=_TRICKY, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_qwen3_coder_any_calls_any_chunking(calls: list, lead: str, cuts: list[int]) -> None:
    lead = lead.replace("<", "")
    text = lead + "".join(
        f"<tool_call>\n<function={n}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                                   for k, v in a.items())
        + "</function>\n</tool_call>\n" for n, a in calls)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    content, got = _stream(Qwen3CoderToolParser, [text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert content == lead
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
