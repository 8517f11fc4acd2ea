"""A structured-output constraint -> the llguidance grammar that enforces it.

llguidance (a lazy lexer and an Earley parser; docs/architecture.md, "Structured outputs",
says why this engine) takes JSON schemas, regexes, Lark grammars (with ``%json {...}``
sub-grammars) and GBNF. What is decided here:

- JSON schemas: laid out as Python's ``json.dumps`` does (:data:`DEFAULT_JSON_LAYOUT`:
  ``", "``, ``": "``, no other whitespace, so a model cannot loop on whitespace) unless
  ``disable_any_whitespace`` (none at all) or ``whitespace_pattern`` (that regex, repeatable,
  between tokens) is asked for.
  An object schema that lists ``properties`` and says nothing of other properties (no
  ``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``, not combined
  by ``allOf`` / ``$ref``, every ``required`` name among its ``properties``) gets no others, as vLLM's default backend (xgrammar's strict
  mode) and OpenAI's strict schemas do: every output is still valid against the schema, and
  small models stop padding objects with invented keys. An object without ``properties``
  (a free-form parameter) stays open. A ``oneOf`` whose branches are provably disjoint
  (different types, or a required discriminator property with different ``const`` /
  ``enum`` values: pydantic's discriminated unions) is enforced as the equal ``anyOf``;
  others go to llguidance, which enforces what it can prove and refuses the rest by name.
  Keywords llguidance cannot enforce are refused by name (its own check); ``format`` values
  it does not know (``uri-reference``, ``idn-email``, ...) are annotations (JSON Schema
  2020-12: ``format`` asserts nothing unless a vocabulary says so) and are dropped, listed in
  :data:`LENIENT_FORMATS_NOTE`; the formats it knows (``date-time``, ``date``, ``time``,
  ``duration``, ``email``, ``hostname``, ``ipv4``, ``ipv6``, ``uri``, ``uuid``) are enforced.
- ``choice``: a Lark alternation of the JSON-escaped strings.
- ``grammar``: a Lark grammar as llguidance reads it, or GBNF / EBNF (llama.cpp's), converted.
- ``structural_tag``: vLLM's ``{"structures": [{"begin", "schema", "end"}], "triggers"}``:
  free text in which each structure, once its trigger appears, is its schema between begin
  and end.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from blink.shared.structured_outputs import StructuredOutputs, StructuredOutputsError

#: The ``format`` values llguidance enforces; others are dropped as annotations.
ENFORCED_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname",
                              "ipv4", "ipv6", "uri", "uuid"})
LENIENT_FORMATS_NOTE = ("format values other than " + ", ".join(sorted(ENFORCED_FORMATS))
                        + " are annotations: not enforced")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint as llguidance takes it.

    text: the llguidance grammar (its JSON form), what a matcher is built from
    key:  SHA-256 of ``text``: equal keys, equal grammars (the compile cache's key)
    kind: what was asked for, for messages (``json``, ``regex``, ``choice``, ...)
    """

    text: str
    key: str
    kind: str

    @classmethod
    def of(cls, text: str, kind: str) -> "GrammarSpec":
        return cls(text, hashlib.sha256(text.encode()).hexdigest(), kind)


def _llg():
    import llguidance  # torch-free; imported on first use

    return llguidance


#: Keywords whose value is one subschema, a map of name -> subschema, a list of subschemas.
_SCHEMA_ONE = frozenset({"items", "additionalItems", "contains", "not", "if", "then", "else",
                         "additionalProperties", "propertyNames", "unevaluatedItems",
                         "unevaluatedProperties"})
_SCHEMA_MAP = frozenset({"properties", "patternProperties", "definitions", "$defs",
                         "dependentSchemas"})
_SCHEMA_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf",
              "$ref")


def _values(schema: Any) -> list | None:
    """The JSON values a (sub)schema allows when it lists them (``const`` / ``enum``)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    return list(schema["enum"]) if isinstance(schema.get("enum"), list) else None


def _disjoint(branches: list) -> bool:
    """Whether no JSON value satisfies two of ``branches`` (a sufficient test)."""
    if not all(isinstance(b, dict) for b in branches) or len(branches) < 2:
        return False
    types = [b.get("type") for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) \
            and not {"integer", "number"} <= set(types):
        return True
    names = set.intersection(*(set(b.get("required") or []) for b in branches))
    for name in sorted(names):
        seen: list = []
        for b in branches:
            vals = _values((b.get("properties") or {}).get(name))
            if vals is None:
                break
            keys = [json.dumps(v, sort_keys=True) for v in vals]
            if any(k in seen for k in keys):
                break
            seen += keys
        else:
            return True
    return False


def _rewrite(schema: Any, close: bool, in_all_of: bool = False) -> Any:
    """A copy of ``schema`` with unenforced ``format`` values dropped and (``close``)
    closed objects (see the module docstring), walking subschemas only."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "format" and isinstance(value, str) and value not in ENFORCED_FORMATS:
            continue
        if key in _SCHEMA_MAP and isinstance(value, dict):
            value = {k: _rewrite(v, close) for k, v in value.items()}
        elif key in _SCHEMA_LIST and isinstance(value, list):
            value = [_rewrite(v, close, key == "allOf") for v in value]
        elif key in _SCHEMA_ONE:
            value = _rewrite(value, close)
        if key == "oneOf" and isinstance(value, list) and "anyOf" not in schema \
                and _disjoint(value):
            key = "anyOf"  # the same language when no value can match two branches
        out[key] = value
    props = out.get("properties")
    required = out.get("required") if isinstance(out.get("required"), list) else []
    if close and not in_all_of and isinstance(props, dict) \
            and not any(k in out for k in _OPEN_KEYS) and all(r in props for r in required):
        out["additionalProperties"] = False
    return out


def drop_unenforced_formats(schema: Any) -> Any:
    """A copy of ``schema`` without the ``format`` keywords llguidance does not enforce."""
    return _rewrite(schema, close=False)


def served_schema(schema: Any) -> Any:
    """The schema as it is enforced: unenforced formats dropped, listed objects closed."""
    return _rewrite(schema, close=True)


#: The JSON layout by default: Python's ``json.dumps`` (``", "`` and ``": "``, no other
#: whitespace). llguidance's whitespace is a skipped lexeme that may repeat, so any
#: flexible default lets a small model loop on whitespace until max_tokens.
DEFAULT_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ",
                       "key_separator": ": "}


def json_options(so: StructuredOutputs) -> dict[str, Any]:
    """llguidance's JSON compile options for ``so``'s whitespace fields."""
    if so.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    if so.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": so.whitespace_pattern}
    return dict(DEFAULT_JSON_LAYOUT)


def json_schema_grammar(schema: Any, options: dict[str, Any] | None = None) -> str:
    """The llguidance grammar text of a JSON schema (dict or bool)."""
    llg = _llg()
    if schema is True:
        schema = {}
    if schema is False:
        raise StructuredOutputsError("the json schema is `false`: no output can satisfy it")
    try:
        return llg.LLMatcher.grammar_from_json_schema(served_schema(schema),
                                                      defaults=options or {})
    except (ValueError, TypeError) as exc:
        raise StructuredOutputsError(f"json schema: {exc}") from None


def lark_literal(text: str) -> str:
    """A Lark string literal matching ``text`` exactly."""
    return json.dumps(text, ensure_ascii=False)


def grammar_spec(so: StructuredOutputs) -> GrammarSpec:
    """The llguidance grammar of a constraint. Raises :class:`StructuredOutputsError` for
    text that cannot even be converted (an invalid GBNF, a non-object schema); whether the
    grammar compiles is checked by :mod:`.workers`."""
    llg = _llg()
    kind = so.kind
    if kind == "json":
        text = json_schema_grammar(so.schema_dict(), json_options(so))
    elif kind == "json_object":
        text = json_schema_grammar({"type": "object"}, json_options(so))
    elif kind == "regex":
        text = llg.LLMatcher.grammar_from_regex(so.regex)
    elif kind == "choice":
        text = llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(lark_literal(c) for c in so.choice))
    elif kind == "grammar":
        try:
            text = llg.grammar_from("grammar", so.grammar)
        except ValueError as exc:
            raise StructuredOutputsError(f"grammar: {exc}") from None
    elif kind == "structural_tag":
        text = structural_tag_grammar(so.structural_tag)
    else:  # pragma: no cover - StructuredOutputs.validate admits no other kind
        raise StructuredOutputsError(f"unknown constraint kind {kind!r}")
    return GrammarSpec.of(text, kind)


def structural_tag_grammar(tag: dict[str, Any]) -> str:
    """vLLM's ``structural_tag`` (``{"type": "structural_tag", "structures": [{"begin",
    "schema", "end"}], "triggers": [...]}``) as an llguidance grammar: free text where a
    structure starts at its trigger and is its schema between ``begin`` and ``end``."""
    llg = _llg()
    structures = tag.get("structures")
    triggers = tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise StructuredOutputsError("structural_tag.structures must be a non-empty list")
    if not isinstance(triggers, list) or not triggers or not all(
            isinstance(t, str) and t for t in triggers):
        raise StructuredOutputsError("structural_tag.triggers must be a non-empty list of strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) \
                or not isinstance(s.get("end"), str) or "schema" not in s:
            raise StructuredOutputsError(
                f"structural_tag.structures[{i}] needs string 'begin' and 'end' and a 'schema'")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise StructuredOutputsError(
                f"structural_tag.structures[{i}].begin {s['begin']!r} starts with none of "
                "the triggers")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"],
                                  grammar=served_schema(s["schema"]), end=s["end"]))
    return llg.LLMatcher.grammar_from_lark(llg.StructTag.to_grammar(tags, assume_special=False))
