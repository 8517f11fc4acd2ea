"""Instances of a JSON schema for the grammar-engine benchmark: valid ones (random, seeded,
kept only if ``jsonschema`` with its format checker accepts them) and invalid ones (mutations of
the valid ones that ``jsonschema`` rejects even without format checks). Object properties come
in the order ``properties`` declares them, as llguidance and xgrammar generate (and accept) them.

``hypothesis-jsonschema`` (0.23.1, the newest on PyPI) does not run with the installed
hypothesis 6.170 (``'many' object has no attribute 'more'``), hence this small generator. It
covers what real schemas use (``$ref``, ``allOf``/``anyOf``/``oneOf``, enum/const, bounds,
``multipleOf``, ``pattern`` through :mod:`re`'s parser, common ``format`` s); what it gets
wrong is simply filtered out by the validator, so a schema may end with no instance.
"""
from __future__ import annotations

import copy
import json
import random
import string
import warnings
from typing import Any

import jsonschema
from jsonschema import FormatChecker

try:  # Python 3.11+
    from re import _constants as sre_c, _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

FORMATS = {
    "date-time": "2024-05-01T12:30:00Z", "date": "2024-05-01", "time": "12:30:00Z",
    "email": "user@example.com", "idn-email": "user@example.com", "hostname": "example.com",
    "idn-hostname": "example.com", "ipv4": "192.168.0.1", "ipv6": "2001:db8::1",
    "uri": "https://example.com/a", "uri-reference": "https://example.com/a", "iri": "https://example.com/a",
    "iri-reference": "https://example.com/a", "url": "https://example.com/a", "uri-template": "https://example.com/{id}",
    "uuid": "123e4567-e89b-12d3-a456-426614174000", "regex": "^[a-z]+$", "json-pointer": "/a/b",
    "relative-json-pointer": "0/a", "duration": "P1D", "int32": "1", "int64": "1",
}

MAX_DEPTH = 6


class _Fail(Exception):
    pass


def validator_for(schema: Any, draft4: bool = False, formats: bool = True):
    cls = jsonschema.Draft4Validator if draft4 else \
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=FormatChecker() if formats else None)


# --- strings from a regex ----------------------------------------------------------------------

_CATEGORY = {
    sre_c.CATEGORY_DIGIT: string.digits, sre_c.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
    sre_c.CATEGORY_SPACE: " ", sre_c.CATEGORY_NOT_DIGIT: "abc", sre_c.CATEGORY_NOT_WORD: "-.",
    sre_c.CATEGORY_NOT_SPACE: "abc",
}


def _charset(items: list, rng: random.Random) -> str:
    negate = False
    pool: list[str] = []
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            pool.append(chr(av))
        elif op is sre_c.RANGE:
            lo, hi = av
            pool.extend(chr(c) for c in range(lo, min(hi, lo + 200) + 1))
        elif op is sre_c.CATEGORY:
            pool.extend(_CATEGORY.get(av, "a"))
    if negate:
        banned = set(pool)
        options = [c for c in string.ascii_letters + string.digits + "-_" if c not in banned]
        return rng.choice(options) if options else "~"
    return rng.choice(pool) if pool else "a"


def _from_parsed(parsed, rng: random.Random, depth: int = 0) -> str:
    out = []
    for op, av in parsed:
        if op is sre_c.LITERAL:
            out.append(chr(av))
        elif op is sre_c.NOT_LITERAL:
            out.append("a" if chr(av) != "a" else "b")
        elif op is sre_c.ANY:
            out.append(rng.choice("abcxyz"))
        elif op is sre_c.IN:
            out.append(_charset(av, rng))
        elif op is sre_c.BRANCH:
            out.append(_from_parsed(rng.choice(av[1]), rng, depth + 1))
        elif op is sre_c.SUBPATTERN:
            out.append(_from_parsed(av[-1], rng, depth + 1))
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = av
            hi = lo + 3 if hi is sre_c.MAXREPEAT else min(hi, lo + 3)
            n = rng.randint(lo, max(lo, hi)) if depth < 8 else lo
            out.extend(_from_parsed(sub, rng, depth + 1) for _ in range(n))
        elif op is sre_c.CATEGORY:
            out.append(_CATEGORY.get(av, "a")[0])
        elif op in (sre_c.AT, sre_c.ASSERT, sre_c.ASSERT_NOT):
            continue
        elif op is sre_c.GROUPREF:
            continue
        else:
            raise _Fail(f"regex op {op}")
    return "".join(out)


def string_for_pattern(pattern: str, rng: random.Random) -> str:
    try:
        with warnings.catch_warnings():  # "possible nested set" and the like: ECMA regexes
            warnings.simplefilter("ignore")
            parsed = sre_parse.parse(pattern.replace("\\p{L}", "a-zA-Z").replace("\\d", "[0-9]"))
    except Exception as exc:  # noqa: BLE001 - an ECMA-only construct
        raise _Fail(str(exc)) from None
    return _from_parsed(parsed, rng)


# --- values -----------------------------------------------------------------------------------

class Generator:
    def __init__(self, root: Any, rng: random.Random):
        self.root = root
        self.rng = rng

    def resolve(self, schema: Any) -> Any:
        seen = 0
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
            ref = schema["$ref"]
            if not ref.startswith("#"):
                raise _Fail("external $ref")
            node = self.root
            for raw in ref[1:].split("/")[1:] if ref not in ("#", "#/") else []:
                token = raw.replace("~1", "/").replace("~0", "~")
                node = node[int(token)] if isinstance(node, list) else node[token]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**node, **rest} if rest and isinstance(node, dict) else node
            seen += 1
            if seen > 50:
                raise _Fail("$ref loop")
        return schema

    def merged(self, schema: dict) -> dict:
        """``allOf`` folded in (properties and required united, the rest overridden)."""
        schema = dict(schema)
        parts = schema.pop("allOf", None)
        if not parts:
            return schema
        out: dict = {}
        for part in [*(self.resolve(p) for p in parts), schema]:
            if not isinstance(part, dict):
                continue
            part = self.merged(part)
            for key, value in part.items():
                if key == "properties" and isinstance(out.get(key), dict):
                    out[key] = {**out[key], **value}
                elif key == "required" and isinstance(out.get(key), list):
                    out[key] = list(dict.fromkeys(out[key] + value))
                else:
                    out[key] = value
        return out

    def value(self, schema: Any, depth: int = 0) -> Any:
        rng = self.rng
        schema = self.resolve(schema)
        if schema is True or schema == {}:
            return rng.choice([1, "text", True, None])
        if schema is False or not isinstance(schema, dict):
            raise _Fail("false schema")
        if depth > MAX_DEPTH + 4:
            raise _Fail("too deep")
        schema = self.merged(schema)
        if "const" in schema:
            return copy.deepcopy(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return copy.deepcopy(rng.choice(schema["enum"]))
        for key in ("oneOf", "anyOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                branch = self.resolve(rng.choice(schema[key]))
                rest = {k: v for k, v in schema.items() if k != key}
                if isinstance(branch, dict):
                    return self.value(self.merged({**rest, "allOf": [branch]}), depth + 1)
                return self.value(branch, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"] or kind
            kind = rng.choice(kinds) if depth < MAX_DEPTH else ("null" if "null" in kind else rng.choice(kinds))
        if kind is None:
            if any(k in schema for k in ("properties", "required", "additionalProperties", "patternProperties")):
                kind = "object"
            elif any(k in schema for k in ("items", "prefixItems", "minItems", "maxItems")):
                kind = "array"
            elif any(k in schema for k in ("pattern", "minLength", "maxLength", "format")):
                kind = "string"
            elif any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
                kind = "number"
            else:
                kind = rng.choice(["string", "integer", "boolean"])
        return getattr(self, "_" + kind)(schema, depth)

    def _null(self, schema: dict, depth: int) -> None:
        return None

    def _boolean(self, schema: dict, depth: int) -> bool:
        return self.rng.random() < 0.5

    def _bounds(self, schema: dict) -> tuple[float, float]:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if xlo is True:
            xlo, lo = lo, None
        if xhi is True:
            xhi, hi = hi, None
        low = max([v for v in (lo,) if isinstance(v, (int, float)) and not isinstance(v, bool)]
                  + [v + 1e-9 for v in (xlo,) if isinstance(v, (int, float)) and not isinstance(v, bool)],
                  default=None)
        high = min([v for v in (hi,) if isinstance(v, (int, float)) and not isinstance(v, bool)]
                   + [v - 1e-9 for v in (xhi,) if isinstance(v, (int, float)) and not isinstance(v, bool)],
                   default=None)
        if low is None and high is None:
            low, high = -10, 100
        elif low is None:
            low = high - 100
        elif high is None:
            high = low + 100
        return low, high

    def _integer(self, schema: dict, depth: int) -> int:
        import math
        low, high = self._bounds(schema)
        low, high = math.ceil(low), math.floor(high)
        if low > high:
            raise _Fail("empty integer range")
        step = schema.get("multipleOf")
        if isinstance(step, int) and step > 0:
            first = -(-low // step) * step
            if first > high:
                raise _Fail("no multiple in range")
            return first + step * self.rng.randint(0, min(5, (high - first) // step))
        return self.rng.randint(low, min(high, low + 1000))

    def _number(self, schema: dict, depth: int) -> float | int:
        step = schema.get("multipleOf")
        if step is not None or self.rng.random() < 0.5:
            value = self._integer({**schema, "multipleOf": step if isinstance(step, int) else None}, depth)
            if isinstance(step, float):
                low, high = self._bounds(schema)
                value = round(round(max(low, min(high, value)) / step) * step, 10)
            return value
        low, high = self._bounds(schema)
        return round(self.rng.uniform(low, min(high, low + 1000)), 3)

    def _string(self, schema: dict, depth: int) -> str:
        rng = self.rng
        lo = schema.get("minLength", 0)
        hi = schema.get("maxLength", max(lo, 12))
        if isinstance(schema.get("pattern"), str):
            return string_for_pattern(schema["pattern"], rng)
        if schema.get("format") in FORMATS:
            return FORMATS[schema["format"]]
        n = rng.randint(lo, max(lo, min(hi, lo + 12)))
        return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(n)).strip().ljust(n, "x")

    def _array(self, schema: dict, depth: int) -> list:
        rng = self.rng
        prefix = schema.get("prefixItems")
        items = schema.get("items", {})
        if isinstance(items, list):  # draft-4 tuple form
            prefix, items = items, schema.get("additionalItems", {})
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems", lo + 3)
        n = lo if depth >= MAX_DEPTH else rng.randint(lo, max(lo, min(hi, lo + 3)))
        out = []
        for i in range(n):
            sub = prefix[i] if prefix and i < len(prefix) else items
            if sub is False:
                break
            out.append(self.value(sub, depth + 1))
        if schema.get("uniqueItems"):
            uniq = []
            for v in out:
                if v not in uniq:
                    uniq.append(v)
            out = uniq
        if "contains" in schema and not out:
            out.append(self.value(schema["contains"], depth + 1))
        return out

    def _object(self, schema: dict, depth: int) -> dict:
        rng = self.rng
        props = schema.get("properties") or {}
        required = [r for r in schema.get("required", []) if isinstance(r, str)]
        out: dict = {}
        for name in required:
            out[name] = self.value(props.get(name, {}), depth + 1)
        chance = 0.6 if depth < 2 else (0.3 if depth < MAX_DEPTH else 0.0)
        for name, sub in props.items():
            if name not in out and sub is not False and rng.random() < chance:
                out[name] = self.value(sub, depth + 1)
        # in the order the schema declares them: the engines generate (and accept) that order
        order = {name: i for i, name in enumerate(props)}
        return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def valid_instances(schema: Any, n: int = 3, tries: int = 24, seed: int = 0, draft4: bool = False) -> list[Any]:
    """Up to ``n`` distinct instances that ``jsonschema`` (with format checks) accepts."""
    try:
        validator = validator_for(schema, draft4)
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot take
        return []
    out: list[Any] = []
    for attempt in range(tries):
        gen = Generator(schema, random.Random(f"{seed}:{attempt}"))
        try:
            value = gen.value(schema)
            if validator.is_valid(value) and value not in out:
                out.append(value)
        except (_Fail, KeyError, IndexError, TypeError, ValueError, RecursionError, OverflowError):
            continue
        except jsonschema.exceptions.SchemaError:
            return out
        except Exception:  # noqa: BLE001 - jsonschema's own trouble with a schema (unknown format, bad regex)
            continue
        if len(out) >= n:
            break
    return out


def _wrong(value: Any) -> Any:
    if isinstance(value, bool):
        return "not-a-bool"
    if isinstance(value, (int, float)):
        return "not-a-number"
    if isinstance(value, str):
        return 123456
    if isinstance(value, list):
        return {"not": "an array"}
    if isinstance(value, dict):
        return ["not", "an", "object"]
    return 7


def invalid_instances(schema: Any, valid: list[Any], n: int = 4, draft4: bool = False) -> list[Any]:
    """Mutations of the valid instances that ``jsonschema`` (without format checks) rejects."""
    try:
        validator = validator_for(schema, draft4, formats=False)
    except Exception:  # noqa: BLE001
        return []
    candidates: list[Any] = []
    for v in valid:
        candidates.append(_wrong(v))
        if isinstance(v, dict):
            for key in list(v)[:3]:
                candidates.append({k: x for k, x in v.items() if k != key})  # drop a (maybe required) key
                candidates.append({**v, key: _wrong(v[key])})  # a value of the wrong type
            candidates.append({**v, "zz_unexpected_key": 1})
        if isinstance(v, list) and v:
            candidates.append(v + [_wrong(v[0])])
            candidates.append([_wrong(v[0])] + v[1:])
        if isinstance(v, str):
            candidates.append(v + "~!")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            candidates.extend([v + 10**9, v - 10**9, v + 0.5])
    out: list[Any] = []
    for c in candidates:
        try:
            if c not in out and not validator.is_valid(c):
                out.append(c)
        except Exception:  # noqa: BLE001
            continue
        if len(out) >= n:
            break
    return out


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
