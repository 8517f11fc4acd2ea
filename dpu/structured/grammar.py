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
  by ``allOf`` / ``$ref``, not an ``anyOf`` / ``oneOf`` branch beside its parent's own
  properties nor a definition referenced from such places, every ``required`` name among
  its ``properties``) gets no others, as vLLM's default backend (xgrammar's strict
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
  ``dependencies`` / ``dependentRequired`` that only list property names are enforced as the
  equal ``anyOf`` (``a`` absent, i.e. ``{"properties": {"a": false}}``, or everything it
  needs ``required``).
- JSON schemas llguidance refuses *only* for keywords it does not implement
  (:data:`UNENFORCED_KEYWORDS`: ``uniqueItems``, ``not``, ``if``/``then``/``else``,
  ``contains``, ``propertyNames``, schema ``dependencies``, ...; a ``oneOf`` it cannot prove
  disjoint; ``min/maxProperties`` beside optional properties; :func:`keyword_refusal` tells
  such a refusal from a real error) get a second grammar, :attr:`GrammarSpec.fallback`:
  llguidance's ``lenient`` mode, which ignores those keywords (a superset of the schema's
  language, everything else still enforced). A constraint served with it carries a
  :class:`FinalCheck`: an output that finishes ``stop`` is validated against the original
  schema (``jsonschema``, in a worker process) and fails the choice if it does not satisfy
  it (docs/architecture.md, "Structured outputs").
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
class FinalCheck:
    """What a constraint served by its lenient grammar checks after generation.

    schema_json: the original JSON schema (its JSON text), which a finished output must satisfy
    keywords:    the keywords the grammar does not enforce (for messages), sorted
    """

    schema_json: str
    keywords: tuple[str, ...]


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint as llguidance takes it.

    text: the llguidance grammar (its JSON form), what a matcher is built from
    key:  SHA-256 of ``text``: equal keys, equal grammars (the compile cache's key)
    kind: what was asked for, for messages (``json``, ``regex``, ``choice``, ...)
    fallback: (JSON schemas) the lenient grammar, used only if llguidance refuses ``text``
          for keywords it does not implement (:func:`keyword_refusal`); its outputs then
          pass ``final_check``
    final_check: what an output of ``fallback`` is validated against
    lenient_first: the schema has keywords llguidance may refuse (``final_check.keywords``):
          ``fallback`` is tried alone (where ``text`` would compile, ``fallback`` is the same
          grammar: lenient mode only ignores what strict mode refuses), one build not two
    """

    text: str
    key: str
    kind: str
    fallback: str | None = None
    final_check: FinalCheck | None = None
    lenient_first: bool = False

    @classmethod
    def of(cls, text: str, kind: str, fallback: str | None = None,
           final_check: FinalCheck | None = None, lenient_first: bool = False) -> "GrammarSpec":
        return cls(text, hashlib.sha256(text.encode()).hexdigest(), kind, fallback, final_check,
                   lenient_first)


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


def _resolve(branch: Any, root: Any, hops: int = 8) -> Any:
    """``branch`` with a lone local ``$ref`` (``#/$defs/...``, ``#/definitions/...``)
    followed (at most ``hops`` times); anything else as it is."""
    while hops and isinstance(branch, dict) and set(branch) == {"$ref"} \
            and isinstance(branch["$ref"], str) and branch["$ref"].startswith("#/"):
        node = root
        for part in branch["$ref"][2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return branch
            node = node[part]
        branch, hops = node, hops - 1
    return branch


def _types(branch: Any) -> frozenset | None:
    """The JSON types a branch's ``type`` allows (``integer`` counted as a ``number``), or
    None when it does not say."""
    t = branch.get("type") if isinstance(branch, dict) else None
    types = [t] if isinstance(t, str) else t
    if not isinstance(types, list) or not types or not all(isinstance(x, str) for x in types):
        return None
    return frozenset("number" if x == "integer" else x for x in types)


def _disjoint(branches: list, root: Any = None) -> bool:
    """Whether no JSON value satisfies two of ``branches`` (a sufficient test): their
    ``type``s share nothing (a lone local ``$ref`` is followed), or a property all of them
    require has different ``const`` / ``enum`` values in each."""
    if not all(isinstance(b, dict) for b in branches) or len(branches) < 2:
        return False
    types = [_types(_resolve(b, root)) for b in branches]
    if all(t is not None for t in types) \
            and sum(len(t) for t in types) == len(frozenset().union(*types)):
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


def _dependencies_any_of(deps: Any) -> list | None:
    """``dependencies`` / ``dependentRequired`` as ``anyOf`` lists (one per property: the
    property absent, or it and what it needs all present), when every value lists property
    names; None otherwise (schema dependencies are not rewritten)."""
    if not isinstance(deps, dict) or not deps:
        return None
    if not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in deps.values()):
        return None
    return [[{"properties": {name: False}},
             {"required": [name, *[n for n in needs if n != name]]}]
            for name, needs in deps.items() if needs]


def _rewrite(schema: Any, close: bool, in_all_of: bool = False, root: Any = None,
             shared: frozenset = frozenset()) -> Any:
    """A copy of ``schema`` with unenforced ``format`` values dropped, name-list
    ``dependencies`` as ``anyOf`` and (``close``) closed objects (see the module docstring),
    walking subschemas only."""
    if not isinstance(schema, dict):
        return schema
    dep_names = _dependency_names(schema)
    # anyOf / oneOf branches are intersected with an object schema beside them: closing a
    # branch would forbid the parent's own properties (as for allOf)
    beside = any(k in schema for k in ("properties", "patternProperties", "required",
                                       "additionalProperties"))
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "format" and isinstance(value, str) and value not in ENFORCED_FORMATS:
            continue
        # below an intersected schema, its properties and items meet the other side's too
        inner = in_all_of and key in _INTERSECTED_CHILDREN
        if key in _SCHEMA_MAP and isinstance(value, dict):
            value = {k: _rewrite(v, close, inner or f"#/{key}/{k}" in shared, root, shared)
                     for k, v in value.items()}
        elif key in _SCHEMA_LIST and isinstance(value, list):
            intersected = inner or key == "allOf" or (beside and key in ("anyOf", "oneOf"))
            value = [_rewrite(v, close, intersected, root, shared) for v in value]
        elif key in _SCHEMA_ONE:
            value = _rewrite(value, close, inner, root=root, shared=shared)
        if key == "oneOf" and isinstance(value, list) and "anyOf" not in schema \
                and _disjoint(value, root):
            key = "anyOf"  # the same language when no value can match two branches
        out[key] = value
    props = out.get("properties")
    required = out.get("required") if isinstance(out.get("required"), list) else []
    if close and not in_all_of and isinstance(props, dict) \
            and not any(k in out for k in _OPEN_KEYS) \
            and all(r in props for r in [*required, *dep_names]):
        out["additionalProperties"] = False
    return _with_dependencies_rewritten(out)  # after: its branches are not closed


def _dependency_names(schema: dict) -> list:
    """The property names ``dependencies`` / ``dependentRequired`` mention (an object that
    lists ``properties`` is closed only if these are among them)."""
    names: list = []
    for k in ("dependencies", "dependentRequired"):
        deps = schema.get(k)
        if isinstance(deps, dict):
            for name, needs in deps.items():
                names.append(name)
                if isinstance(needs, list):
                    names += needs
    return names


def _with_dependencies_rewritten(schema: dict) -> dict:
    """``schema`` with property-name ``dependencies`` / ``dependentRequired`` turned into the
    equal ``anyOf`` (``name`` absent, or ``name`` and the names it needs present): one
    dependency joins the schema's own ``anyOf`` slot when that is free, more go into an
    ``allOf`` (llguidance intersects siblings). Unchanged when anything else is there."""
    keys = [k for k in ("dependencies", "dependentRequired") if k in schema]
    if not keys or "allOf" in schema:
        return schema
    groups: list = []
    for k in keys:
        got = _dependencies_any_of(schema[k])
        if got is None:
            return schema
        groups += got
    out = {k: v for k, v in schema.items() if k not in keys}
    if not groups:
        return out
    if len(groups) == 1 and "anyOf" not in out and "oneOf" not in out:
        out["anyOf"] = groups[0]
    else:
        out["allOf"] = [{"anyOf": g} for g in groups]
    return out


#: Keywords whose subschemas meet the other side's when their schema is intersected.
_INTERSECTED_CHILDREN = frozenset({"properties", "patternProperties", "additionalProperties",
                                   "items", "prefixItems", "anyOf", "oneOf"})


def _refs_in(node: Any) -> set[str]:
    out: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if isinstance(n.get("$ref"), str):
                out.add(n["$ref"])
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return out


def _intersected_refs(schema: Any) -> frozenset:
    """The local references (``#/$defs/X``, ``#/definitions/X``) whose schema may be
    intersected with another: used anywhere inside an ``allOf`` branch, an ``anyOf`` /
    ``oneOf`` branch beside the parent's own properties or a ``$ref`` with sibling keys, and
    what those definitions reference in turn. Such definitions are not closed (closing one
    would forbid what the schemas beside it add); a conservative over-approximation."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("$ref"), str) and len(node) > 1:
            found |= _refs_in(node)
        beside = any(k in node for k in ("properties", "patternProperties", "required",
                                         "additionalProperties"))
        for key in ("allOf", "anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and (key == "allOf" or beside):
                found |= _refs_in(branches)
        stack.extend(node.values())
    todo = list(found)
    while todo:  # what an intersected definition references is intersected too
        target = _resolve({"$ref": todo.pop()}, schema, hops=1)
        if isinstance(target, dict) and set(target) != {"$ref"}:
            for ref in _refs_in(target) - found:
                found.add(ref)
                todo.append(ref)
    return frozenset(found)


def _ref_root(schema: Any) -> Any:
    """The document ``#/...`` references resolve in, for the disjoint test; None (follow no
    reference) when a nested ``$id`` / ``id`` could move a reference's base."""
    stack = [schema]
    first = True
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if not first and any(isinstance(node.get(k), str) for k in ("$id", "id")):
                return None
            first = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def drop_unenforced_formats(schema: Any) -> Any:
    """A copy of ``schema`` without the ``format`` keywords llguidance does not enforce."""
    return _rewrite(schema, close=False, root=_ref_root(schema))


def served_schema(schema: Any) -> Any:
    """The schema as it is enforced: unenforced formats dropped, listed objects closed."""
    return _rewrite(schema, close=True, root=_ref_root(schema),
                    shared=_intersected_refs(schema))


#: JSON Schema keywords llguidance does not implement (its strict mode refuses them as
#: "Unimplemented keys"; its lenient mode ignores them): enforced only by the final check.
UNENFORCED_KEYWORDS = frozenset({
    "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
    "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
    "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$dynamicAnchor",
    "$recursiveRef", "$recursiveAnchor"})
#: llguidance's refusals that name a keyword it cannot enforce (not an error in the schema):
#: such a schema is served by its lenient grammar plus the final check.
_KEYWORD_REFUSALS = ("Unimplemented keys:", "oneOf constraints are not supported",
                     "min/maxProperties only supported when")


def keyword_refusal(error: str) -> bool:
    """Whether llguidance's strict ``error`` is only about keywords it does not implement (a
    ``oneOf`` it cannot prove disjoint, ``min/maxProperties`` beside optional properties),
    so the lenient grammar plus the final check may serve the schema. Real errors (an
    invalid or look-around regex, an unsatisfiable schema, a remote ``$ref``) are not."""
    return any(marker in error for marker in _KEYWORD_REFUSALS)


def unenforced_keywords(schema: Any, error: str = "", served: Any = None) -> tuple[str, ...]:
    """The keywords of ``schema`` (as served: ``served`` if given) that its lenient grammar
    may not enforce, sorted: those of :data:`UNENFORCED_KEYWORDS` in schema positions,
    ``oneOf`` if one is left after the disjoint rewrite, ``minProperties`` /
    ``maxProperties`` when llguidance said so, and any key its strict ``error`` names."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            if key in UNENFORCED_KEYWORDS or key == "oneOf":
                found.add(key)
            if (key in _SCHEMA_MAP or key == "dependencies") and isinstance(value, dict):
                for sub in value.values():
                    walk(sub)
            elif key in _SCHEMA_LIST or key in _SCHEMA_ONE:
                walk(value)

    walk(served_schema(schema) if served is None else served)
    if "min/maxProperties" in error:
        found |= {"minProperties", "maxProperties"}
    if "Unimplemented keys:" in error:
        try:
            found |= {k for k in json.loads(error.split("Unimplemented keys:", 1)[1].strip()
                                            .split("]", 1)[0] + "]") if isinstance(k, str)}
        except ValueError:
            pass
    return tuple(sorted(found))


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


def json_schema_grammar(schema: Any, options: dict[str, Any] | None = None,
                        lenient: bool = False, served: Any = None) -> str:
    """The llguidance grammar text of a JSON schema (dict or bool); ``lenient``: with
    llguidance's ``lenient`` option (keywords it does not implement are ignored: a superset
    of the schema's language, served only with the final check). ``served``: the schema's
    :func:`served_schema`, when the caller has it."""
    llg = _llg()
    if schema is True:
        schema = {}
    if schema is False:
        raise StructuredOutputsError("the json schema is `false`: no output can satisfy it")
    if served is None:
        served = served_schema(schema)
    # As overrides: a schema's own "x-guidance" cannot turn lenient mode on (or change the
    # layout) behind the final check's back.
    options = {**(options or {}), "lenient": lenient, "coerce_one_of": False}
    try:
        return llg.LLMatcher.grammar_from_json_schema(served, overrides=options)
    except (ValueError, TypeError) as exc:
        raise StructuredOutputsError(f"json schema: {exc}") from None


def json_spec(schema: Any, options: dict[str, Any], kind: str = "json") -> GrammarSpec:
    """A JSON schema's :class:`GrammarSpec`: its strict grammar, and the lenient one with
    the final check to fall back on (see the module docstring)."""
    if not isinstance(schema, dict):
        return GrammarSpec.of(json_schema_grammar(schema, options), kind)
    served = served_schema(schema)
    text = json_schema_grammar(schema, options, served=served)
    fallback = json_schema_grammar(schema, options, lenient=True, served=served)
    keywords = unenforced_keywords(schema, served=served)
    check = FinalCheck(json.dumps(schema, ensure_ascii=False), keywords)
    # Keywords llguidance may refuse are in it: try the lenient grammar first (where the
    # strict one compiles, the lenient one is the same grammar), saving a second build.
    return GrammarSpec.of(text, kind, fallback, check, lenient_first=bool(keywords))


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
        return json_spec(so.schema_dict(), json_options(so))
    if kind == "json_object":
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
