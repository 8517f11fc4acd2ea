"""The request-side description of a structured-output constraint (torch-free).

Shaped like vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON schema, as a
dict or its JSON text), ``regex``, ``choice``, ``json_object`` (any JSON object), ``grammar``
(a Lark grammar as llguidance reads it, or GBNF/EBNF) or ``structural_tag`` is set, plus the
JSON whitespace options ``disable_any_whitespace`` and ``whitespace_pattern``. The frontend
turns it into an llguidance grammar (:mod:`blink.dpu.structured`), follows the request's
tokens with it and hands the device sampler each next-token mask; nothing here knows about
tokens.

Every way a request can ask for a constraint (``response_format``, ``structured_outputs``,
``guided_json`` / ``guided_regex`` / ``guided_choice``, a forced tool call) ends in one of
these, so there is one place that says what a valid constraint is.
"""
from __future__ import annotations

import hashlib
import json as _json
from dataclasses import dataclass
from typing import Any

from blink.errors import BlinkError

#: Longest regex / schema text accepted before compiling (the compile cost grows with it).
MAX_CONSTRAINT_CHARS = 64 * 1024
#: Most alternatives a ``choice`` constraint may list, and the longest one.
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024


class StructuredOutputsError(BlinkError, ValueError):
    """A structured-output constraint is malformed (the HTTP layer answers 400)."""


@dataclass(frozen=True)
class StructuredOutputs:
    """One structured-output constraint: exactly one of the fields is set.

    json:        a JSON schema (a dict, or its JSON text); the output is a JSON value valid
                 against it
    regex:       the output fully matches this regular expression
    choice:      the output is exactly one of these strings
    json_object: the output is any JSON object (``response_format={"type": "json_object"}``)
    grammar:     a Lark grammar (llguidance's dialect, ``%json {...}`` included) or a GBNF /
                 EBNF grammar (llama.cpp's); the output is a sentence of it
    structural_tag: vLLM's ``{"type": "structural_tag", "structures": [{"begin", "schema",
                 "end"}], "triggers": [...]}``: free text with schema-checked tagged parts
    disable_any_whitespace: JSON without whitespace between tokens
    whitespace_pattern: the regex of the whitespace allowed between JSON tokens
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False
    grammar: str | None = None
    structural_tag: dict | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json``, ``regex``, ``choice``, ``json_object``,
        ``grammar`` or ``structural_tag``."""
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        if self.grammar is not None:
            return "grammar"
        if self.structural_tag is not None:
            return "structural_tag"
        return "json_object"

    def validate(self) -> None:
        """Raise :class:`StructuredOutputsError` naming the problem, if any."""
        given = [
            name
            for name, is_set in (
                ("json", self.json is not None),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("json_object", bool(self.json_object)),
                ("grammar", self.grammar is not None),
                ("structural_tag", self.structural_tag is not None),
            )
            if is_set
        ]
        if len(given) != 1:
            raise StructuredOutputsError(
                "structured outputs need exactly one of json, regex, choice, json_object, "
                f"grammar or structural_tag, got {', '.join(given) if given else 'none'}."
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputsError("disable_any_whitespace must be a boolean.")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise StructuredOutputsError("whitespace_pattern must be a non-empty string.")
            if len(self.whitespace_pattern) > MAX_CHOICE_CHARS:
                raise StructuredOutputsError(
                    f"whitespace_pattern can be at most {MAX_CHOICE_CHARS} characters long.")
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise StructuredOutputsError("grammar must be a non-empty string.")
            if len(self.grammar) > MAX_CONSTRAINT_CHARS:
                raise StructuredOutputsError(
                    f"grammar is {len(self.grammar)} characters, more than the limit of "
                    f"{MAX_CONSTRAINT_CHARS}.")
        if self.structural_tag is not None:
            if not isinstance(self.structural_tag, dict):
                raise StructuredOutputsError("structural_tag must be an object.")
            try:
                size = len(_json.dumps(self.structural_tag))
            except (TypeError, ValueError) as exc:
                raise StructuredOutputsError(f"structural_tag is not JSON-serialisable: {exc}") from None
            if size > MAX_CONSTRAINT_CHARS:
                raise StructuredOutputsError(
                    f"structural_tag is {size} characters, more than the limit of "
                    f"{MAX_CONSTRAINT_CHARS}.")
        if not isinstance(self.json_object, bool):
            raise StructuredOutputsError(
                f"json_object must be a boolean, got {self.json_object!r}."
            )
        if self.json is not None:
            self._check_json()
        if self.regex is not None:
            self._check_regex()
        if self.choice is not None:
            self._check_choice()

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            if len(schema) > MAX_CONSTRAINT_CHARS:
                raise StructuredOutputsError(
                    f"json schema is {len(schema)} characters, more than the limit of "
                    f"{MAX_CONSTRAINT_CHARS}."
                )
            try:
                schema = _json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputsError(f"json schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputsError(
                f"json schema must be a JSON object, got {type(schema).__name__}."
            )
        if isinstance(schema, dict):
            try:
                text = _json.dumps(schema)
            except (TypeError, ValueError) as exc:
                raise StructuredOutputsError(f"json schema is not JSON-serialisable: {exc}") from None
            if len(text) > MAX_CONSTRAINT_CHARS:
                raise StructuredOutputsError(
                    f"json schema is {len(text)} characters, more than the limit of "
                    f"{MAX_CONSTRAINT_CHARS}."
                )

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str):
            raise StructuredOutputsError(f"regex must be a string, got {self.regex!r}.")
        if not self.regex:
            raise StructuredOutputsError("regex must not be empty.")
        if len(self.regex) > MAX_CONSTRAINT_CHARS:
            raise StructuredOutputsError(
                f"regex is {len(self.regex)} characters, more than the limit of "
                f"{MAX_CONSTRAINT_CHARS}."
            )
        # Its syntax is the grammar engine's (Rust regex), checked when it is compiled.

    def _check_choice(self) -> None:
        choice = self.choice
        if not isinstance(choice, tuple) or not all(isinstance(c, str) for c in choice):
            raise StructuredOutputsError(f"choice must be a list of strings, got {choice!r}.")
        if not choice:
            raise StructuredOutputsError("choice must list at least one string.")
        if len(choice) > MAX_CHOICES:
            raise StructuredOutputsError(
                f"choice can list at most {MAX_CHOICES} strings, got {len(choice)}."
            )
        if any(not c for c in choice):
            raise StructuredOutputsError("choice cannot contain an empty string.")
        if any(len(c) > MAX_CHOICE_CHARS for c in choice):
            raise StructuredOutputsError(
                f"choice strings can be at most {MAX_CHOICE_CHARS} characters long."
            )

    def schema_dict(self) -> dict | bool | None:
        """The JSON schema as a Python object (``json`` only), else None."""
        if self.json is None:
            return None
        return _json.loads(self.json) if isinstance(self.json, str) else self.json

    def canonical_text(self) -> str:
        """A canonical text of the constraint: equal constraints give equal texts.

        JSON schemas are re-serialised with sorted keys, so the same schema sent with its keys
        in another order (or as text instead of a dict) hashes the same.
        """
        if self.json is not None:
            body: Any = self.schema_dict()
        elif self.regex is not None:
            body = self.regex
        elif self.choice is not None:
            body = list(self.choice)
        elif self.grammar is not None:
            body = self.grammar
        elif self.structural_tag is not None:
            body = self.structural_tag
        else:
            body = True
        options = {"disable_any_whitespace": self.disable_any_whitespace,
                   "whitespace_pattern": self.whitespace_pattern}
        return _json.dumps({self.kind: body, "options": options}, sort_keys=True,
                           separators=(",", ":"))

    def content_hash(self) -> str:
        """SHA-256 hex digest of :meth:`canonical_text` (the grammar cache key, with the vocab)."""
        return hashlib.sha256(self.canonical_text().encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: Any) -> "StructuredOutputs":
        """From vLLM's ``structured_outputs`` request object (``json``/``regex``/``choice``/
        ``json_object``/``grammar``/``structural_tag`` and the whitespace options)."""
        if not isinstance(data, dict):
            raise StructuredOutputsError(
                f"structured_outputs must be an object, got {type(data).__name__}."
            )
        # vLLM's other keys are options of the backend; only "false"-y values can be honoured.
        known = {"json", "regex", "choice", "json_object", "grammar", "structural_tag",
                 "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern", "backend"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StructuredOutputsError(
                f"structured_outputs has unknown field(s): {', '.join(unknown)}."
            )
        for option in ("disable_additional_properties", "backend"):
            if data.get(option) not in (None, False):
                raise StructuredOutputsError(
                    f"structured_outputs.{option} is not supported (the backend is llguidance; "
                    "additionalProperties is enforced as the schema says)."
                )
        choice = data.get("choice")
        if choice is not None and not isinstance(choice, (list, tuple)):
            raise StructuredOutputsError(f"choice must be a list of strings, got {choice!r}.")
        json_object = data.get("json_object")
        tag = data.get("structural_tag")
        if isinstance(tag, str):  # vLLM takes it as JSON text
            try:
                tag = _json.loads(tag)
            except ValueError as exc:
                raise StructuredOutputsError(f"structural_tag is not valid JSON: {exc}") from None
        return cls(
            json=data.get("json"),
            regex=data.get("regex"),
            choice=tuple(choice) if choice is not None else None,
            json_object=False if json_object is None else json_object,
            grammar=data.get("grammar"),
            structural_tag=tag,
            disable_any_whitespace=bool(data.get("disable_any_whitespace") or False),
            whitespace_pattern=data.get("whitespace_pattern"),
        )
