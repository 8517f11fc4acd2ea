"""Reasoning models (``--reasoning-parser``, blink.dpu.reasoning): the ``<think>`` text as
``reasoning_content`` / ``reasoning`` in chat answers (whole and streamed: reasoning deltas,
then content deltas, never both in one chunk), ``reasoning`` items in /v1/responses, never in
``content``; tool calls parsed from the content only; structured outputs and forced tool
choices constrained from ``</think>`` on (other constraints refused by name);
``enable_thinking: false`` and ``reasoning_effort`` reach the template. Through the official openai client against a scripted fake engine, with tiny chat
templates that write the thinking block as Qwen3's and DeepSeek-R1's do."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from fake_engine_client import FakeEngineClient  # noqa: E402

from dpu_helpers import (  # noqa: E402
    MODEL,
    asgi_request,
    grammar_accepts,
    serve_in_thread,
    tiny_tokenizer,
)

from blink.dpu.app import app_options, create_app  # noqa: E402
from blink.dpu.reasoning import REASONING_PARSERS, ReasoningParser  # noqa: E402
from blink.dpu.tokenizer import Tokenizer  # noqa: E402
from blink.dpu.tool_calling import ToolCallingConfig  # noqa: E402

_TURNS = ("{% if tools %}{{'<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n'}}"
          "{% endif %}{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + (m['content'] or '') "
          "+ '<|im_end|>\n'}}{% endfor %}")
#: Qwen3's way: the model opens <think> itself; enable_thinking=false renders an empty block
QWEN3_TEMPLATE = _TURNS + (
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{'<think>\n\n</think>\n\n'}}{% endif %}{% endif %}")
#: DeepSeek-R1's way: the template opens <think>, the model writes only </think>; it also
#: shows reasoning_effort when given (as gpt-oss-style templates read it)
DEEPSEEK_TEMPLATE = _TURNS + (
    "{% if reasoning_effort is defined %}{{'effort=' + reasoning_effort + '\n'}}{% endif %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n<think>\n'}}{% endif %}")
ASK = [{"role": "user", "content": "What is 2+2?"}]
QWEN_OUT = "<think>\nTwo plus two.\n</think>\n\nThe answer is 4."
DEEPSEEK_OUT = "Two plus two.\n</think>\n\nThe answer is 4."
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}


class Scripted(FakeEngineClient):
    def __init__(self, tok: Tokenizer, output: str) -> None:
        self.prompts: list[str] = []
        self.tok = tok
        self.output = output

        def respond(prompt: list[int], params: Any) -> list[int]:
            self.prompts.append(tok.decode(prompt, skip_special_tokens=False))
            return tok.encode(self.output, add_special_tokens=False)

        super().__init__(model_name=MODEL, responder=respond, vocab_size=tok.vocab_size,
                         max_model_len=4096)


def _app(template: str, output: str, parser: str, **kw: Any) -> tuple[Any, Scripted]:
    tok = tiny_tokenizer()
    tok.chat_template = template
    engine = Scripted(tok, output)
    return create_app(engine, tok, model_name=MODEL, reasoning_parser=parser, **kw), engine


def _client(url: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _stream_parts(chunks: list[Any]) -> tuple[str, str, list[Any]]:
    reasoning, content, deltas = "", "", []
    for chunk in chunks:
        for c in chunk.choices:
            d = c.delta.model_dump()
            r = d.get("reasoning_content")
            assert r == d.get("reasoning")  # both of vLLM's names, the same text
            assert not (r and d.get("content")), d  # never both in one chunk
            reasoning += r or ""
            content += d.get("content") or ""
            deltas.append(("r" if r else "c") if (r or d.get("content")) else None)
    return reasoning, content, [x for x in deltas if x]


@pytest.mark.parametrize("parser,template,output", [
    ("qwen3", QWEN3_TEMPLATE, QWEN_OUT),
    ("deepseek_r1", DEEPSEEK_TEMPLATE, DEEPSEEK_OUT),
])
def test_reasoning_whole_and_streamed_with_the_openai_client(parser: str, template: str,
                                                             output: str) -> None:
    app, _ = _app(template, output, parser)
    with serve_in_thread(app) as url:
        client = _client(url)
        r = client.chat.completions.create(model=MODEL, messages=ASK)
        message = r.choices[0].message
        assert message.content == "The answer is 4."
        assert message.reasoning_content == message.reasoning == "\nTwo plus two.\n" \
            if parser == "qwen3" else message.reasoning_content == "Two plus two.\n"
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True))
    reasoning, content, order = _stream_parts(chunks)
    assert reasoning == message.reasoning_content and content == "The answer is 4."
    assert order == sorted(order, key=lambda x: x != "r")  # reasoning deltas, then content
    assert "r" in order and "c" in order


def test_qwen3_enable_thinking_false_is_all_content() -> None:
    app, engine = _app(QWEN3_TEMPLATE, "The answer is 4.", "qwen3")
    body = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions", json={
        "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}})).json()
    assert engine.prompts[-1].endswith("<think>\n\n</think>\n\n")  # the template saw it
    message = body["choices"][0]["message"]
    assert message["content"] == "The answer is 4." and "reasoning_content" not in message
    # and a grammar holds from the first token then: the model does not think
    r = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions", json={
        "messages": ASK, "chat_template_kwargs": {"enable_thinking": False},
        "guided_regex": "a+"}))
    assert r.status_code == 200
    assert list(engine.grammars.values())[-1] is not None


def test_qwen3_without_think_tags_is_content_and_deepseek_without_end_is_reasoning() -> None:
    app, _ = _app(QWEN3_TEMPLATE, "Just the answer.", "qwen3")
    body = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions",
                                    json={"messages": ASK})).json()
    assert body["choices"][0]["message"]["content"] == "Just the answer."
    app, _ = _app(DEEPSEEK_TEMPLATE, "Still thinking when cut", "deepseek_r1")
    body = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions",
                                    json={"messages": ASK})).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Still thinking when cut" and message["content"] == ""


def test_include_reasoning_false_leaves_it_out() -> None:
    app, _ = _app(QWEN3_TEMPLATE, QWEN_OUT, "qwen3")
    body = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions", json={
        "messages": ASK, "include_reasoning": False})).json()
    message = body["choices"][0]["message"]
    assert message["content"] == "The answer is 4." and "reasoning" not in message


def test_tool_calls_are_parsed_after_the_reasoning_only() -> None:
    output = ('<think>I could write <tool_call>{"name": "nope", "arguments": {}}</tool_call> '
              'here, but I think first.</think>\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Paris"}}\n</tool_call>')
    app, _ = _app(QWEN3_TEMPLATE, output, "qwen3", tool_calling=ToolCallingConfig(
        enable_auto_tool_choice=True, tool_call_parser="hermes"))
    with serve_in_thread(app) as url:
        client = _client(url)
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL])
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and not message.content
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
        assert "nope" in message.reasoning_content
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK,
                                                     tools=[WEATHER_TOOL], stream=True))
    calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    reasoning, content, _ = _stream_parts(chunks)
    assert reasoning == message.reasoning_content and content == ""


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"guided_grammar": 'start: "a"'}, "guided_grammar"),
])
def test_grammars_that_cannot_follow_the_reasoning_are_refused_by_name(extra: dict,
                                                                       param: str) -> None:
    app, _ = _app(QWEN3_TEMPLATE, QWEN_OUT, "qwen3")
    r = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions",
                                 json={"messages": ASK, **extra}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "--reasoning-parser" in error["message"]


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"]}


@pytest.mark.parametrize("parser,template,think", [
    ("qwen3", QWEN3_TEMPLATE, "<think>\nTwo plus two {maybe}.\n</think>\n\n"),
    ("deepseek_r1", DEEPSEEK_TEMPLATE, "Two plus two.\n</think>\n\n"),
])
def test_structured_outputs_start_after_the_reasoning(parser: str, template: str,
                                                      think: str) -> None:
    answer = '{"answer": 4}'
    app, engine = _app(template, think + answer, parser)
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    with serve_in_thread(app) as url:
        client = _client(url)
        r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=rf)
    message = r.choices[0].message
    assert message.content == answer and "Two plus two" in message.reasoning_content
    grammar = list(engine.grammars.values())[-1]
    tok = engine.tok
    assert grammar_accepts(grammar, tok, think + answer)
    assert grammar_accepts(grammar, tok, think.replace("\n\n", "") + answer)  # no space: fine too
    assert not grammar_accepts(grammar, tok, think + '{"answer": "four"}')  # the schema holds
    assert not grammar_accepts(grammar, tok, answer)  # the reasoning comes first
    assert not grammar_accepts(grammar, tok, think + "The answer is 4.")
    if parser == "qwen3":  # Qwen3 opens the block itself
        assert not grammar_accepts(grammar, tok, "Two plus two.</think>" + answer)


def test_schema_needing_a_final_check_is_refused_with_reasoning() -> None:
    app, _ = _app(QWEN3_TEMPLATE, QWEN_OUT, "qwen3")
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "array", "uniqueItems": True}}}
    r = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions",
                                 json={"messages": ASK, "response_format": rf}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_forced_tool_choice_after_the_reasoning() -> None:
    output = '<think>Weather, so call it.</think>\n[{"name": "get_weather", "parameters": ' \
             '{"city": "Paris"}}]'
    app, engine = _app(QWEN3_TEMPLATE, output, "qwen3")
    body = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": "required"})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", body
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice["message"]["reasoning_content"] == "Weather, so call it."
    grammar = list(engine.grammars.values())[-1]
    assert grammar_accepts(grammar, engine.tok, output)
    assert not grammar_accepts(grammar, engine.tok, output.split("\n", 1)[1])


def test_reasoning_effort_reaches_the_template() -> None:
    app, engine = _app(DEEPSEEK_TEMPLATE, DEEPSEEK_OUT, "deepseek_r1")
    r = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions", json={
        "messages": ASK, "reasoning_effort": "high"}))
    assert r.status_code == 200 and "effort=high\n" in engine.prompts[-1]
    r = asyncio.run(asgi_request(app, "POST", "/v1/chat/completions", json={
        "messages": ASK, "reasoning_effort": "extreme"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    r = asyncio.run(asgi_request(app, "POST", "/v1/responses", json={
        "input": "What is 2+2?", "reasoning": {"effort": "low"}}))
    assert r.status_code == 200 and "effort=low\n" in engine.prompts[-1]


def test_responses_reasoning_items_whole_and_streamed() -> None:
    app, _ = _app(QWEN3_TEMPLATE, QWEN_OUT, "qwen3")
    with serve_in_thread(app) as url:
        client = _client(url)
        r = client.responses.create(model=MODEL, input="What is 2+2?")
        kinds = [item.type for item in r.output]
        assert kinds == ["reasoning", "message"]
        assert r.output[0].content[0].text == "\nTwo plus two.\n"
        assert r.output_text == "The answer is 4."
        details = r.usage.output_tokens_details
        assert 0 < details.reasoning_tokens < r.usage.output_tokens
        events = list(client.responses.create(model=MODEL, input="What is 2+2?", stream=True))
    types = [e.type for e in events]
    first_text = types.index("response.output_text.delta")
    assert types.index("response.reasoning_text.delta") < first_text
    assert types.index("response.reasoning_text.done") < first_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == "\nTwo plus two.\n" and text == "The answer is 4."
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message"]


@pytest.mark.parametrize("name,prompt_open,text,reasoning,content", [
    ("qwen3", False, QWEN_OUT, "\nTwo plus two.\n", "The answer is 4."),
    ("qwen3", True, "Two plus two.</think>4", "Two plus two.", "4"),
    ("qwen3", False, "No tags at all </think> here", "", "No tags at all </think> here"),
    ("deepseek_r1", False, "<think>a</think>b", "a", "b"),
    ("deepseek_r1", False, DEEPSEEK_OUT, "Two plus two.\n", "The answer is 4."),
    ("deepseek_r1", False, "cut </thi", "cut </thi", ""),
])
def test_parser_streams_agree_with_whole_at_every_boundary(
        name: str, prompt_open: bool, text: str, reasoning: str, content: str) -> None:
    cls = REASONING_PARSERS[name]
    chunkings = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in chunkings:
        parser: ReasoningParser = cls(prompt_opens_thinking=prompt_open)
        got_r, got_c = "", ""
        for i, piece in enumerate(pieces + [""]):
            r, c = parser.feed(piece, final=i == len(pieces))
            got_r, got_c = got_r + r, got_c + c
        assert (got_r, got_c) == (reasoning, content), pieces


def test_cli_flag_reaches_the_app_and_the_frontend_process() -> None:
    from blink.cli import parse_args
    from blink.cli_args import check_vllm_flags, frontend_limit_args

    args = parse_args(["serve", "--reasoning-parser", "qwen3"])
    check_vllm_flags(args)  # honoured: no refusal
    assert app_options(args)["reasoning_parser"] == "qwen3"
    flags = frontend_limit_args(args)
    assert flags[flags.index("--reasoning-parser") + 1] == "qwen3"
    json.dumps(sorted(REASONING_PARSERS))  # the names are plain strings
