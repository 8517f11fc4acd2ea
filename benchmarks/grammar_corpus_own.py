"""The committed part of the grammar-engine corpus (see ``benchmarks/grammar_corpus.py``):

- ``tools``: function-call parameter schemas as agent frameworks send them (MCP-fetch-style
  ``url`` with ``format: uri`` and exclusive bounds, filesystem, search, shell, calendar, ...),
  and tool lists as the ``tool_choice: "required"`` constraint sees them: one object
  ``{"name": <const>, "arguments": <that tool's parameters>}`` per tool, in an ``anyOf``
  (lists of 4, 20 and 40 tools; 20 x 4 plain parameters);
- ``pydantic``: ``model_json_schema()`` of models written as users write them: nested models,
  discriminated unions (``oneOf`` + ``discriminator``), a recursive ``Tree``, ``Optional``,
  negative and exclusive bounds, free-form ``dict`` fields, enums, constrained strings.
"""
from __future__ import annotations

import copy
import datetime as dt
import enum
from typing import Annotated, Any, Literal, Optional, Union

S = {"type": "string"}
I = {"type": "integer"}
B = {"type": "boolean"}
N = {"type": "number"}


def _obj(props: dict, required: list[str] | None = None, strict: bool = False) -> dict:
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    if strict:
        out["additionalProperties"] = False
    return out


def _d(desc: str, schema: dict) -> dict:
    return {**schema, "description": desc}


TOOLS: dict[str, dict] = {
    # the MCP reference "fetch" server's tool, as it is sent
    "fetch": _obj({
        "url": _d("URL to fetch", {"type": "string", "format": "uri", "minLength": 1}),
        "max_length": _d("Maximum number of characters to return.",
                         {"type": "integer", "default": 5000, "exclusiveMinimum": 0, "exclusiveMaximum": 1000000}),
        "start_index": _d("Start content from this character index", {"type": "integer", "default": 0, "minimum": 0}),
        "raw": _d("Get the actual HTML content without simplification.", {"type": "boolean", "default": False}),
    }, ["url"]),
    "get_weather": _obj({
        "location": _d("City and country, e.g. Paris, France", S),
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    }, ["location"], strict=True),
    "read_file": _obj({"path": _d("Absolute path", {"type": "string", "minLength": 1}),
                       "offset": {"type": "integer", "minimum": 0},
                       "limit": {"type": "integer", "minimum": 1, "maximum": 2000}}, ["path"]),
    "write_file": _obj({"path": S, "content": S, "mode": {"type": "string", "enum": ["overwrite", "append"]}},
                       ["path", "content"], strict=True),
    "edit_file": _obj({
        "path": S,
        "edits": {"type": "array", "minItems": 1, "items": _obj({"oldText": S, "newText": S}, ["oldText", "newText"],
                                                                  strict=True)},
        "dryRun": {"type": "boolean", "default": False},
    }, ["path", "edits"], strict=True),
    "list_directory": _obj({"path": S, "recursive": B, "max_depth": {"type": "integer", "minimum": 1, "maximum": 10},
                            "exclude": {"type": "array", "items": S}}, ["path"]),
    "search_files": _obj({"path": S, "pattern": _d("glob", S),
                          "excludePatterns": {"type": "array", "items": S, "default": []}}, ["path", "pattern"]),
    "grep": _obj({"pattern": _d("regular expression", S), "path": S, "glob": S,
                  "case_insensitive": B, "context_lines": {"type": "integer", "minimum": 0, "maximum": 20},
                  "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]}},
                 ["pattern"]),
    "web_search": _obj({
        "query": {"type": "string", "minLength": 1, "maxLength": 400},
        "num_results": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5},
        "recency_days": {"type": ["integer", "null"], "minimum": 1},
        "site": {"type": "string", "pattern": "^[a-z0-9.-]+\\.[a-z]{2,}$"},
        "safe_search": {"type": "string", "enum": ["off", "moderate", "strict"]},
    }, ["query"]),
    "vector_search": _obj({
        "query": S, "top_k": {"type": "integer", "exclusiveMinimum": 0, "maximum": 100},
        "filter": _d("free-form metadata filter", {"type": "object"}),
        "min_score": {"type": "number", "minimum": -1, "maximum": 1},
    }, ["query"]),
    "run_shell": _obj({"command": S, "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 600000},
                       "cwd": S, "env": {"type": "object", "additionalProperties": {"type": "string"}}},
                      ["command"]),
    "python_exec": _obj({"code": S}, ["code"], strict=True),
    "sql_query": _obj({"sql": S, "params": {"type": "array", "items": {"type": ["string", "number", "boolean", "null"]}},
                       "max_rows": {"type": "integer", "minimum": 1, "maximum": 10000}}, ["sql"]),
    "create_event": _obj({
        "title": {"type": "string", "maxLength": 200},
        "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"},
        "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 50},
        "location": S, "reminder_minutes": {"type": "integer", "minimum": 0, "maximum": 40320},
        "recurrence": {"type": ["string", "null"], "enum": ["daily", "weekly", "monthly", None]},
    }, ["title", "start", "end"], strict=True),
    "send_email": _obj({"to": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1},
                        "cc": {"type": "array", "items": {"type": "string", "format": "email"}},
                        "subject": S, "body": S, "html": B}, ["to", "subject", "body"]),
    "http_request": _obj({
        "method": {"type": "string", "enum": ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"]},
        "url": {"type": "string", "format": "uri"},
        "headers": {"type": "object", "additionalProperties": {"type": "string"}},
        "body": {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}]},
        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 120},
    }, ["method", "url"]),
    "create_issue": _obj({
        "owner": S, "repo": S, "title": S, "body": S,
        "labels": {"type": "array", "items": S, "uniqueItems": True},
        "assignees": {"type": "array", "items": S},
        "milestone": {"type": ["integer", "null"]},
    }, ["owner", "repo", "title"]),
    "get_stock_price": _obj({"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
                             "date": {"type": "string", "format": "date"}}, ["ticker"], strict=True),
    "set_thermostat": _obj({"temperature": {"type": "number", "minimum": -10, "maximum": 35},
                            "mode": {"type": "string", "enum": ["heat", "cool", "auto", "off"]}},
                           ["temperature"], strict=True),
    "transfer_funds": _obj({"from_account": {"type": "string", "pattern": "^[0-9]{8,12}$"},
                            "to_account": {"type": "string", "pattern": "^[0-9]{8,12}$"},
                            "amount": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.01},
                            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
                            "memo": {"type": "string", "maxLength": 140}},
                           ["from_account", "to_account", "amount", "currency"], strict=True),
    "geocode": _obj({"address": S, "bounds": _obj({
        "lat_min": {"type": "number", "minimum": -90, "maximum": 90},
        "lat_max": {"type": "number", "minimum": -90, "maximum": 90},
        "lon_min": {"type": "number", "minimum": -180, "maximum": 180},
        "lon_max": {"type": "number", "minimum": -180, "maximum": 180}})}, ["address"]),
    "translate": _obj({"text": S, "source_lang": {"type": "string", "pattern": "^[a-z]{2}(-[A-Z]{2})?$"},
                       "target_lang": {"type": "string", "pattern": "^[a-z]{2}(-[A-Z]{2})?$"},
                       "formality": {"type": "string", "enum": ["default", "more", "less"]}},
                      ["text", "target_lang"]),
    "browser_action": {"type": "object", "oneOf": [
        _obj({"action": {"const": "click"}, "selector": S}, ["action", "selector"], strict=True),
        _obj({"action": {"const": "type"}, "selector": S, "text": S}, ["action", "selector", "text"], strict=True),
        _obj({"action": {"const": "scroll"}, "dy": {"type": "integer", "minimum": -5000, "maximum": 5000}},
             ["action", "dy"], strict=True),
        _obj({"action": {"const": "navigate"}, "url": {"type": "string", "format": "uri"}}, ["action", "url"],
             strict=True),
    ]},
    "update_memory": _obj({"key": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,63}$"},
                           "value": _d("any JSON value", {}), "ttl_s": {"type": ["integer", "null"], "minimum": 1}},
                          ["key", "value"]),
    "kubectl_apply": _obj({"manifest": {"type": "object", "required": ["apiVersion", "kind", "metadata"],
                                        "properties": {"apiVersion": S, "kind": S,
                                                       "metadata": {"type": "object", "required": ["name"]}}},
                           "namespace": S, "dry_run": B}, ["manifest"]),
    "no_arguments": {"type": "object", "properties": {}},
}

# plain 4-parameter tools for the 20 x 4 list
_PLAIN = {f"tool_{i:02d}": _obj({"a": S, "b": I, "c": B, "d": N}, ["a", "b"]) for i in range(20)}


def tool_choice_required(tools: dict[str, dict]) -> dict:
    """The constraint ``tool_choice: "required"`` puts on a call: one of the tools, by name, with
    that tool's arguments."""
    return {"anyOf": [_obj({"name": {"const": name}, "arguments": copy.deepcopy(params)},
                           ["name", "arguments"], strict=True)
                      for name, params in tools.items()]}


def _forty_tools() -> dict[str, dict]:
    out = dict(TOOLS)
    i = 0
    while len(out) < 40:
        base = list(TOOLS.items())[i % len(TOOLS)]
        out[f"{base[0]}_v{i // len(TOOLS) + 2}"] = base[1]
        i += 1
    return out


def tool_schemas() -> list[dict]:
    items = [{"id": f"tools/{name}", "collection": "tools", "schema": schema} for name, schema in TOOLS.items()]
    items.append({"id": "tools/list-4", "collection": "tools",
                  "schema": tool_choice_required({k: TOOLS[k] for k in ("fetch", "get_weather", "read_file",
                                                                          "web_search")})})
    items.append({"id": "tools/list-20x4-plain", "collection": "tools", "schema": tool_choice_required(_PLAIN)})
    items.append({"id": "tools/list-40", "collection": "tools", "schema": tool_choice_required(_forty_tools())})
    return items


def pydantic_schemas() -> list[dict]:
    from pydantic import BaseModel, Field, RootModel

    class Address(BaseModel):
        street: str
        city: str
        postal_code: Annotated[str, Field(pattern=r"^[0-9]{5}(-[0-9]{4})?$")]
        country: Annotated[str, Field(min_length=2, max_length=2)] = "US"

    class Person(BaseModel):
        name: str
        age: Annotated[int, Field(ge=0, lt=150)]
        email: Optional[str] = None
        addresses: list[Address] = []
        tags: set[str] = set()

    class Color(str, enum.Enum):
        red = "red"
        green = "green"
        blue = "blue"

    class Cat(BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        pet_type: Literal["dog"]
        barks: float
        good_boy: bool = True

    class Lizard(BaseModel):
        pet_type: Literal["lizard"]
        scales: bool

    class Owner(BaseModel):
        pet: Annotated[Union[Cat, Dog, Lizard], Field(discriminator="pet_type")]
        favourite_color: Color
        n: int

    class Tree(BaseModel):
        value: int
        children: list["Tree"] = []

    class Node(BaseModel):
        name: str
        left: Optional["Node"] = None
        right: Optional["Node"] = None

    class Reading(BaseModel):
        temperature_c: Annotated[float, Field(ge=-273.15, le=1000)]
        delta: Annotated[int, Field(gt=-100, lt=100)]
        offset: Annotated[float, Field(le=-1.5)]
        ratio: Annotated[float, Field(gt=0, lt=1)]
        measured_at: dt.datetime

    class Event(BaseModel):
        kind: Literal["create", "update", "delete"]
        payload: dict[str, Any]
        metadata: dict[str, str] = {}
        extra: Optional[dict] = None

    class LineItem(BaseModel):
        sku: Annotated[str, Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")]
        quantity: Annotated[int, Field(ge=1, le=999)]
        unit_price: Annotated[float, Field(gt=0)]

    class Invoice(BaseModel):
        invoice_id: str
        customer: Person
        items: Annotated[list[LineItem], Field(min_length=1, max_length=50)]
        discount: Optional[Annotated[float, Field(ge=0, le=1)]] = None
        status: Literal["draft", "sent", "paid"] = "draft"
        notes: Optional[str] = None

    class Step(BaseModel):
        explanation: str
        output: str

    class MathReasoning(BaseModel):
        steps: list[Step]
        final_answer: str

    class Entity(BaseModel):
        text: str
        label: Literal["PERSON", "ORG", "LOC", "DATE", "MISC"]
        start: Annotated[int, Field(ge=0)]
        end: Annotated[int, Field(ge=0)]

    class Extraction(BaseModel):
        entities: list[Entity]
        sentiment: Annotated[float, Field(ge=-1, le=1)]
        language: Annotated[str, Field(min_length=2, max_length=5)]

    class Search(BaseModel):
        kind: Literal["search"] = "search"
        query: str

    class Answer(BaseModel):
        kind: Literal["answer"] = "answer"
        text: str
        confidence: Annotated[float, Field(ge=0, le=1)]

    class AgentStep(BaseModel):
        thought: str
        action: Annotated[Union[Search, Answer], Field(discriminator="kind")]

    class Expr(BaseModel):
        op: Literal["+", "-", "*", "/"]
        args: list[Union[int, float, "Expr"]]

    class FileSystemEntry(BaseModel):
        name: str
        size: Annotated[int, Field(ge=0)] = 0
        children: Optional[list["FileSystemEntry"]] = None

    class Config(BaseModel):
        model: str
        temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
        max_tokens: Optional[Annotated[int, Field(gt=0, le=32768)]] = None
        stop: Optional[Union[str, list[str]]] = None
        logit_bias: dict[str, Annotated[int, Field(ge=-100, le=100)]] = {}
        tools: list[dict[str, Any]] = []

    class Table(BaseModel):
        columns: Annotated[list[str], Field(min_length=1)]
        rows: list[list[Union[str, int, float, bool, None]]]

    class UnionNoDiscriminator(BaseModel):
        value: Union[int, str, list[int], Address]

    models = [Person, Owner, Tree, Node, Reading, Event, Invoice, MathReasoning, Extraction, AgentStep, Expr,
              FileSystemEntry, Config, Table, UnionNoDiscriminator, Address]
    items = [{"id": f"pydantic/{m.__name__}", "collection": "pydantic", "schema": m.model_json_schema()}
             for m in models]
    items.append({"id": "pydantic/list-Person", "collection": "pydantic",
                  "schema": RootModel[list[Person]].model_json_schema()})
    return items


def own_schemas() -> list[dict]:
    return tool_schemas() + pydantic_schemas()
