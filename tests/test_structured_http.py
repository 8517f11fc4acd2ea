"""Structured-output request fields over HTTP (fake engine): every accepted form reaches the
engine as one compiled constraint, in chat and completions, streaming or not, n > 1; every
refused or invalid one is a 400 naming the field."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dpu_helpers import MESSAGES, MODEL, asgi_request, make_engine, tiny_tokenizer  # noqa: E402

from blink.dpu.app import create_app  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def post(app, path, body):
    return asyncio.run(asgi_request(app, "POST", path, json=body))


@pytest.mark.parametrize("fields,kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}}, "json"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"guided_json": SCHEMA}, "json"),
    ({"guided_regex": "x+"}, "regex"),
    ({"guided_choice": ["yes", "no"]}, "choice"),
    ({"guided_grammar": "root ::= \"a\" [b-c]*"}, "grammar"),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, "grammar"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "json"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"}, "json"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=x>", "schema": SCHEMA, "end": "</f>"}]}}, "structural_tag"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_accepted_forms_reach_the_engine_compiled(tok, fields, kind, path, stream):
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    body = {"model": MODEL, "n": 2, "max_tokens": 8, "stream": stream, **fields}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "hi"})
    r = post(app, path, body)
    assert r.status_code == 200, r.text
    assert len(engine.submitted) == 2
    for rid, (_, params) in engine.submitted.items():
        assert params.structured_outputs is not None and params.structured_outputs.kind == kind
        assert engine.grammars[rid] is not None and len(engine.grammars[rid].key) == 64


@pytest.mark.parametrize("fields,param", [
    ({"guided_grammar": "root ::= undefined_rule"}, None),
    ({"structured_outputs": {"structural_tag": "{}"}}, None),
    ({"structured_outputs": {"json": {}, "backend": "outlines"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "("}, None),
    ({"guided_regex": "a(?=b)"}, None),  # valid Python, not a regex the engine takes
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, None),  # unsatisfiable
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_whitespace_pattern": " *", "guided_regex": "a"}, "guided_whitespace_pattern"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "("}, None),
    ({"guided_regex": "a+", "min_tokens": 3}, None),
])
def test_refused_forms_are_400(tok, fields, param):
    engine = make_engine(tok)
    app = create_app(engine, tok, model_name=MODEL)
    r = post(app, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert not engine.submitted
