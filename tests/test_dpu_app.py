"""The frontend app (blink.dpu.app) over a FakeEngineClient: endpoints, SSE format, n>1,
errors, auth, health, metrics, disconnects; and the official openai client over uvicorn."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import uvicorn

from blink.dpu.app import create_app
from blink.dpu.protocol import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse
from blink.dpu.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from fake_engine_client import FakeEngineClient  # noqa: E402

from dpu_helpers import asgi_request, ANSWER, MESSAGES, MODEL, make_engine, tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


request = asgi_request


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body strictly: 'data: ...' events separated by blank lines."""
    assert body.endswith("\n\n")
    events = []
    for block in body.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["object"] == "error"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param != "any":
        assert body["error"]["param"] == param
    return body["error"]


# -- basic endpoints -----------------------------------------------------------------------
def test_models_and_health(tok: Tokenizer) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "GET", "/v1/models"))
    assert r.status_code == 200
    card = r.json()["data"][0]
    assert r.json()["object"] == "list" and card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == 256
    assert run(request(app, "GET", "/health")).status_code == 200
    engine.die()
    err = assert_error(run(request(app, "GET", "/health")), 503)
    assert err["code"] == "engine_unavailable"
    r = run(request(app, "POST", "/v1/chat/completions", json={"messages": MESSAGES}))
    assert_error(r, 503)
    assert engine.submitted == {}  # nothing was sent to a dead engine
    engine.revive()
    assert run(request(app, "GET", "/health")).status_code == 200


def test_chat_completion(tok: Tokenizer) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"model": MODEL, "messages": MESSAGES, "temperature": 0.5}))
    assert r.status_code == 200, r.text
    body = ChatCompletionResponse.model_validate(r.json())
    assert body.model == MODEL and body.id.startswith("chatcmpl-")
    assert body.choices[0].message.content == ANSWER
    assert body.choices[0].finish_reason == "stop"
    prompt_ids = tok.encode_chat(MESSAGES)
    (rid, (sent_ids, params)), = engine.submitted.items()
    assert sent_ids == prompt_ids and rid.startswith(body.id)
    assert params.n == 1 and params.temperature == 0.5
    assert params.max_tokens == 256 - len(prompt_ids)  # default: the rest of the context
    assert tok.eos_token_id in params.stop_token_ids
    n_answer = len(tok.encode(ANSWER, add_special_tokens=False))
    assert body.usage.prompt_tokens == len(prompt_ids)
    assert body.usage.completion_tokens == n_answer
    assert body.usage.total_tokens == len(prompt_ids) + n_answer


def test_chat_list_content_and_length_finish(tok: Tokenizer) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"},
                                          {"type": "text", "text": "hello"}]}]
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": parts, "max_completion_tokens": 3}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 3
    sent_ids, _ = next(iter(engine.submitted.values()))
    assert sent_ids == tok.encode_chat([{"role": "user", "content": "Say\nhello"}])


def test_chat_streaming_format(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "stream": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert all("usage" not in e for e in events[:-1])  # not asked for
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chunks)


def test_stream_with_characters_split_over_byte_tokens(tok: Tokenizer) -> None:
    """Every UTF-8 byte of the answer as its own token: no U+FFFD ever reaches the client."""
    from blink.shared.byte_level import unicode_to_bytes

    char_of = {b: c for c, b in unicode_to_bytes().items()}
    text = "日本語 😀👍🏽 Grüße"
    ids = [tok._tok.token_to_id(char_of[b]) for b in text.encode()]
    engine = FakeEngineClient(model_name=MODEL, responder=lambda p, s: ids)
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/completions",
                    json={"prompt": "Say", "stream": True, "max_tokens": 100}))
    pieces = [e["choices"][0]["text"] for e in sse_events(r.text)[:-1]]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len(text)  # really split


def test_stream_include_usage(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "stream": True, "max_tokens": 4,
                          "stream_options": {"include_usage": True}}))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    prompt_len = len(tok.encode_chat(MESSAGES))
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4,
                                    "total_tokens": prompt_len + 4,
                                    "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(e["usage"] is None for e in events[:-2])


def test_n2_chat_streaming_and_not(tok: Tokenizer) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "n": 2, "seed": 7, "max_tokens": 5}))
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert {p.seed for _, p in engine.submitted.values()} == {7, 8}  # seed offset per choice
    assert all(p.n == 1 for _, p in engine.submitted.values())
    prompt_len = len(tok.encode_chat(MESSAGES))
    assert body["usage"]["prompt_tokens"] == prompt_len  # counted once
    assert body["usage"]["completion_tokens"] == 10  # summed over choices

    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "n": 2, "stream": True,
                          "stream_options": {"include_usage": True}}))
    events = sse_events(r.text)
    texts = {0: "", 1: ""}
    finishes = {}
    for e in events[:-2]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: ANSWER, 1: ANSWER} and finishes == {0: "stop", 1: "stop"}
    n_answer = len(tok.encode(ANSWER, add_special_tokens=False))
    assert events[-2]["usage"]["completion_tokens"] == 2 * n_answer


def test_chat_logprobs(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 2,
                          "max_tokens": 3}))
    content = r.json()["choices"][0]["logprobs"]["content"]
    ids = tok.encode(ANSWER, add_special_tokens=False)[:3]
    assert [c["token"] for c in content] == [tok.token_text(t) for t in ids]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    assert bytes(sum((c["bytes"] for c in content), [])) == b"".join(tok.token_bytes(t) for t in ids)


# -- completions -----------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_kind", ["str", "ids", "strs", "id_lists"])
def test_completions_prompt_forms(tok: Tokenizer, prompt_kind: str) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    texts = ["Say hello", "to the world"]
    prompt: Any = {"str": texts[0], "ids": tok.encode(texts[0]),
                   "strs": texts, "id_lists": [tok.encode(t) for t in texts]}[prompt_kind]
    n_prompts = 2 if prompt_kind in ("strs", "id_lists") else 1
    r = run(request(app, "POST", "/v1/completions",
                    json={"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 4}))
    assert r.status_code == 200, r.text
    body = CompletionResponse.model_validate(r.json())
    assert [c.index for c in body.choices] == list(range(2 * n_prompts))
    expected = tok.decode(tok.encode(ANSWER, add_special_tokens=False)[:4])
    assert all(c.text == expected and c.finish_reason == "length" for c in body.choices)
    assert sorted(ids for ids, _ in engine.submitted.values()) == \
        sorted([tok.encode(t) for t in texts[:n_prompts]] * 2)
    assert body.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts[:n_prompts])
    assert body.usage.completion_tokens == 4 * 2 * n_prompts


def test_completions_default_max_tokens_logprobs_and_stream(tok: Tokenizer) -> None:
    long_answer = ANSWER * 3
    engine = make_engine(tok, answer=long_answer)
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/completions", json={"prompt": "Say", "logprobs": 1}))
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 16
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == choice["text"]
    assert all(len(t) == 1 for t in lp["top_logprobs"])

    r = run(request(app, "POST", "/v1/completions",
                    json={"prompt": "Say", "stream": True, "max_tokens": 6,
                          "stream_options": {"include_usage": True}}))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 6
    assert all(e["object"] == "text_completion" for e in events[:-1])
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == tok.decode(tok.encode(long_answer, add_special_tokens=False)[:6])


# -- stop strings, eos -------------------------------------------------------------------------
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_not_leaked_and_aborts_engine(tok: Tokenizer, include: bool,
                                                     stream: bool) -> None:
    engine = make_engine(tok, tokens_per_delta=1)
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "stop": ["is a", "zzz"], "stream": stream,
                          "include_stop_str_in_output": include}))
    if stream:
        events = sse_events(r.text)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        finish = events[-2]["choices"][0]["finish_reason"]
    else:
        text = r.json()["choices"][0]["message"]["content"]
        finish = r.json()["choices"][0]["finish_reason"]
    cut = ANSWER.index("is a")
    assert text == (ANSWER[: cut + 4] if include else ANSWER[:cut])
    assert finish == "stop"
    (rid,) = engine.submitted
    assert engine.aborted == [rid]  # the engine did not run on after the stop string


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_ends_text_and_ignore_eos(tok: Tokenizer, ignore_eos: bool) -> None:
    eos = tok.eos_token_id
    ids = tok.encode("Hi there", add_special_tokens=False)
    engine = FakeEngineClient(model_name=MODEL, max_model_len=256,
                              responder=lambda p, s: ids + [eos] + ids)
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "ignore_eos": ignore_eos,
                          "skip_special_tokens": False}))
    choice = r.json()["choices"][0]
    _, params = next(iter(engine.submitted.values()))
    if ignore_eos:
        assert eos not in params.stop_token_ids
        assert choice["message"]["content"] == "Hi there<|im_end|>Hi there"
    else:
        assert choice["message"]["content"] == "Hi there"  # eos counted, not shown
        assert r.json()["usage"]["completion_tokens"] == len(ids) + 1
    assert choice["finish_reason"] == "stop"


# -- errors ----------------------------------------------------------------------------------
BAD_REQUESTS = [
    # (path, raw body, status, param)
    ("/v1/chat/completions", "{not json", 400, None),
    ("/v1/chat/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", '{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', 400,
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [], "temperature": "hot"}', 400, "temperature"),
    ("/v1/chat/completions", '{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}',
     400, "top_p"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "temperature": -1}',
     400, "temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
     400, "max_tokens"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 99}',
     400, "top_logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
     400, "top_logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}',
     400, "tools[0].function"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "messages"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}', 400, "logit_bias"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [999999]}', 400,
     "stop_token_ids"),
    ("/v1/completions", '{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", '{"prompt": []}', 400, "prompt"),
    ("/v1/completions", '{"prompt": [999999]}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "x", "priority": 1}', 400, "priority"),
    ("/v1/completions", '{"prompt": "x", "frequency_penalty": 3}', 400, "frequency_penalty"),
    ("/v1/completions", '{}', 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests(tok: Tokenizer, path: str, body: str, status: int,
                      param: str | None) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "POST", path, content=body, headers={"content-type": "application/json"}))
    err = assert_error(r, status, param)
    assert err["type"] == "invalid_request_error"
    assert engine.submitted == {}


def _ignored_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and "were present in the request but ignored" in r.getMessage()]


def test_unknown_fields_are_ignored_with_one_warning(tok: Tokenizer,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's policy: unknown fields (typos included) are dropped and named in one warning per
    request; known fields keep strict types."""
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    caplog.set_level(logging.WARNING, logger="blink.dpu")
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "max_tokens": 3, "tempreature": 1.7,
                          "cache_prompt": False, "stream": True,
                          "stream_options": {"include_usage": True, "chunked": True}}))
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 3
    (_, params), = engine.submitted.values()
    assert params.temperature != 1.7  # the typo did not reach the sampler
    assert _ignored_warnings(caplog) == [
        "The following fields were present in the request but ignored: "
        "{'cache_prompt', 'stream_options.chunked', 'tempreature'}"]

    caplog.clear()
    r = run(request(app, "POST", "/v1/completions",
                    json={"prompt": "Say", "max_tokens": 2, "unknown_field": [1, {"a": None}]}))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = run(request(app, "POST", "/tokenize", json={"prompt": "Say", "extra_a": 1}))
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("Say")
    r = run(request(app, "POST", "/tokenize", json={"messages": MESSAGES, "extra_b": 1}))
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode_chat(MESSAGES)
    r = run(request(app, "POST", "/detokenize", json={"tokens": tok.encode("Say"), "extra_c": 1}))
    assert r.status_code == 200 and r.json() == {"prompt": "Say"}
    assert [w.rsplit(": ", 1)[1] for w in _ignored_warnings(caplog)] == [
        "{'unknown_field'}", "{'extra_a'}", "{'extra_b'}", "{'extra_c'}"]

    caplog.clear()  # a request with only known fields logs nothing
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "max_tokens": 1, "return_token_ids": False}))
    assert r.status_code == 200 and _ignored_warnings(caplog) == []

    # Known fields stay strict, whatever unknown fields come with them.
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "temperature": "hot", "foo": 1}))
    assert assert_error(r, 400, "temperature")["type"] == "invalid_request_error"
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "return_token_ids": "yes"}))
    assert_error(r, 400, "return_token_ids")


# -- vLLM's return_token_ids ----------------------------------------------------------------------
def test_return_token_ids_chat(tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    answer_ids = tok.encode(ANSWER, add_special_tokens=False)
    engine = FakeEngineClient(model_name=MODEL, max_model_len=256,
                              responder=lambda p, s: answer_ids + [eos])
    app = create_app(engine, tok, model_name=MODEL)
    prompt_ids = tok.encode_chat(MESSAGES)

    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "n": 2, "return_token_ids": True}))
    body = r.json()
    assert body["prompt_token_ids"] == prompt_ids
    for choice in body["choices"]:
        assert choice["message"]["content"] == ANSWER
        assert choice["token_ids"] == answer_ids + [eos]  # eos is generated, as in vLLM
    ChatCompletionResponse.model_validate(body)

    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "stream": True, "return_token_ids": True,
                          "stream_options": {"include_usage": True}}))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    first, rest = events[0], events[1:-2]
    assert first["prompt_token_ids"] == prompt_ids
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "token_ids" not in first["choices"][0]
    assert all("prompt_token_ids" not in e for e in events[1:-1])
    assert all(isinstance(e["choices"][0]["token_ids"], list) for e in rest)
    assert sum((e["choices"][0]["token_ids"] for e in rest), []) == answer_ids + [eos]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in rest) == ANSWER
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == \
        len(answer_ids) + 1
    for e in events[:-1]:
        ChatCompletionChunk.model_validate(e)

    # Not asked for: no such keys anywhere (plain OpenAI shapes).
    r = run(request(app, "POST", "/v1/chat/completions", json={"messages": MESSAGES}))
    assert "prompt_token_ids" not in r.json() and "token_ids" not in r.json()["choices"][0]
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "stream": True}))
    for e in sse_events(r.text)[:-1]:
        assert "prompt_token_ids" not in e and "token_ids" not in e["choices"][0]


def test_return_token_ids_stream_sends_held_back_tokens(tok: Tokenizer) -> None:
    """Tokens whose text is held back (a split UTF-8 character) still get a chunk carrying
    their ids, so the streamed token_ids add up to every generated token (vLLM does this)."""
    from blink.shared.byte_level import unicode_to_bytes

    char_of = {b: c for c, b in unicode_to_bytes().items()}
    ids = [tok._tok.token_to_id(char_of[b]) for b in "😀".encode()]
    engine = FakeEngineClient(model_name=MODEL, responder=lambda p, s: ids)
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/completions",
                    json={"prompt": "Say", "stream": True, "max_tokens": 10,
                          "return_token_ids": True}))
    chunks = [e["choices"][0] for e in sse_events(r.text)[:-1]]
    assert [c["token_ids"] for c in chunks] == [[t] for t in ids] + [[]]
    assert [c["text"] for c in chunks] == ["", "", "", "😀", ""]
    assert chunks[0]["prompt_token_ids"] == tok.encode("Say")
    assert all("prompt_token_ids" not in c for c in chunks[1:])


def test_return_token_ids_completions(tok: Tokenizer) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    texts = ["Say hello", "to the world"]
    answer_ids = tok.encode(ANSWER, add_special_tokens=False)
    r = run(request(app, "POST", "/v1/completions",
                    json={"prompt": texts, "n": 2, "max_tokens": 4, "return_token_ids": True}))
    body = CompletionResponse.model_validate(r.json())
    assert [c.prompt_token_ids for c in body.choices] == \
        [tok.encode(texts[0])] * 2 + [tok.encode(texts[1])] * 2
    assert all(c.token_ids == answer_ids[:4] for c in body.choices)
    assert "prompt_token_ids" not in r.json()  # on the choice, as vLLM does for completions

    r = run(request(app, "POST", "/v1/completions",
                    json={"prompt": texts[0], "max_tokens": 5, "stream": True,
                          "return_token_ids": True, "stream_options": {"include_usage": True}}))
    events = sse_events(r.text)
    chunks = [e["choices"][0] for e in events[:-2]]
    assert chunks[0]["prompt_token_ids"] == tok.encode(texts[0])
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["token_ids"] for c in chunks), []) == answer_ids[:5]
    assert events[-2]["choices"] == []

    r = run(request(app, "POST", "/v1/completions", json={"prompt": texts[0], "max_tokens": 2}))
    assert set(r.json()["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}


def test_unknown_model_is_404_with_vllm_wording(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    for path, body in (("/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES}),
                       ("/v1/completions", {"model": "gpt-4", "prompt": "x"})):
        err = assert_error(run(request(app, "POST", path, json=body)), 404, "model")
        assert err["message"] == "The model `gpt-4` does not exist."
        assert err["code"] == "model_not_found"


def test_context_overflow_messages(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok, max_model_len=32), tok, model_name=MODEL)
    prompt_len = len(tok.encode_chat(MESSAGES))
    r = run(request(app, "POST", "/v1/chat/completions",
                    json={"messages": MESSAGES, "max_tokens": 30}))
    err = assert_error(r, 400)
    assert err["code"] == "context_length_exceeded"
    assert err["message"] == (
        f"This model's maximum context length is 32 tokens. However, you requested "
        f"{prompt_len + 30} tokens ({prompt_len} in the messages, 30 in the completion). "
        f"Please reduce the length of the messages or completion.")
    long = [{"role": "user", "content": "hello world " * 40}]
    err = assert_error(run(request(app, "POST", "/v1/chat/completions",
                                   json={"messages": long})), 400)
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith("This model's maximum context length is 32 tokens.")
    err = assert_error(run(request(app, "POST", "/v1/completions",
                                   json={"prompt": "hello " * 40, "max_tokens": 1})), 400)
    assert err["code"] == "context_length_exceeded"


def test_overloaded_is_503_with_retry_after(tok: Tokenizer) -> None:
    engine = make_engine(tok, retry_after_s=2.5)
    engine.full = True
    app = create_app(engine, tok, model_name=MODEL)
    for stream in (False, True):
        r = run(request(app, "POST", "/v1/chat/completions",
                        json={"messages": MESSAGES, "stream": stream, "n": 2}))
        err = assert_error(r, 503)
        assert err["code"] == "engine_overloaded"
        assert r.headers["retry-after"] == "3"
    assert engine.aborted == []  # nothing was admitted, so nothing to abort


def test_partial_admission_of_n_choices_is_rolled_back(tok: Tokenizer) -> None:
    """n=2 where only the first choice fits: 503, and the admitted one is aborted."""
    ids = tok.encode(ANSWER, add_special_tokens=False)
    engine = FakeEngineClient(model_name=MODEL, first_token_delay_s=0.05)

    def fill_up_after_first(prompt: list[int], params: Any) -> list[int]:
        engine.full = True
        return ids

    engine.responder = fill_up_after_first
    app = create_app(engine, tok, model_name=MODEL)
    r = run(request(app, "POST", "/v1/chat/completions", json={"messages": MESSAGES, "n": 2}))
    assert_error(r, 503)
    assert list(engine.submitted) == engine.aborted and len(engine.aborted) == 1


def test_engine_death_mid_stream_ends_with_error_event(tok: Tokenizer) -> None:
    engine = make_engine(tok, token_delay_s=0.02)
    app = create_app(engine, tok, model_name=MODEL)

    async def go() -> httpx.Response:
        asyncio.get_running_loop().call_later(0.1, engine.die)
        return await request(app, "POST", "/v1/chat/completions",
                             json={"messages": MESSAGES, "stream": True})

    r = run(go())
    assert r.status_code == 200  # the stream had started
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert error["object"] == "error" and error["error"]["code"] == "engine_unavailable"
    assert len(events) > 3  # some tokens made it before the engine died

    # non-streaming: the engine dies while the answer is being collected -> 503
    engine.revive()

    async def go_full() -> httpx.Response:
        asyncio.get_running_loop().call_later(0.1, engine.die)
        return await request(app, "POST", "/v1/chat/completions", json={"messages": MESSAGES})

    assert_error(run(go_full()), 503)


def test_engine_stall_mid_stream_loses_nothing(tok: Tokenizer) -> None:
    """A stalled engine (one slow step): /health is 503, the open stream pauses and then
    completes, and a request that arrives meanwhile is taken (not refused) and completes."""
    engine = make_engine(tok, token_delay_s=0.01)
    app = create_app(engine, tok, model_name=MODEL)

    async def go() -> tuple[httpx.Response, httpx.Response, list[int], list[int]]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, engine.stall)
        stream = asyncio.ensure_future(request(app, "POST", "/v1/chat/completions",
                                               json={"messages": MESSAGES, "stream": True}))
        await asyncio.sleep(0.15)
        assert engine.stalled and not stream.done()
        during = [(await request(app, "GET", "/health")).status_code]
        late = asyncio.ensure_future(request(app, "POST", "/v1/chat/completions",
                                             json={"messages": MESSAGES}))
        await asyncio.sleep(0.2)
        assert not stream.done() and not late.done()
        during.append((await request(app, "GET", "/health")).status_code)
        engine.resume()
        after = [(await request(app, "GET", "/health")).status_code]
        return await stream, await late, during, after

    r, late, during, after = run(go())
    assert during == [503, 503] and after == [200]
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == ANSWER
    assert late.status_code == 200
    assert late.json()["choices"][0]["message"]["content"] == ANSWER


def test_api_key(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL, api_key="s3cret")
    err = assert_error(run(request(app, "GET", "/v1/models")), 401)
    assert err["type"] == "authentication_error"
    assert_error(run(request(app, "POST", "/v1/chat/completions", json={"messages": MESSAGES},
                             headers={"Authorization": "Bearer wrong"})), 401)
    assert_error(run(request(app, "POST", "/tokenize", json={"prompt": "x"})), 401)
    ok = {"Authorization": "Bearer s3cret"}
    assert run(request(app, "GET", "/v1/models", headers=ok)).status_code == 200
    r = run(request(app, "POST", "/v1/chat/completions", json={"messages": MESSAGES}, headers=ok))
    assert r.status_code == 200
    assert run(request(app, "GET", "/health")).status_code == 200  # open for probes
    assert run(request(app, "GET", "/metrics")).status_code == 200


def test_unknown_route_is_json_error(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    assert_error(run(request(app, "GET", "/v1/nothing")), 404)


# -- tokenize / detokenize ---------------------------------------------------------------------
def test_tokenize_and_detokenize(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    r = run(request(app, "POST", "/tokenize",
                    json={"model": MODEL, "prompt": ANSWER, "return_token_strs": True}))
    body = r.json()
    ids = tok.encode(ANSWER)
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] == 256
    assert body["token_strs"] == [tok.id_to_token(t) for t in ids]
    r = run(request(app, "POST", "/tokenize", json={"messages": MESSAGES}))
    assert r.json()["tokens"] == tok.encode_chat(MESSAGES) and r.json()["token_strs"] is None
    r = run(request(app, "POST", "/detokenize", json={"tokens": ids}))
    assert r.json() == {"prompt": ANSWER}
    assert_error(run(request(app, "POST", "/detokenize", json={"tokens": [10**7]})), 400, "tokens")
    assert_error(run(request(app, "POST", "/tokenize", json={"model": "x", "prompt": "a"})), 404)


# -- metrics -----------------------------------------------------------------------------------
def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model_name="{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics(tok: Tokenizer) -> None:
    engine = make_engine(tok, num_cached_tokens=4, queue_time_s=0.01, token_delay_s=0.001)
    engine.kv_usage = 0.25
    engine.preemptions = 3
    app = create_app(engine, tok, model_name=MODEL)
    run(request(app, "POST", "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5}))
    run(request(app, "POST", "/v1/completions", json={"prompt": "Say", "max_tokens": 3}))
    r = run(request(app, "GET", "/metrics"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = r.text
    prompt_total = len(tok.encode_chat(MESSAGES)) + len(tok.encode("Say"))
    assert _metric(m, "blink:prompt_tokens_total") == prompt_total
    assert _metric(m, "blink:generation_tokens_total") == 8
    assert _metric(m, "blink:time_to_first_token_seconds_count") == 2
    assert _metric(m, "blink:e2e_request_latency_seconds_count") == 2
    assert _metric(m, "blink:inter_token_latency_seconds_count") == 8 - 2
    assert _metric(m, "blink:request_queue_time_seconds_count") == 2
    assert _metric(m, "blink:num_requests_running") == 0
    assert _metric(m, "blink:num_requests_waiting") == 0
    assert _metric(m, "blink:kv_cache_usage_perc") == 0.25
    assert _metric(m, "blink:prefix_cache_queries_total") == prompt_total
    assert _metric(m, "blink:prefix_cache_hits_total") == 4 + 1  # "Say" is 1 token
    assert _metric(m, "blink:num_preemptions_total") == 3


# -- client disconnects ------------------------------------------------------------------------
async def _call_and_disconnect(app: Any, body: dict, disconnect_after_s: float,
                               spec_version: str) -> tuple[list[dict], float]:
    """Drive the ASGI app directly; the client 'disconnects' after a delay."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "server": ("test", 80),
             "client": ("test", 1), "headers": [(b"content-type", b"application/json"),
                                                 (b"host", b"test")]}
    body_sent = False
    gone = asyncio.Event()
    asyncio.get_running_loop().call_later(disconnect_after_s, gone.set)
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    start = time.monotonic()
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent, time.monotonic() - start


# Starlette watches for disconnects itself only while streaming and only under ASGI spec < 2.4;
# the frontend's own watcher must cover the other cases.
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("phase", ["before_first_token", "while_generating"])
def test_disconnect_aborts_engine_request(tok: Tokenizer, stream: bool, phase: str,
                                          spec_version: str) -> None:
    first_delay = 10.0 if phase == "before_first_token" else 0.0
    engine = make_engine(tok, answer=ANSWER * 20, first_token_delay_s=first_delay,
                         token_delay_s=0.02, max_model_len=4096)
    app = create_app(engine, tok, model_name=MODEL)
    sent, elapsed = run(_call_and_disconnect(
        app, {"messages": MESSAGES, "stream": stream}, 0.15, spec_version))
    (rid,) = engine.submitted
    assert engine.aborted == [rid]
    assert rid not in engine.finished  # it did not run to the end
    assert elapsed < 2.0  # promptly, not after the 10 s first token / full answer
    assert engine.running == set()


# -- the official openai client against uvicorn --------------------------------------------------
@pytest.fixture(scope="module")
def server(tok: Tokenizer) -> Iterator[tuple[str, FakeEngineClient]]:
    engine = make_engine(tok, token_delay_s=0.001)
    app = create_app(engine, tok, model_name=MODEL, api_key="k")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()


def test_openai_client(server: tuple[str, FakeEngineClient]) -> None:
    import openai

    base, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50)
    assert chat.choices[0].message.content == ANSWER and chat.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    comp = client.completions.create(model=MODEL, prompt="Say", max_tokens=5, n=2)
    assert len(comp.choices) == 2 and comp.usage.completion_tokens == 10
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Say", max_tokens=200, stream=True))
    assert text == ANSWER
    # vLLM's return_token_ids through extra_body; unknown extras are ignored, not rejected.
    ids = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                         extra_body={"return_token_ids": True,
                                                     "cache_prompt": False})
    assert ids.prompt_token_ids and ids.choices[0].token_ids and \
        len(ids.choices[0].token_ids) == ids.usage.completion_tokens == 5
    streamed = list(client.completions.create(
        model=MODEL, prompt="Say", max_tokens=5, stream=True,
        extra_body={"return_token_ids": True}))
    assert streamed[0].choices[0].prompt_token_ids
    assert sum(len(c.choices[0].token_ids) for c in streamed) == 5
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-3)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="bad", max_retries=0).models.list()


def test_real_socket_disconnect_aborts(server: tuple[str, FakeEngineClient]) -> None:
    base, engine = server
    engine.token_delay_s = 0.02
    try:
        with httpx.Client(base_url=base, headers={"Authorization": "Bearer k"}) as client:
            with client.stream("POST", "/v1/completions",
                               json={"prompt": "Say", "max_tokens": 200, "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # one event, then hang up
        rid = list(engine.submitted)[-1]
        deadline = time.monotonic() + 2
        while rid not in engine.aborted:
            assert time.monotonic() < deadline, "abort not called after disconnect"
            time.sleep(0.01)
        assert rid not in engine.finished
    finally:
        engine.token_delay_s = 0.001
