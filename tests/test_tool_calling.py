"""Tool calling through the frontend (blink.dpu.tool_calling, the parsers, the templates):
request validation with vLLM's rules and messages, the real chat templates of Qwen2.5, Qwen3,
Llama 3.2 and Mistral Nemo (from their tokenizer_config.json; tests/fixtures/README.md)
rendering tools and tool-call histories, and end to end through the official openai client
(and LangChain when installed) against the app over a scripted fake engine: auto (hermes,
llama3_json, mistral, and the generic format for templates without tools), required, named,
streaming and not, and full round trips (call -> tool result -> answer)."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from blink.dpu.app import app_options, create_app
from blink.dpu.chat_template import ChatTemplateError, render_chat_template
from blink.dpu.tokenizer import Tokenizer
from blink.dpu.tool_calling import AUTO_NEEDS_FLAGS, ToolCallingConfig
from blink.dpu.tool_parsers import generic_schema, required_schema

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from fake_engine_client import FakeEngineClient  # noqa: E402

from dpu_helpers import (  # noqa: E402
    MODEL,
    asgi_request,
    grammar_accepts,
    serve_in_thread,
    tiny_tokenizer,
)

TEMPLATES = json.loads((Path(__file__).parent / "fixtures" / "tool_chat_templates.json")
                       .read_text())
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris"}}\n</tool_call>')
AUTO = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def qwen_tok() -> Tokenizer:
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATES["qwen2.5"]
    return tok


class ScriptedEngine(FakeEngineClient):
    """Answers by what the prompt holds: the final answer once a tool result is in it."""

    def __init__(self, tok: Tokenizer, first: str, after_tool: str = "It is sunny.",
                 after_marker: str = "<tool_response>") -> None:
        ids = {k: tok.encode(v, add_special_tokens=False)
               for k, v in (("first", first), ("after", after_tool))}
        self.prompts: list[str] = []

        def respond(prompt: list[int], params: Any) -> list[int]:
            text = tok.decode(prompt, skip_special_tokens=False)
            self.prompts.append(text)
            return ids["after"] if after_marker in text else ids["first"]

        super().__init__(model_name=MODEL, responder=respond, vocab_size=tok.vocab_size,
                         max_model_len=4096)


def post(app: Any, body: dict[str, Any]) -> httpx.Response:
    return asyncio.run(asgi_request(app, "POST", "/v1/chat/completions", json=body))


def error_of(r: httpx.Response, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


# -- request validation --------------------------------------------------------------------
def test_auto_needs_the_server_flags(qwen_tok: Tokenizer) -> None:
    app = create_app(ScriptedEngine(qwen_tok, "hi"), qwen_tok, model_name=MODEL)
    for extra in ({}, {"tool_choice": "auto"}):  # tools without tool_choice means auto
        r = post(app, {"messages": ASK, "tools": [WEATHER_TOOL], **extra})
        assert error_of(r, "tool_choice") == AUTO_NEEDS_FLAGS
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ToolCallingConfig(enable_auto_tool_choice=True)


@pytest.mark.parametrize("body,param,needle", [
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice", "Invalid value"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "does not match any of the specified `tools`"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function"}}, "tool_choice",
     "Correct usage"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "only 'function'"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name", "non-empty string"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integr"}}}}}]},
     "tools[0].function.parameters", "properties/x/type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters", "type 'object'"),
    ({"functions": [{"name": "f"}]}, "functions", "use 'tools'"),
])
def test_bad_tool_requests_are_400s(qwen_tok: Tokenizer, body: dict, param: str,
                                    needle: str) -> None:
    engine = ScriptedEngine(qwen_tok, "hi")
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    assert needle in error_of(post(app, {"messages": ASK, **body}), param)
    assert engine.submitted == {}


def test_tool_schema_depth_is_bounded_whatever_the_recursion_limit() -> None:
    """The deepest accepted parameter schema does not depend on Python's recursion limit
    (libraries raise it; CI once saw a 190-level schema pass after one did)."""
    from blink.dpu.errors import APIError
    from blink.dpu.tool_calling import MAX_SCHEMA_DEPTH, json_depth, validate_tools

    def tool(levels: int) -> dict:
        schema: dict = {}
        for _ in range(levels - 3):  # params, properties, the innermost {}: 3 levels
            schema = {"type": "array", "items": schema}
        params = {"type": "object", "properties": {"a": schema}}
        return {"type": "function", "function": {"name": "f", "parameters": params}}

    assert json_depth(tool(MAX_SCHEMA_DEPTH)["function"]["parameters"]) == MAX_SCHEMA_DEPTH
    old = sys.getrecursionlimit()
    try:
        for limit in (old, 20_000):
            sys.setrecursionlimit(limit)
            assert validate_tools([tool(MAX_SCHEMA_DEPTH)])
            with pytest.raises(APIError, match="nested too deeply"):
                validate_tools([tool(MAX_SCHEMA_DEPTH + 1)])
            with pytest.raises(APIError, match="nested too deeply"):
                validate_tools([tool(190)])
    finally:
        sys.setrecursionlimit(old)


def test_required_with_no_tools_is_none(qwen_tok: Tokenizer) -> None:
    app = create_app(ScriptedEngine(qwen_tok, "hi"), qwen_tok, model_name=MODEL)
    r = post(app, {"messages": ASK, "tools": [], "tool_choice": "required"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"


def test_forced_choices_with_a_template_that_ignores_tools() -> None:
    tok = tiny_tokenizer()  # plain ChatML: never renders tools
    engine = ScriptedEngine(tok, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    app = create_app(engine, tok, model_name=MODEL, tool_calling=AUTO)
    # forced choices are enforced by the grammar, so they are accepted as they are
    r = post(app, {"messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": "required"})
    assert r.status_code == 200, r.text
    assert list(engine.submitted.values())[-1][1].structured_outputs.json == \
        required_schema([WEATHER_TOOL])


GENERIC_CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'


@pytest.mark.parametrize("parser", ["hermes", "generic"])
def test_auto_with_a_template_without_tools_uses_the_generic_format(parser: str) -> None:
    """A template that never renders tools (SmolLM2's ChatML): the tools go into the system
    prompt, the answer is constrained to the generic JSON and parsed from it, through the
    official openai client: a call (whole and streamed), then the tool result, then the
    answer, whatever --tool-call-parser names."""
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, GENERIC_CALL, after_tool='{"response": "It is \\"sunny\\"."}',
                            after_marker='"tool_response"')
    config = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser=parser)
    app = create_app(engine, tok, model_name=MODEL, tool_calling=config)
    system = [{"role": "system", "content": "You are terse."}]
    with serve_in_thread(app) as url:
        client = _client(url)
        first = client.chat.completions.create(model=MODEL, messages=system + ASK,
                                               tools=[WEATHER_TOOL, TIME_TOOL])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        prompt = engine.prompts[-1]
        assert prompt.startswith("<|im_start|>system\nYou are terse.\n\nRespond in JSON format")
        assert '"name": "get_weather"' in prompt and "Current weather of a city" in prompt
        params = list(engine.submitted.values())[-1][1]
        assert params.structured_outputs.json == generic_schema([WEATHER_TOOL, TIME_TOOL])

        chunks = list(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER_TOOL], stream=True,
            parallel_tool_calls=False))
        deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
        assert deltas[0].function.name == "get_weather" and deltas[0].id
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        schema = list(engine.submitted.values())[-1][1].structured_outputs.json
        assert schema == generic_schema([WEATHER_TOOL], single_call=True)
        assert engine.prompts[-1].startswith("<|im_start|>system\nRespond in JSON format")

        messages: list[Any] = system + ASK
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"sky": "sunny"})})
        final = client.chat.completions.create(model=MODEL, messages=messages,
                                               tools=[WEATHER_TOOL])
        streamed = "".join(c.delta.content or "" for ch in client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER_TOOL], stream=True)
            for c in ch.choices)
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    assert final.choices[0].message.content == 'It is "sunny".' == streamed
    prompt = engine.prompts[-1]
    assert f"<|im_start|>assistant\n{GENERIC_CALL}<|im_end|>" in prompt
    assert '<|im_start|>user\n{"tool_response": {"tool_call_id": "' + call.id in prompt


def test_generic_parser_streams_agree_with_whole() -> None:
    from blink.dpu.tool_parsers import GenericToolParser

    cases = {
        GENERIC_CALL[:-2] + ', {"name": "get_time", "arguments": {}}]}':
            ("", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        ' { "response" : "a\\"b \\u00e9 \\ud83d\\ude00 c\\\\d\\n"} ': ('a"b \u00e9 \U0001F600 c\\d\n', []),
        "plain text": ("plain text", []),
        '{"other": 1}': ('{"other": 1}', []),
    }
    for text, (content, calls) in cases.items():
        for size in (1, 2, 3, 7, len(text)):
            parser = GenericToolParser()
            for i in range(0, len(text), size):
                parser.feed(text[i:i + size])
            parser.finish()
            assert parser.content == content, (text, size)
            assert [(c.name, c.arguments) for c in parser.calls] == calls, (text, size)


def test_cli_flags_reach_the_app() -> None:
    from blink.cli import build_parser
    from blink.cli_args import frontend_limit_args

    args = build_parser().parse_args(["serve", "--model", "null", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "llama3_json"])
    assert app_options(args)["tool_calling"] == ToolCallingConfig(True, "llama3_json")
    passed = frontend_limit_args(args)
    assert "--enable-auto-tool-choice" in passed
    assert passed[passed.index("--tool-call-parser") + 1] == "llama3_json"


# -- chat templates ------------------------------------------------------------------------
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
]


@pytest.mark.parametrize("name,call_text", [
    ("qwen2.5", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                '</tool_call>'),
    ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>'),
    ("llama3.2", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
])
def test_real_templates_render_tools_and_tool_histories(name: str, call_text: str) -> None:
    text = render_chat_template(TEMPLATES[name], HISTORY, tools=[WEATHER_TOOL],
                                special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    assert '"name": "get_weather"' in text and "Current weather of a city" in text  # the tool
    assert call_text in text  # the call, arguments as a JSON object (not a quoted string)
    # the tool result (Llama's template writes a string result through tojson, quoted)
    assert '{"sky": "sunny"}' in text or '"{\\"sky\\": \\"sunny\\"}"' in text
    assert "None" not in text


def test_mistral_template_renders_tools_and_tool_histories() -> None:
    """Mistral Nemo's template: tools in [AVAILABLE_TOOLS] before the last user turn, the call
    in [TOOL_CALLS] with its 9-character id, the result in [TOOL_RESULTS]."""
    history = [dict(m) for m in HISTORY]
    history[1] = dict(history[1], tool_calls=[dict(history[1]["tool_calls"][0], id="a1B2c3D4e")])
    history[2] = dict(history[2], tool_call_id="a1B2c3D4e")
    text = render_chat_template(TEMPLATES["mistral-nemo"], history + [
        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks!"}],
        tools=[WEATHER_TOOL], special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    assert text.startswith("<s>[INST]Weather in Paris?[/INST][TOOL_CALLS][")
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]</s>' in text
    assert '[TOOL_RESULTS]{"content": {"sky": "sunny"}, "call_id": "a1B2c3D4e"}[/TOOL_RESULTS]' \
        in text
    assert text.endswith('"description": "Current weather of a city", "parameters": '
                         + json.dumps(WEATHER_TOOL["function"]["parameters"])
                         + "}}][/AVAILABLE_TOOLS][INST]Thanks![/INST]")
    with pytest.raises(ChatTemplateError, match="length 9"):  # the template's own check
        render_chat_template(TEMPLATES["mistral-nemo"], HISTORY, tools=[WEATHER_TOOL])


def test_bad_arguments_in_history_name_the_field() -> None:
    bad = [dict(HISTORY[1], tool_calls=[{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}])]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].tool_calls\[0\].function"):
        render_chat_template(TEMPLATES["qwen2.5"], bad)


# -- end to end: the openai client ---------------------------------------------------------
def _client(url: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def test_auto_hermes_whole_and_streamed(qwen_tok: Tokenizer) -> None:
    engine = ScriptedEngine(qwen_tok, HERMES_CALL)
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    with serve_in_thread(app) as url:
        client = _client(url)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check.\n"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert "<tools>" in engine.prompts[-1] and "Current weather" in engine.prompts[-1]
        params = list(engine.submitted.values())[-1][1]
        assert params.structured_outputs is None and params.skip_special_tokens is False

        chunks = list(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER_TOOL], stream=True))
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name == "get_weather"
                    calls[tc.index] = tc.function.arguments or ""
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index] += tc.function.arguments
            finish = c.finish_reason or finish
    assert content == "Let me check.\n" and finish == "tool_calls"
    assert {i: json.loads(a) for i, a in calls.items()} == {0: {"city": "Paris"}}
    # the call came whole, once complete (so its arguments always parse)
    assert sum(1 for ch in chunks for c in ch.choices for _ in (c.delta.tool_calls or [])) == 1


def test_round_trip_call_result_answer(qwen_tok: Tokenizer) -> None:
    engine = ScriptedEngine(qwen_tok, HERMES_CALL, after_tool="It is sunny in Paris.")
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    with serve_in_thread(app) as url:
        client = _client(url)
        messages: list[Any] = list(ASK)
        first = client.chat.completions.create(model=MODEL, messages=messages,
                                               tools=[WEATHER_TOOL])
        call = first.choices[0].message.tool_calls[0]
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"sky": "sunny"})})
        final = client.chat.completions.create(model=MODEL, messages=messages,
                                               tools=[WEATHER_TOOL])
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "It is sunny in Paris."
    assert not final.choices[0].message.tool_calls
    prompt = engine.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt


def test_required_and_named_are_constrained_and_parsed_without_a_parser(
        qwen_tok: Tokenizer) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    engine = ScriptedEngine(qwen_tok, '[{"name": "get_weather", "parameters": {"city": '
                                      '"Paris"}}, {"name": "get_time", "parameters": {}}]')
    app = create_app(engine, qwen_tok, model_name=MODEL)  # no tool flags at all
    with serve_in_thread(app) as url:
        client = _client(url)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                           tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert [c.function.name for c in r.choices[0].message.tool_calls] == \
            ["get_weather", "get_time"]
        params = list(engine.submitted.values())[-1][1]
        assert params.structured_outputs.json == required_schema(tools)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                           tool_choice="required", parallel_tool_calls=False)
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]

        engine.responder = lambda p, s: qwen_tok.encode(' {"city": "Paris"}',
                                                        add_special_tokens=False)
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                           tool_choice=named)
        assert r.choices[0].finish_reason == "stop"  # as OpenAI: a forced call ends by "stop"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == \
            '{"city": "Paris"}'
        params = list(engine.submitted.values())[-1][1]
        assert params.structured_outputs.json == WEATHER_TOOL["function"]["parameters"]
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                                     tool_choice=named, stream=True))
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == '{"city": "Paris"}'


def test_tool_choice_none_renders_but_does_not_parse(qwen_tok: Tokenizer) -> None:
    engine = ScriptedEngine(qwen_tok, HERMES_CALL)
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    r = post(app, {"messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": "none"})
    message = r.json()["choices"][0]["message"]
    assert message["content"] == HERMES_CALL and "tool_calls" not in message
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert "<tools>" in engine.prompts[-1]  # vLLM's default: still rendered
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=ToolCallingConfig(
        exclude_tools_when_tool_choice_none=True))
    post(app, {"messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": "none"})
    assert "<tools>" not in engine.prompts[-1]


def test_mistral_round_trip_with_its_template() -> None:
    """--tool-call-parser mistral over Mistral Nemo's real template, with the openai client:
    the call's id is 9 alphanumerics, so the template accepts it when it is sent back."""
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATES["mistral-nemo"]
    engine = ScriptedEngine(tok, '[TOOL_CALLS][{"name": "get_weather", "arguments": '
                                 '{"city": "Paris"}}]', after_tool="It is sunny.",
                            after_marker="[TOOL_RESULTS]")
    app = create_app(engine, tok, model_name=MODEL, tool_calling=ToolCallingConfig(
        enable_auto_tool_choice=True, tool_call_parser="mistral"))
    with serve_in_thread(app) as url:
        client = _client(url)
        messages: list[Any] = list(ASK)
        first = client.chat.completions.create(model=MODEL, messages=messages,
                                               tools=[WEATHER_TOOL])
        assert first.choices[0].finish_reason == "tool_calls"
        (call,) = first.choices[0].message.tool_calls
        assert len(call.id) == 9 and call.id.isalnum() and call.function.name == "get_weather"
        assert "[AVAILABLE_TOOLS]" in engine.prompts[-1]
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"sky": "sunny"})})
        final = client.chat.completions.create(model=MODEL, messages=messages,
                                               tools=[WEATHER_TOOL])
    assert final.choices[0].message.content == "It is sunny."
    assert f'"call_id": "{call.id}"}}[/TOOL_RESULTS]' in engine.prompts[-1]


def test_llama3_json_parser() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATES["llama3.2"]
    engine = ScriptedEngine(tok, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    app = create_app(engine, tok, model_name=MODEL, tool_calling=ToolCallingConfig(
        enable_auto_tool_choice=True, tool_call_parser="llama3_json"))
    body = post(app, {"messages": ASK, "tools": [WEATHER_TOOL], "n": 2}).json()
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"] == {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_langchain_bind_tools(qwen_tok: Tokenizer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    engine = ScriptedEngine(qwen_tok, HERMES_CALL, after_tool="Sunny.")
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)

    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return "sunny"

    with serve_in_thread(app) as url:
        llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="x",
                                          max_retries=0)
        msg = llm.bind_tools([get_weather]).invoke("Weather in Paris?")
        assert msg.tool_calls[0]["name"] == "get_weather"
        assert msg.tool_calls[0]["args"] == {"city": "Paris"}
        streamed = None
        for part in llm.bind_tools([get_weather]).stream("Weather in Paris?"):
            streamed = part if streamed is None else streamed + part
        assert streamed.tool_calls[0]["args"] == {"city": "Paris"}
        # with_structured_output(method="function_calling") forces the tool: a named choice
        engine.responder = lambda p, s: qwen_tok.encode('{"city": "Paris"}',
                                                        add_special_tokens=False)
        out = llm.with_structured_output(get_weather, method="function_calling").invoke("x")
        assert out == {"city": "Paris"}
        # the default method sends response_format json_schema (structured outputs)
        out = llm.with_structured_output(get_weather).invoke("x")
        assert out == {"city": "Paris"}
        params = list(engine.submitted.values())[-1][1]
        assert params.structured_outputs is not None and params.structured_outputs.json


def test_openai_parse_with_pydantic_function_tool(qwen_tok: Tokenizer) -> None:
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class GetWeather(pydantic.BaseModel):
        """Current weather of a city."""

        city: str

    engine = ScriptedEngine(qwen_tok, '<tool_call>\n{"name": "GetWeather", "arguments": '
                                      '{"city": "Paris"}}\n</tool_call>')
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    with serve_in_thread(app) as url:
        client = _client(url)
        tool = openai.pydantic_function_tool(GetWeather)  # a strict function tool
        r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool])
        (call,) = r.choices[0].message.tool_calls
        assert call.function.parsed_arguments == GetWeather(city="Paris")
        # the same tool forced by name: the grammar gets the tool's schema (the fake engine
        # does not enforce it, so it is scripted to answer with the arguments)
        engine.responder = lambda p, s: qwen_tok.encode('{"city": "Paris"}',
                                                        add_special_tokens=False)
        r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool],
                                          tool_choice={"type": "function",
                                                       "function": {"name": "GetWeather"}})
        assert r.choices[0].message.tool_calls[0].function.parsed_arguments == \
            GetWeather(city="Paris")
    params = list(engine.submitted.values())[-1][1]
    assert params.structured_outputs.json == tool["function"]["parameters"]


def test_tokenize_renders_validated_tools(qwen_tok: Tokenizer) -> None:
    app = create_app(ScriptedEngine(qwen_tok, "hi"), qwen_tok, model_name=MODEL)
    r = asyncio.run(asgi_request(app, "POST", "/tokenize", json={
        "messages": ASK, "tools": [WEATHER_TOOL], "return_token_strs": True}))
    assert r.status_code == 200 and "get_weather" in qwen_tok.decode(r.json()["tokens"])
    r = asyncio.run(asgi_request(app, "POST", "/tokenize", json={
        "messages": ASK, "tools": [{"type": "function", "function": {"name": ""}}]}))
    assert error_of(r, "tools[0].function.name")


def test_null_content_for_templates_that_read_content_parts() -> None:
    # a template that iterates over content parts (vLLM's "openai" content format) gets
    # no parts for a null content, and the tool calls with parsed arguments
    template = ("{% for m in messages %}[{{ m.role }}]{% for p in m.content %}{{ p.text }}"
                "{% endfor %}{% for c in m.tool_calls or [] %}"
                "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
                "{% endfor %}")
    user = {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}
    text = render_chat_template(template, [user, HISTORY[1]], add_generation_prompt=False)
    assert text == '[user]Weather in Paris?[assistant]get_weather{"city": "Paris"}'


# ------------------------------------------------------- tools and response_format together

ANSWER_SCHEMA = {"type": "object", "properties": {"temp_c": {"type": "integer"}},
                 "required": ["temp_c"]}
RF = {"type": "json_schema", "json_schema": {"name": "w", "schema": ANSWER_SCHEMA}}


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_tools_and_response_format_together(qwen_tok: Tokenizer, choice: str) -> None:
    """OpenAI's meaning (openai-agents, pydantic-ai, LangChain create_agent and AutoGen send
    both): while the model calls tools, the call grammar; its final answer, the response
    schema. ``auto``: either; ``required``: calls only; ``none``: the answer only."""
    engine = ScriptedEngine(qwen_tok, HERMES_CALL.split("\n", 1)[1])
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    r = post(app, {"model": MODEL, "messages": ASK, "tools": [WEATHER_TOOL],
                   "tool_choice": choice, "response_format": RF, "max_tokens": 64})
    assert r.status_code == 200, r.text
    (rid,) = engine.grammars
    grammar = engine.grammars[rid]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    answer = '{"temp_c": 21}'
    can_call = grammar_accepts(grammar, qwen_tok, call) if choice != "required" else None
    if choice == "auto":
        assert can_call and grammar_accepts(grammar, qwen_tok, answer)
        assert not grammar_accepts(grammar, qwen_tok, "It is sunny.")
        assert not grammar_accepts(grammar, qwen_tok, '{"temp_c": "warm"}')
        assert not grammar_accepts(grammar, qwen_tok, call.replace('"city"', '"town"'))
    elif choice == "required":
        assert grammar_accepts(grammar, qwen_tok, '[{"name": "get_weather", "parameters": {"city": "P"}}]')
        assert not grammar_accepts(grammar, qwen_tok, answer)
    else:
        assert grammar_accepts(grammar, qwen_tok, answer) and not can_call


def test_tools_with_response_format_in_the_generic_format(qwen_tok: Tokenizer) -> None:
    """A template without tools (the generic format): the answer's ``response`` is the
    response schema's value, and its JSON text is the message content."""
    engine = ScriptedEngine(qwen_tok, '{"response": {"temp_c": 21}}')
    generic = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="generic")
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=generic)
    r = post(app, {"model": MODEL, "messages": ASK, "tools": [WEATHER_TOOL],
                   "response_format": RF, "max_tokens": 64})
    assert r.status_code == 200, r.text
    (grammar,) = engine.grammars.values()
    assert grammar_accepts(grammar, qwen_tok, '{"response": {"temp_c": 21}}')
    assert not grammar_accepts(grammar, qwen_tok, '{"response": "sunny"}')
    message = r.json()["choices"][0]["message"]
    assert json.loads(message["content"]) == {"temp_c": 21} and not message.get("tool_calls")


def test_empty_and_null_arguments_in_history_mean_no_arguments(qwen_tok: Tokenizer) -> None:
    engine = ScriptedEngine(qwen_tok, HERMES_CALL)
    for parser in ("hermes", "generic"):
        cfg = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser=parser)
        app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=cfg)
        for args in ("", None):
            history = ASK + [
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_time", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
            r = post(app, {"model": MODEL, "messages": history, "tools": [TIME_TOOL],
                           "max_tokens": 16})
            assert r.status_code == 200, (parser, args, r.text)


# ------------------------------------------------------------- the Responses API's tools

R_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather",
          "parameters": WEATHER_TOOL["function"]["parameters"]}


def _responses(app: Any, body: dict[str, Any]) -> httpx.Response:
    return asyncio.run(asgi_request(app, "POST", "/v1/responses", json=body))


def test_responses_tools_make_function_call_items(qwen_tok: Tokenizer) -> None:
    engine = ScriptedEngine(qwen_tok, HERMES_CALL)
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    r = _responses(app, {"model": MODEL, "input": "Weather in Paris?", "tools": [R_TOOL]})
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [o["type"] for o in out] == ["message", "function_call"]
    assert out[0]["content"][0]["text"] == "Let me check.\n"
    call = out[1]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"] and call["status"] == "completed"
    # the next turn sends the call and its output back as items: the template sees a tool turn
    r = _responses(app, {"model": MODEL, "tools": [R_TOOL], "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call["call_id"], "name": "get_weather",
         "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}]})
    assert r.status_code == 200, r.text
    assert "<tool_response>\n21 C" in engine.prompts[-1] and '"city": "Paris"' in engine.prompts[-1]
    assert r.json()["output"][0]["content"][0]["text"] == "It is sunny."


def test_responses_streams_function_calls(qwen_tok: Tokenizer) -> None:
    engine = ScriptedEngine(qwen_tok, HERMES_CALL)
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    r = _responses(app, {"model": MODEL, "input": "Weather?", "tools": [R_TOOL], "stream": True})
    events = [json.loads(b.split("data: ", 1)[1]) for b in r.text.strip().split("\n\n")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    i = kinds.index("response.function_call_arguments.done")
    assert json.loads(events[i]["arguments"]) == {"city": "Paris"}
    assert kinds[i - 2:i + 2] == ["response.output_item.added",
                                  "response.function_call_arguments.delta",
                                  "response.function_call_arguments.done",
                                  "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["message", "function_call"]


def test_responses_text_format_and_tools_together(qwen_tok: Tokenizer) -> None:
    engine = ScriptedEngine(qwen_tok, '{"temp_c": 21}')
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    fmt = {"type": "json_schema", "name": "w", "schema": ANSWER_SCHEMA, "strict": True}
    r = _responses(app, {"model": MODEL, "input": "Weather?", "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    (grammar,) = engine.grammars.values()
    assert grammar_accepts(grammar, qwen_tok, '{"temp_c": 3}')
    assert not grammar_accepts(grammar, qwen_tok, "warm")
    assert r.json()["text"]["format"]["type"] == "json_schema"
    engine.grammars.clear()
    r = _responses(app, {"model": MODEL, "input": "Weather?", "tools": [R_TOOL],
                         "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    (grammar,) = engine.grammars.values()
    assert grammar_accepts(grammar, qwen_tok, '{"temp_c": 3}')
    assert grammar_accepts(grammar, qwen_tok, '<tool_call>\n{"name": "get_weather", "arguments": '
                                       '{"city": "P"}}\n</tool_call>')
    assert r.json()["output"][0]["content"][0]["text"] == '{"temp_c": 21}'


def test_openai_sdk_responses_with_tools_and_parse(qwen_tok: Tokenizer) -> None:
    """The openai SDK's Responses client: function calls come back as typed items, and
    ``responses.parse(text_format=Model)`` gets a parsed pydantic object."""
    openai = pytest.importorskip("openai")
    import pydantic

    class Weather(pydantic.BaseModel):
        temp_c: int

    engine = ScriptedEngine(qwen_tok, HERMES_CALL, after_tool='{"temp_c": 21}')
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=AUTO)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        r = client.responses.create(model=MODEL, input="Weather?", tools=[R_TOOL])
        (call,) = [o for o in r.output if o.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        parsed = client.responses.parse(model=MODEL, tools=[R_TOOL], text_format=Weather, input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "21"}])
        assert parsed.output_parsed == Weather(temp_c=21)


QWEN3_CODER_CALL = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("parser,output", [
    ("pythonic", '[get_weather(city="Paris")]'),
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>'),
    ("qwen3_coder", QWEN3_CODER_CALL),
])
def test_pythonic_and_qwen3_coder_parsers_with_the_openai_client(
        qwen_tok: Tokenizer, parser: str, output: str) -> None:
    """The issue-33 parsers end to end: auto calls whole and streamed, and forced choices
    (required, named) still constrained and read as JSON whatever the parser."""
    engine = ScriptedEngine(qwen_tok, output)
    app = create_app(engine, qwen_tok, model_name=MODEL, tool_calling=ToolCallingConfig(
        enable_auto_tool_choice=True, tool_call_parser=parser))
    content = "Let me check.\n" if parser == "qwen3_coder" else None
    with serve_in_thread(app) as url:
        client = _client(url)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER_TOOL], stream=True))
        streamed = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
        calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
        assert streamed == (content or "") and len(calls) == 1
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}

        engine.responder = lambda p, s: qwen_tok.encode(
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', add_special_tokens=False)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL],
                                           tool_choice="required")
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        engine.responder = lambda p, s: qwen_tok.encode('{"city": "Paris"}',
                                                        add_special_tokens=False)
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == \
            {"city": "Paris"}
