"""/openapi.json publishes the real API (issue 34, item 7): each route's request body (the
pydantic models the routes parse themselves), its answers and error statuses; /health answers
the JSON it documents, /metrics the text it documents. Then schemathesis checks the app against
the whole schema: no 5xx, only documented statuses, content types and bodies. Before, the
schema had no request bodies or error statuses, /health an empty body, /metrics JSON."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import MODEL, make_engine, tiny_tokenizer  # noqa: E402

from blink.dpu.app import create_app  # noqa: E402

TOKENIZER = tiny_tokenizer()
APP = create_app(make_engine(TOKENIZER), TOKENIZER, model_name=MODEL)
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)
BODIES = {"/v1/chat/completions": "ChatCompletionRequest",
          "/v1/completions": "CompletionRequest", "/v1/responses": "ResponsesRequest",
          "/detokenize": "DetokenizeRequest"}


def test_schema_publishes_request_bodies_and_error_answers():
    doc = APP.openapi()
    components = doc["components"]["schemas"]
    for path, model in BODIES.items():
        post = doc["paths"][path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}, path
        assert {"400", "413", "500", "503"} <= set(post["responses"]), path
        assert model in components
    tokenize = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]
    assert {r["$ref"].rsplit("/", 1)[1] for r in tokenize["schema"]["anyOf"]} == {
        "TokenizeCompletionRequest", "TokenizeChatRequest"}
    assert "messages" in components["ChatCompletionRequest"]["properties"]
    error = doc["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]
    assert error["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    streams = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(streams) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


@pytest.mark.anyio
async def test_health_and_metrics_answer_what_is_documented():
    transport = httpx.ASGITransport(app=APP)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = await client.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain")
        assert "blink:http_connections" in r.text


@SCHEMA.parametrize()
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_the_app_conforms_to_its_schema(case):
    """Every operation with generated requests (bounded, seeded): no 5xx, and every answer's
    status, content type and body are the ones the schema documents."""
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance,
                                   content_type_conformance, response_schema_conformance])
