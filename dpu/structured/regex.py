"""A structured-output constraint as one regular expression (outlines-core's regex syntax).

- ``json``: outlines-core's ``build_regex_from_schema`` after :func:`check_schema` walked the
  schema: keywords it would silently ignore are refused here (400 naming the keyword), and
  numeric bounds, which it ignores, are compiled by :func:`int_range_regex` into the regex
  (the bounded subschema is swapped for a placeholder constant first, then the constant's
  text in the regex is replaced by the range).
- ``regex``: as given. ``choice``: the escaped alternatives. ``json_object``: any JSON object,
  objects and arrays nested at most :data:`JSON_OBJECT_DEPTH` deep (the top object counts
  as one level: its values may be objects or arrays of scalars). Each level multiplies the
  automaton: with SmolLM2's vocabulary depth 2 is ~400 states / 0.8M transitions / ~9 MiB,
  compiled in ~0.5 s; depth 3 is ~1600 states / 3.3M transitions / ~10 s. outlines-core's own
  ``{"type": "object"}`` is the depth-3 size, so the regex is built here.

JSON whitespace is outlines-core's default: at most one space where JSON allows whitespace, so
a model can never loop on blanks.
"""
from __future__ import annotations

import copy
import json
import math
from typing import Any

from blink.shared.structured_outputs import StructuredOutputs, StructuredOutputsError

#: Depth of nested objects/arrays a ``json_object`` allows (see the module docstring).
JSON_OBJECT_DEPTH = 2
#: outlines-core's $ref recursion depth for schemas.
SCHEMA_RECURSION_DEPTH = 3

_WS = r"[ ]?"
_STRING = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"'
_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_SCALAR = f"({_STRING}|{_NUMBER}|true|false|null)"


def _object_of(value: str) -> str:
    member = f"{_STRING}{_WS}:{_WS}{value}"
    return rf"\{{{_WS}({member}({_WS},{_WS}{member})*)?{_WS}\}}"


def _array_of(value: str) -> str:
    return rf"\[{_WS}({value}({_WS},{_WS}{value})*)?{_WS}\]"


def json_object_regex(depth: int = JSON_OBJECT_DEPTH) -> str:
    """Any JSON object with objects/arrays nested at most ``depth`` levels (the top one included)."""
    value = _SCALAR
    for _ in range(depth - 1):
        value = f"({_SCALAR}|{_object_of(value)}|{_array_of(value)})"
    return _object_of(value)

# Keywords that only annotate (no effect on which values are valid).
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                "deprecated", "readOnly", "writeOnly", "strict", "discriminator", "nullable"}
# Keywords outlines-core turns into the regex.
_HONOURED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
             "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
             "minLength", "maxLength", "pattern", "format"}
# Keywords handled here (numeric bounds).
_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_FORMATS = {"date-time", "date", "time", "uuid", "email", "uri"}
_PLACEHOLDER = "BLINKRANGE{}Q7F3A"


def escape_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (only regex metacharacters are escaped)."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)


def choice_regex(choices: tuple[str, ...]) -> str:
    return "(" + "|".join(escape_literal(c) for c in choices) + ")"


def _same_length_range(lo: str, hi: str) -> str:
    """Digit strings of len(lo) == len(hi) between lo and hi (leading zeros allowed)."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    if lo[0] == hi[0]:
        return lo[0] + "(?:" + _same_length_range(lo[1:], hi[1:]) + ")"
    n = len(lo) - 1
    parts = [lo[0] + "(?:" + _same_length_range(lo[1:], "9" * n) + ")"]
    if int(lo[0]) + 1 <= int(hi[0]) - 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{n}}}")
    parts.append(hi[0] + "(?:" + _same_length_range("0" * n, hi[1:]) + ")")
    return "|".join(parts)


def _natural_range(lo: int, hi: int | None) -> str:
    """Canonical decimals (no leading zero) of the integers in [lo, hi], 0 <= lo; hi None = no
    upper bound."""
    parts = []
    digits = len(str(lo))
    top = hi if hi is not None else 10**digits - 1
    while lo <= top:
        end = min(top, 10 ** len(str(lo)) - 1)
        parts.append(_same_length_range(str(lo), str(end)))
        lo = end + 1
    if hi is None:
        parts.append(f"[1-9][0-9]{{{digits},}}")
    return "(?:" + "|".join(f"(?:{p})" for p in parts) + ")"


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """A regex of the JSON integers in [lo, hi] (None = unbounded on that side)."""
    parts = []
    if hi is None or hi >= 0:
        parts.append(_natural_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:  # negatives: -k with k in [max(-hi, 1), -lo]
        k_lo = max(-hi, 1) if hi is not None else 1
        parts.append("-" + _natural_range(k_lo, -lo if lo is not None else None))
    return "(?:" + "|".join(parts) + ")"


def _bounds(node: dict, integer: bool, where: str) -> tuple[Any, Any]:
    lo, hi = node.get("minimum"), node.get("maximum")
    xlo, xhi = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise StructuredOutputsError(f"json schema: {where}.{key} must be a finite number.")
    if integer:
        if xlo is not None:
            lo = max(lo, math.floor(xlo) + 1) if lo is not None else math.floor(xlo) + 1
        if xhi is not None:
            hi = min(hi, math.ceil(xhi) - 1) if hi is not None else math.ceil(xhi) - 1
        lo = math.ceil(lo) if lo is not None else None
        hi = math.floor(hi) if hi is not None else None
    elif xlo is not None or xhi is not None:
        raise StructuredOutputsError(
            f"json schema: {where}: exclusiveMinimum/exclusiveMaximum are supported on integers only."
        )
    if lo is not None and hi is not None and lo > hi:
        raise StructuredOutputsError(f"json schema: {where}: no value satisfies the bounds.")
    return lo, hi


def _number_range_regex(lo: Any, hi: Any, where: str) -> str:
    """Decimal numbers (no exponent) in [lo, hi]: integral bounds with lo >= 0 only."""
    if lo is None or lo < 0 or float(lo) != int(lo) or (hi is not None and float(hi) != int(hi)):
        raise StructuredOutputsError(
            f"json schema: {where}: number bounds are supported when minimum is a non-negative "
            "integer and maximum (if any) an integer; use an integer type, or no bounds."
        )
    lo, hi = int(lo), (int(hi) if hi is not None else None)
    frac = r"(?:\.[0-9]+)?"
    if hi is None:
        return f"(?:{_natural_range(lo, None)}{frac})"
    if hi == lo:
        return f"(?:{lo}(?:\\.0+)?)"
    return f"(?:{_natural_range(lo, hi - 1)}{frac}|{hi}(?:\\.0+)?)"


class _Walker:
    """Checks every subschema and swaps bounded numbers for placeholder constants."""

    def __init__(self) -> None:
        self.ranges: list[str] = []

    def walk(self, node: Any, where: str) -> Any:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise StructuredOutputsError(f"json schema: {where} must be an object or a boolean.")
        for key in node:
            if key not in _ANNOTATIONS | _HONOURED | _BOUNDS | {"allOf"}:
                raise StructuredOutputsError(
                    f"json schema: {where}.{key} is not supported (the output could not be "
                    "guaranteed to satisfy it)."
                )
        fmt = node.get("format")
        if fmt is not None and fmt not in _FORMATS:
            raise StructuredOutputsError(
                f"json schema: {where}.format {fmt!r} is not supported; supported: "
                f"{', '.join(sorted(_FORMATS))}."
            )
        if "pattern" in node and not isinstance(node["pattern"], str):
            raise StructuredOutputsError(f"json schema: {where}.pattern must be a string.")
        if "allOf" in node:  # pydantic's wrapper of a $ref with a description: one schema only
            parts = node["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise StructuredOutputsError(
                    f"json schema: {where}.allOf is supported with exactly one schema."
                )
            rest = {k: v for k, v in node.items() if k != "allOf" and k not in _ANNOTATIONS}
            if rest:
                raise StructuredOutputsError(
                    f"json schema: {where}.allOf cannot be combined with {', '.join(sorted(rest))}."
                )
            return self.walk(parts[0], f"{where}.allOf[0]")
        out = dict(node)
        if _BOUNDS & node.keys():
            kind = node.get("type")
            if kind not in ("integer", "number"):
                raise StructuredOutputsError(
                    f"json schema: {where}: minimum/maximum need type integer or number."
                )
            lo, hi = _bounds(node, kind == "integer", where)
            regex = int_range_regex(lo, hi) if kind == "integer" else \
                _number_range_regex(lo, hi, where)
            self.ranges.append(regex)
            return {"const": _PLACEHOLDER.format(len(self.ranges) - 1)}
        for key in ("properties", "$defs", "definitions"):
            if key in node:
                if not isinstance(node[key], dict):
                    raise StructuredOutputsError(f"json schema: {where}.{key} must be an object.")
                out[key] = {k: self.walk(v, f"{where}.{key}.{k}") for k, v in node[key].items()}
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                out[key] = self.walk(node[key], f"{where}.{key}")
        for key in ("anyOf", "prefixItems"):
            if key in node:
                if not isinstance(node[key], list) or not node[key]:
                    raise StructuredOutputsError(f"json schema: {where}.{key} must be a non-empty list.")
                out[key] = [self.walk(v, f"{where}.{key}[{i}]") for i, v in enumerate(node[key])]
        if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
            raise StructuredOutputsError(f"json schema: {where}.enum must be a non-empty list.")
        return out


def schema_regex(schema: Any) -> str:
    """The regex of the JSON texts valid against ``schema`` (refusing what it cannot enforce)."""
    from outlines_core.json_schema import build_regex_from_schema

    walker = _Walker()
    rewritten = walker.walk(copy.deepcopy(schema), "$")
    if rewritten is True:
        rewritten = {}
    if rewritten is False:
        raise StructuredOutputsError("json schema: false admits no value.")
    try:
        regex = build_regex_from_schema(json.dumps(rewritten),
                                        max_recursion_depth=SCHEMA_RECURSION_DEPTH)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise StructuredOutputsError(f"json schema cannot be compiled: {exc}") from None
    for i, rng in enumerate(walker.ranges):
        regex = regex.replace(f'"{_PLACEHOLDER.format(i)}"', rng)
    return regex


def constraint_regex(so: StructuredOutputs) -> str:
    """The one regex every output of ``so`` must fully match."""
    if so.regex is not None:
        return so.regex
    if so.choice is not None:
        return choice_regex(so.choice)
    if so.json_object:
        return json_object_regex()
    return schema_regex(so.schema_dict())
