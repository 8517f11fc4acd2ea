"""Forced tool choices against a real engine (the tiny random model, byte tokenizer): the
grammar makes even a random model answer ``required`` with calls of the offered tools whose
arguments validate against their schemas, and a named choice with valid arguments; through
the HTTP app and the ring, greedy and sampled, streaming and not; and the openai SDK's
``.parse(response_format=PydanticModel)`` answered with an instance of the model."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib adds no test dir
from dpu_helpers import ring_frontend  # noqa: E402
from test_engine import make_llm, tiny_model_dir  # noqa: E402


EOS = 0  # NUL: never in JSON text
# short (the tiny model has 256 positions); forced choices do not need the tools rendered
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                  "maximum": 23},
                                         "label": {"enum": ["work", "gym"]}},
        "required": ["hour", "label"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: Any) -> Any:
    with make_llm(tiny_model_dir(tmp_path_factory.mktemp("tool_models"), eos_token_id=EOS),
                  ) as engine:
        engine.tokenizer.chat_template = TEMPLATE
        yield engine


def _chat(llm: Any, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        async with ring_frontend(llm) as app:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t", timeout=120) as http:
                return [await http.post("/v1/chat/completions", json={
                    "messages": ASK, "tools": TOOLS, "max_tokens": 200, **b}) for b in bodies]

    return asyncio.run(main())


def _calls_of(body: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in body["message"]["tool_calls"]]


def test_required_is_enforced(llm: Any) -> None:
    bodies = [{"tool_choice": "required", "temperature": 0.0},
              {"tool_choice": "required", "temperature": 1.0, "seed": 3, "n": 2}]
    for greedy, r in zip((True, False), _chat(llm, bodies)):
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            # The random model may keep adding calls to the array until max_tokens when it
            # samples (the grammar allows any number); greedy, it closes the array.
            assert choice["finish_reason"] in (("tool_calls",) if greedy else
                                               ("tool_calls", "length")), choice
            calls = _calls_of(choice)
            assert calls
            if choice["finish_reason"] == "tool_calls":
                assert choice["message"]["content"] is None
            for name, args in calls:
                jsonschema.validate(args, SCHEMAS[name])


def test_named_is_enforced_streaming_too(llm: Any) -> None:
    named = {"type": "function", "function": {"name": "set_alarm"}}
    whole, streamed = _chat(llm, [{"tool_choice": named, "temperature": 1.0, "seed": 7},
                                  {"tool_choice": named, "temperature": 1.0, "seed": 7,
                                   "stream": True}])
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    ((name, args),) = _calls_of(choice)
    assert name == "set_alarm"
    jsonschema.validate(args, SCHEMAS["set_alarm"])
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    deltas = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "set_alarm"
    # same seed, same tokens: the streamed fragments add up to the whole answer's arguments
    assert "".join(d["function"].get("arguments", "") for d in deltas) == \
        choice["message"]["tool_calls"][0]["function"]["arguments"]


def test_openai_parse_with_a_pydantic_response_format(llm: Any) -> None:
    """``client.chat.completions.parse(response_format=Model)`` (strict json_schema from
    pydantic): the grammar makes even the random model's answer parse into the model."""
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class Forecast(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)
        days: int = pydantic.Field(ge=1, le=7)
        sunny: bool

    async def main() -> list[Any]:
        async with ring_frontend(llm) as app:
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120)
            sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http,
                                     max_retries=0)
            return [await sdk.chat.completions.parse(
                model="tiny", messages=ASK, response_format=Forecast, max_tokens=120, **kw)
                for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 4, "n": 2})]

    parsed = 0
    for completion in asyncio.run(main()):
        for choice in completion.choices:
            if choice.finish_reason == "stop":
                parsed += 1
                assert isinstance(choice.message.parsed, Forecast), choice.message.content
    assert parsed >= 1
