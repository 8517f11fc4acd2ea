"""Frontend request limits (blink.dpu.limits): what a single hostile request may cost.

Each worst case answers a clear 4xx at once: huge n and fan-outs, request-supplied and
runaway chat templates, over-long prompts for /tokenize and /detokenize, oversized bodies,
out-of-range sampling numbers, odd logit_bias keys. An internal error is a JSON 500 that keeps
the keep-alive connection usable. The API docs sit behind the API key.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from blink.cli import parse_args
from blink.dpu.app import InternalErrorMiddleware, app_options, create_app
from blink.dpu.chat_template import ChatTemplateError, RenderLimits, render_chat_template
from blink.dpu.limits import RequestLimits
from blink.dpu.tokenizer import Tokenizer
from blink.errors import BlinkError

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import asgi_request, MESSAGES, MODEL, make_engine, serve_in_thread, tiny_tokenizer  # noqa: E402

TRUSTED = RequestLimits(trust_request_chat_template=True, chat_template_timeout_s=0.3)
RUNAWAY_TEMPLATES = [
    "{{ 'a' * 100000000 }}",
    "{% for x in range(100000000) %}x{% endfor %}",
    "{% for x in range(100000) %}{% for y in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'ab' * 1000 %}{% for a in s %}{% for b in s %}{% for c in s %}{% endfor %}"
    "{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ 'a' | center(1000000000) }}",
    "{{ [1] | batch(1000000000, 'x') | list }}",
    "{{ 2 ** 1000000000 }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 'x'.ljust(10 ** 9) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "{{ range(100) | join('x' * 100000) }}",
    "{{ lipsum(100000) }}",
    "{{ 1 / 0 }}",
    "{{" + "(" * 200 + "1" + ")" * 200 + "}}",  # overflows jinja's parser
    "{% for a in b %}" * 150 + "{% endfor %}" * 150,  # overflows Python's compiler
    "{{ '%*d' % (100000000, 1) }}",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


request = asgi_request


def post(app: Any, path: str, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return run(request(app, "POST", path, content=content,
                       headers={"content-type": "application/json"}, **kw))


def error_of(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["object"] == "error" and set(body["error"]) == {"message", "type", "param", "code"}
    if param != "any":
        assert body["error"]["param"] == param, body
    return body["error"]


# -- n and fan-out -------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 10_000_000}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "n": 10_000_000}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 10_000_000, "best_of": 10_000_000}),
])
def test_huge_n_is_refused_at_once(tok: Tokenizer, path: str, body: dict) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    start = time.monotonic()
    err = error_of(post(app, path, body), 400, "n")
    assert time.monotonic() - start < 1.0
    assert err["message"] == "n must be at most 128, got 10000000."
    assert engine.submitted == {}


def test_fanout_is_bounded_by_what_the_engine_holds(tok: Tokenizer) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    err = error_of(post(app, "/v1/completions",
                        {"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 100}), 400, "prompt")
    assert "300 completions (3 prompts x n=100)" in err["message"] and "at most 256" in err["message"]
    err = error_of(post(app, "/v1/completions",
                        {"prompt": ["a"] * 1000, "max_tokens": 1}), 400, "prompt")
    assert "1000 completions" in err["message"]
    assert engine.submitted == {}
    small = create_app(engine, tok, model_name=MODEL, limits=RequestLimits(max_fanout=4))
    err = error_of(post(small, "/v1/chat/completions", {"messages": MESSAGES, "n": 5}), 400, "n")
    assert "5 completions (n=5)" in err["message"] and "at most 4 at once" in err["message"]
    assert post(small, "/v1/chat/completions",
                {"messages": MESSAGES, "n": 4, "max_tokens": 2}).status_code == 200


def test_seed_near_the_int64_limit_with_n_choices(tok: Tokenizer) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    r = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 3, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text
    seeds = sorted(params.seed for _, params in engine.submitted.values())
    assert seeds == [-(2**63), -(2**63) + 1, 2**63 - 1]  # wrapped within int64, all distinct


# -- sampling numbers and logit_bias keys ----------------------------------------------------------
@pytest.mark.parametrize("raw,param", [
    ('"temperature": 1e300', "temperature"),
    ('"temperature": 1e400', "temperature"),  # parses as inf
    ('"temperature": NaN', "temperature"),
    ('"temperature": -Infinity', "temperature"),
    ('"repetition_penalty": 1e300', "repetition_penalty"),
    ('"repetition_penalty": NaN', "repetition_penalty"),
    ('"top_p": NaN', "top_p"),
    ('"min_p": Infinity', "min_p"),
    ('"presence_penalty": NaN', "presence_penalty"),
    ('"frequency_penalty": 1e300', "frequency_penalty"),
    ('"logit_bias": {" 12 ": 1}', "logit_bias"),
    ('"logit_bias": {"1_0": 1}', "logit_bias"),
    ('"logit_bias": {"+3": 1}', "logit_bias"),
    ('"logit_bias": {"5": NaN}', "logit_bias"),
    ('"max_tokens": 100000000000000000000', "max_tokens"),
    ('"seed": 100000000000000000000', "seed"),
])
def test_out_of_range_numbers_are_400(tok: Tokenizer, raw: str, param: str) -> None:
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    for path, head in (("/v1/completions", '{"prompt": "hi", '),
                       ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], ')):
        err = error_of(post(app, path, head + raw + "}"), 400, param)
        assert err["type"] == "invalid_request_error"
    assert engine.submitted == {}


# -- chat templates ------------------------------------------------------------------------------------
def test_request_chat_template_is_refused_unless_trusted(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    for path in ("/v1/chat/completions", "/tokenize"):
        err = error_of(post(app, path, {"messages": MESSAGES, "chat_template": "{{ 'x' }}"}),
                       400, "chat_template")
        assert "--trust-request-chat-template is not set" in err["message"]
    trusted = create_app(make_engine(tok), tok, model_name=MODEL, limits=TRUSTED)
    r = post(trusted, "/tokenize", {"messages": MESSAGES, "chat_template": "{{ 'Say hello' }}"})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("Say hello",
                                                                    add_special_tokens=False)
    too_long = {"messages": MESSAGES, "chat_template": "x" * (TRUSTED.max_chat_template_chars + 1)}
    assert "too long" in error_of(post(trusted, "/tokenize", too_long), 400,
                                  "chat_template")["message"]


@pytest.mark.parametrize("template", RUNAWAY_TEMPLATES)
def test_runaway_templates_are_400_quickly(tok: Tokenizer, template: str) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL, limits=TRUSTED)
    for path in ("/tokenize", "/v1/chat/completions"):
        start = time.monotonic()
        err = error_of(post(app, path, {"messages": MESSAGES, "chat_template": template}),
                       400, "chat_template")
        # The render deadline is 0.3 s; compiling a deeply nested template is outside it (about
        # 1-2 s on a loaded 2-core machine). 5 s still fails the unbounded render this guards
        # against (41.7 s before the limits), without failing on a busy machine.
        assert time.monotonic() - start < 5.0, template
        assert err["message"].startswith(("chat template error", "the chat template",
                                          "range()", "lipsum()")), err["message"]
        assert "Traceback" not in err["message"]


def test_render_limits_directly() -> None:
    limits = RenderLimits(timeout_s=0.2, max_chars=1000)
    assert render_chat_template("{{ 'x' * 1000 }}", MESSAGES, limits=limits) == "x" * 1000
    with pytest.raises(ChatTemplateError, match="at most 1000"):
        render_chat_template("{{ 'x' * 1001 }}", MESSAGES, limits=limits)
    with pytest.raises(ChatTemplateError, match="more than 1000"):  # the output as a whole
        render_chat_template("{% for i in range(11) %}{{ 'x' * 100 }}{% endfor %}", MESSAGES,
                             limits=limits)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="within 0.2 s"):
        render_chat_template("{% for a in range(900) %}{% for b in range(900) %}"
                             "{% for c in range(900) %}{% endfor %}{% endfor %}{% endfor %}",
                             MESSAGES, limits=limits)
    assert time.monotonic() - start < 1.0
    # Ordinary template features still work under the budget.
    out = render_chat_template(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m.content | upper }}{% endfor %}{{ ns.n }}{{ range(3) | list | length }}"
        "{{ [1, 2] | join(',') }}{{ '%d' % 7 }}{{ '{}!'.format('ok') }}{{ 'a' * 3 }}"
        "{{ '%5d%%' % 3 }}{{ '50% *{:>3}'.format(1) }}{{ '%s' | format(2) }}",
        MESSAGES, limits=limits)
    assert out == ("SAY HELLO" + "1" + "3" + "1,2" + "7" + "ok!" + "aaa" + "    3%"
                   + "50% *  1" + "2")


# -- prompt lengths: /tokenize, /detokenize, completions ----------------------------------------------
def test_tokenize_caps(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tok)  # max_model_len 256
    app = create_app(engine, tok, model_name=MODEL)
    cap = app.state.serving.max_prompt_chars
    assert cap == 256 * tok.max_token_bytes * 3
    calls: list[int] = []
    real_encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: calls.append(len(text)) or
                        real_encode(text, **kw))
    # Far too long: refused by length, never encoded.
    err = error_of(post(app, "/tokenize", {"prompt": "a" * (cap + 1)}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and f"{cap} characters at most" in err["message"]
    err = error_of(post(app, "/v1/completions", {"prompt": "a" * (cap + 1)}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert calls == []
    # Encodable but over the context: refused with the count, not millions of ids.
    err = error_of(post(app, "/tokenize", {"prompt": "😀" * 300}), 400, "prompt")
    assert "maximum context length is 256 tokens" in err["message"]
    assert f"has {len(real_encode('😀' * 300))} tokens" in err["message"]
    ok = post(app, "/tokenize", {"prompt": "Say hello " * 10})
    assert ok.status_code == 200 and ok.json()["count"] <= 256
    # A conversation too long for the context: the render stops at the same bound.
    calls.clear()
    long_chat = {"messages": [{"role": "user", "content": "a" * (cap // 2)}] * 3}
    for path in ("/tokenize", "/v1/chat/completions"):
        err = error_of(post(app, path, long_chat), 400, "messages")
        assert err["code"] == "context_length_exceeded", err
        assert "rendered conversation has more than" in err["message"]
    assert calls == []
    err = error_of(post(app, "/detokenize", {"tokens": [1] * 257}), 400, "tokens")
    assert "at most 256 tokens" in err["message"]
    # Token-id prompts over the context are refused before any per-id work.
    err = error_of(post(app, "/v1/completions", {"prompt": [10**9] * 300}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"


def test_long_texts_take_the_gil_free_encode(tok: Tokenizer) -> None:
    slow = Tokenizer(tok._tok.to_str(), tok.config, {}, fast=False)  # no fast path
    text = "Say hello to the world 😀, Grüße! " * 400
    assert len(text) > 4096
    assert slow.encode(text) == tok._tok.encode(text).ids == tok.encode(text)


def test_request_body_limit(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL,
                     limits=RequestLimits(max_request_body_bytes=1000))
    err = error_of(post(app, "/tokenize", {"prompt": "a" * 2000}), 413)
    assert err["code"] == "request_too_large" and "at most 1000 bytes" in err["message"]

    async def chunked() -> Any:  # no Content-Length: cut off while reading
        for _ in range(5):
            yield b" " * 400

    r = run(request(app, "POST", "/v1/completions", content=chunked()))
    assert error_of(r, 413)["message"].startswith("The request body is too large (more than")
    assert post(app, "/tokenize", {"prompt": "Say hello"}).status_code == 200


def test_costly_json_shapes_are_refused_before_they_are_built(tok: Tokenizer) -> None:
    from blink.dpu.limits import MAX_JSON_ITEMS, json_item_count
    from blink.dpu.protocol import MAX_MESSAGES, MAX_PROMPTS

    app = create_app(make_engine(tok), tok, model_name=MODEL)
    limit = app.state.serving.max_json_items
    assert limit == MAX_JSON_ITEMS + 2 * 256
    for path, body in (("/v1/completions", {"prompt": [[1]] * (limit + 1)}),
                       ("/v1/completions", {"prompt": "x", "logit_bias":
                                            {str(i): 1 for i in range(limit)}}),
                       ("/detokenize", {"tokens": [1] * (limit + 1)}),
                       ("/tokenize", {"prompt": "x", "junk": [[]] * (limit + 1)})):
        err = error_of(post(app, path, body), 400, None)
        assert f"more than {limit} JSON values" in err["message"], err
    # Commas and brackets inside strings are text, not values.
    text = "[{a, b}] " * (limit // 2)
    assert json_item_count(json.dumps({"prompt": text}).encode(), limit) == 1
    assert json_item_count(json.dumps({"p": '\\"[,' * limit, "x": [["\\"]]}).encode(),
                           limit) == 4
    err = error_of(post(app, "/v1/chat/completions",
                        {"messages": [{"role": "user"}] * (MAX_MESSAGES + 1)}), 400, "messages")
    assert f"at most {MAX_MESSAGES} items" in err["message"]
    err = error_of(post(app, "/v1/completions", {"prompt": ["x"] * (MAX_PROMPTS + 1)}),
                   400, "prompt")
    assert f"at most {MAX_PROMPTS} prompts" in err["message"]


# -- auth and docs -------------------------------------------------------------------------------
def test_docs_need_the_key_and_401_says_bearer(tok: Tokenizer) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL, api_key="s3cret")
    key = {"Authorization": "Bearer s3cret"}
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/models"):
        r = run(request(app, "GET", path))
        error_of(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
        assert run(request(app, "GET", path, headers=key)).status_code == 200
    assert "/v1/completions" in run(request(app, "GET", "/openapi.json", headers=key)).json()["paths"]
    public = create_app(make_engine(tok), tok, model_name=MODEL, api_key="s3cret",
                        public_docs=True)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert run(request(public, "GET", path)).status_code == 200
    error_of(run(request(public, "GET", "/v1/models")), 401)
    open_app = create_app(make_engine(tok), tok, model_name=MODEL)
    assert run(request(open_app, "GET", "/openapi.json")).status_code == 200


# -- internal errors keep the connection -----------------------------------------------------------
def _http(sock: socket.socket, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request on an open keep-alive socket; (status, body)."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    header, rest = data.split(b"\r\n\r\n", 1)
    lines = header.decode().split("\r\n")
    fields = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    if fields.get("transfer-encoding") == "chunked":
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection mid-body")
            rest += chunk
    else:
        while len(rest) < int(fields.get("content-length", "0")):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection mid-body")
            rest += chunk
    return int(lines[0].split()[1]), rest


def test_internal_error_is_json_500_and_keeps_the_connection(
        tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL)

    async def boom(request: Any) -> Any:  # a fault injected into a handler
        raise RuntimeError("injected fault")

    monkeypatch.setattr(app.state.serving, "detokenize", boom)
    with serve_in_thread(app) as base:
        with httpx.Client(base_url=base, limits=httpx.Limits(max_connections=1)) as client:
            for _ in range(3):
                r = client.post("/detokenize", json={"tokens": [1]})
                err = error_of(r, 500)
                assert err["type"] == "server_error" and "RuntimeError" in err["message"]
                assert client.post("/tokenize", json={"prompt": "Say"}).status_code == 200
        # The same, on one socket: the server must not close it after the 500.
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            assert _http(sock, "POST", "/detokenize", b'{"tokens": [1]}')[0] == 500
            status, body = _http(sock, "POST", "/tokenize", b'{"prompt": "Say"}')
            assert status == 200 and json.loads(body)["count"] > 0


def test_error_mid_stream_ends_the_stream_cleanly(
        tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(make_engine(tok), tok, model_name=MODEL)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected mid-stream fault")

    monkeypatch.setattr(app.state.serving, "_completion_logprobs", broken)
    with serve_in_thread(app) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            status, body = _http(sock, "POST", "/v1/completions",
                                 b'{"prompt": "Say", "stream": true, "logprobs": 1}')
            assert status == 200 and b"internal_error" in body and b"data: [DONE]" in body
            assert _http(sock, "POST", "/tokenize", b'{"prompt": "Say"}')[0] == 200


def test_internal_error_middleware_after_the_response_started() -> None:
    async def half_then_fail(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})
        raise RuntimeError("after the headers")

    with serve_in_thread(InternalErrorMiddleware(half_then_fail)) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            for _ in range(2):  # the chunked body is terminated; the connection stays open
                assert _http(sock, "GET", "/") == (200, b"7\r\npartial\r\n0\r\n\r\n")


# -- flags -------------------------------------------------------------------------------------------
def test_flags_config_and_frontend_hand_over(tmp_path: Any) -> None:
    from blink.launcher import frontend_args

    a = parse_args(["serve"])
    assert (a.max_request_body_mb, a.chat_template_timeout) == (8.0, 0.5)
    assert not a.trust_request_chat_template and not a.public_docs
    cfg = tmp_path / "limits.yaml"
    cfg.write_text("trust-request-chat-template: true\nmax_request_body_mb: 2\n"
                   "chat-template-timeout: 0.25\npublic_docs: true\n")
    a = parse_args(["serve", "--config", str(cfg)])
    b = parse_args(frontend_args(a, "127.0.0.1:7000"))  # what blink serve starts its frontend with
    options = app_options(b)
    assert options["public_docs"] is True
    assert options["limits"] == RequestLimits(max_request_body_bytes=2 << 20,
                                              chat_template_timeout_s=0.25,
                                              trust_request_chat_template=True)
    with pytest.raises(BlinkError, match="--max-request-body-mb must be positive"):
        app_options(parse_args(["serve", "--max-request-body-mb", "0"]))
    with pytest.raises(BlinkError, match="--chat-template-timeout must be positive"):
        app_options(parse_args(["serve", "--chat-template-timeout", "-1"]))
