"""What a vLLM user's clients call beyond chat/completions: ``/v1/responses`` (stateless,
with the official ``openai`` client when installed), ``GET /v1/models/{id}``, ``/version``,
``x-request-id`` on every response and in the access log, CORS, and the JSON 404 that names
the endpoints."""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import (  # noqa: E402
    ANSWER,
    MODEL,
    asgi_request,
    make_engine,
    serve_in_thread,
    tiny_tokenizer,
)

from blink.dpu.app import CorsOptions, create_app  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def call(app, method: str, path: str, **kw) -> httpx.Response:
    return asyncio.run(asgi_request(app, method, path, **kw))


@pytest.fixture
def app(tok):
    return create_app(make_engine(tok), tok, model_name=MODEL)


# -- /v1/responses -----------------------------------------------------------------------


def test_responses_text_input(app):
    r = call(app, "POST", "/v1/responses", json={"model": MODEL, "input": "Say hello",
                                                "instructions": "Be brief."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["id"].startswith("resp_") and body["store"] is False
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0] == {"type": "output_text", "text": ANSWER, "annotations": [],
                                  "logprobs": []}
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0


def test_responses_message_items_render_like_chat(app, tok):
    engine = app.state.engine
    call(app, "POST", "/v1/responses", json={
        "instructions": "sys", "input": [
            {"role": "developer", "content": "dev"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
            {"role": "user", "content": "again"}]})
    prompt, _ = list(engine.submitted.values())[-1]
    want = tok.encode_chat([{"role": "system", "content": "sys"},
                            {"role": "system", "content": "dev"},
                            {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "yo"},
                            {"role": "user", "content": "again"}])
    assert prompt == want


def test_responses_sampling_fields_reach_the_engine(app):
    engine = app.state.engine
    r = call(app, "POST", "/v1/responses", json={
        "input": "x", "max_output_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
        "seed": 11, "top_logprobs": 2, "include": ["message.output_text.logprobs"]})
    assert r.status_code == 200, r.text
    _, params = list(engine.submitted.values())[-1]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed,
            params.logprobs) == (3, 0.5, 0.9, 7, 11, 2)
    body = r.json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    lps = body["output"][0]["content"][0]["logprobs"]
    assert len(lps) == 3 and len(lps[0]["top_logprobs"]) == 2


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # auto needs the flags
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content"),
    ({"model": "other"}, "model"),
])
def test_responses_refuses_what_it_cannot_honour(app, extra, param):
    r = call(app, "POST", "/v1/responses", json={"input": "x", **extra})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert not app.state.engine.submitted  # refused before any engine work


def _events(text: str) -> list[dict]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append(data)
    return out


def test_responses_stream_event_order(app):
    r = call(app, "POST", "/v1/responses", json={"input": "Say hello", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == ANSWER == events[-4]["text"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ANSWER


def test_responses_stream_reports_an_engine_failure(tok):
    engine = make_engine(tok, token_delay_s=0.01)
    app = create_app(engine, tok, model_name=MODEL)

    async def main():
        task = asyncio.ensure_future(asgi_request(app, "POST", "/v1/responses",
                                                  json={"input": "x", "stream": True}))
        await asyncio.sleep(0.05)
        engine.die()
        return await task

    events = _events(asyncio.run(main()).text)
    assert events[-1]["type"] == "error" and events[-1]["message"]


def test_openai_client_responses(tok):
    openai = pytest.importorskip("openai")
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        r = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=64)
        assert r.output_text == ANSWER and r.status == "completed"
        assert r._request_id  # x-request-id reached the SDK
        with client.responses.stream(model=MODEL, input="Say hello") as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            assert "".join(deltas) == stream.get_final_response().output_text == ANSWER
        with pytest.raises(openai.BadRequestError, match="stateless"):
            client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
        assert client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("nope")


# -- models, version, 404, request ids, CORS ------------------------------------------------


def test_model_by_id_and_version(app):
    r = call(app, "GET", f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL
    r = call(app, "GET", "/v1/models/org/other-model")  # ids may hold a slash
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = call(app, "GET", "/version")
    assert r.status_code == 200 and r.json()["version"]


def test_unknown_route_names_the_endpoints(app):
    r = call(app, "GET", "/v1/embeddings")
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert message.startswith("GET /v1/embeddings is not an endpoint of this server")
    for endpoint in ("POST /v1/chat/completions", "POST /v1/responses", "GET /v1/models/{model_id}",
                     "GET /version", "GET /health", "GET /metrics"):
        assert endpoint in message
    assert call(app, "GET", "/v1/chat/completions").status_code == 405  # wrong method stays 405


def test_request_id_echoed_or_made(app):
    r = call(app, "GET", "/health", headers={"x-request-id": "client-id-1"})
    assert r.headers["x-request-id"] == "client-id-1"
    made = call(app, "GET", "/v1/models").headers["x-request-id"]
    assert len(made) == 32 and made != call(app, "GET", "/v1/models").headers["x-request-id"]
    # errors too, and a hostile id is replaced rather than echoed
    r = call(app, "GET", "/nowhere", headers={"x-request-id": "bad id\twith spaces"})
    assert r.status_code == 404 and r.headers["x-request-id"] != "bad id\twith spaces"
    r = call(app, "POST", "/v1/chat/completions", content=b"{", headers={"x-request-id": "e1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "e1"


def test_access_log_names_the_request_and_can_be_turned_off(tok, caplog):
    app = create_app(make_engine(tok), tok, model_name=MODEL)
    with caplog.at_level(logging.INFO, logger="blink.access"):
        call(app, "POST", "/v1/completions", json={"prompt": "Say", "max_tokens": 2},
             headers={"x-request-id": "req-42"})
    [record] = [r for r in caplog.records if r.name == "blink.access"]
    line = record.getMessage()
    assert '"POST /v1/completions HTTP/1.1" 200' in line and "request_id=req-42" in line
    caplog.clear()
    quiet = create_app(make_engine(tok), tok, model_name=MODEL, log_requests=False)
    with caplog.at_level(logging.INFO, logger="blink.access"):
        r = call(quiet, "GET", "/health", headers={"x-request-id": "q"})
    assert r.headers["x-request-id"] == "q"
    assert not [r for r in caplog.records if r.name == "blink.access"]


def test_access_log_skips_endpoints_and_vllm_flags_map(tok, caplog):
    """--disable-access-log-for-endpoints leaves those paths out; --disable-uvicorn-access-log
    (vLLM's name) turns the access log off like --disable-log-requests."""
    from blink.cli import parse_args
    from blink.dpu.app import app_options

    opts = app_options(parse_args(["serve", "--disable-access-log-for-endpoints", "/health, /metrics"]))
    assert opts["log_requests"] and opts["access_log_skip"] == {"/health", "/metrics"}
    assert not app_options(parse_args(["serve", "--disable-uvicorn-access-log"]))["log_requests"]
    app = create_app(make_engine(tok), tok, model_name=MODEL, access_log_skip=opts["access_log_skip"])
    with caplog.at_level(logging.INFO, logger="blink.access"):
        call(app, "GET", "/health")
        call(app, "GET", "/v1/models")
    lines = [r.getMessage() for r in caplog.records if r.name == "blink.access"]
    assert len(lines) == 1 and "/v1/models" in lines[0]


def test_enable_log_requests_logs_inputs_and_outputs(tok, caplog):
    from blink.cli import parse_args
    from blink.dpu.app import app_options
    from blink.errors import BlinkError

    with pytest.raises(BlinkError, match="requires --enable-log-requests"):
        app_options(parse_args(["serve", "--enable-log-outputs"]))
    opts = app_options(parse_args(["serve", "--enable-log-requests", "--enable-log-outputs",
                                   "--max-log-len", "2"]))
    app = create_app(make_engine(tok), tok, model_name=MODEL, request_log=opts["request_log"])
    with caplog.at_level(logging.DEBUG, logger="blink.requests"):
        r = call(app, "POST", "/v1/completions",
                 json={"prompt": "Say something", "max_tokens": 2, "temperature": 0.5, "n": 2},
                 headers={"x-request-id": "req-7"})
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "blink.requests"]
    received = [m for m in lines if m.startswith("Received request")]
    finished = [m for m in lines if m.startswith("Finished request")]
    assert len(received) == 2 and len(finished) == 2  # n=2: one engine request per choice
    assert all("temperature=0.5" in m and "prompt tokens" in m for m in received)
    assert all("finish_reason" in m for m in finished)
    ids = [m for m in lines if "prompt_token_ids" in m]
    assert ids and all(m.count(",") <= 1 for m in ids)  # --max-log-len 2: at most two ids
    caplog.clear()
    plain = create_app(make_engine(tok), tok, model_name=MODEL)  # the default: no request log
    with caplog.at_level(logging.DEBUG, logger="blink.requests"):
        call(plain, "POST", "/v1/completions", json={"prompt": "Say", "max_tokens": 2})
    assert not [rec for rec in caplog.records if rec.name == "blink.requests"]


def test_cors_only_when_asked(tok):
    plain = create_app(make_engine(tok), tok, model_name=MODEL)
    headers = {"origin": "https://app.example", "access-control-request-method": "POST"}
    r = call(plain, "OPTIONS", "/v1/chat/completions", headers=headers)
    assert "access-control-allow-origin" not in r.headers
    cors = create_app(make_engine(tok), tok, model_name=MODEL, cors=CorsOptions(
        allow_origins=["https://app.example"], allow_methods=["*"], allow_headers=["*"]))
    r = call(cors, "OPTIONS", "/v1/chat/completions", headers=headers)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = call(cors, "GET", "/v1/models", headers={"origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"]


# -- /ping (SageMaker's health probe, issue 33) ----------------------------------------------


def test_ping_is_health_for_get_and_post_without_the_key(tok):
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL, api_key="k")
    for method in ("GET", "POST"):
        r = call(app, method, "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}, (method, r.text)
    assert call(app, "GET", "/v1/models").status_code == 401  # the key still guards the API
    engine.die()
    for method in ("GET", "POST"):
        r = call(app, method, "/ping")
        assert r.status_code == 503 and r.json() == call(app, "GET", "/health").json()
    engine.revive()
    assert call(app, "POST", "/ping").status_code == 200
    assert "/ping" in app.openapi()["paths"]


# -- several --served-model-name (issue 33) ---------------------------------------------------


def test_every_served_model_name_is_served(tok):
    app = create_app(make_engine(tok), tok, model_name=["a", "b"])
    r = call(app, "GET", "/v1/models")
    assert [m["id"] for m in r.json()["data"]] == ["a", "b"]
    for served in ("a", "b"):
        assert call(app, "GET", f"/v1/models/{served}").json()["id"] == served
        for path, body in (("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = call(app, "POST", path, json={"model": served, "max_tokens": 3, **body})
            assert r.status_code == 200, r.text
    r = call(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 404 and MODEL in r.json()["error"]["message"]
    assert call(app, "GET", f"/v1/models/{MODEL}").status_code == 404
