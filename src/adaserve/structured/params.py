"""``StructuredOutputsParams``: what a request's output must match, in vLLM's shape.

Exactly one kind is set: ``json`` (a JSON schema, as a dict or its text), ``regex``,
``choice`` (the output is one of these strings), ``grammar`` (Lark, or GBNF/EBNF as
llama.cpp and xgrammar write it: rules with ``::=``) or ``json_object`` (any JSON
object). The server builds one from OpenAI's ``response_format``, vLLM's
``structured_outputs`` field or its older ``guided_*`` aliases (``from_fields``).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, cast

from adaserve.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CONSTRAINT_BYTES = 1 << 20  # a schema or grammar larger than 1 MiB is refused


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's ``StructuredOutputsParams`` fields).

    json:  a JSON schema; a dict is kept as its JSON text (its key order kept: object
           properties are written in the order the schema lists them)
    regex: the whole output matches it
    choice: the output is exactly one of these strings
    grammar: Lark, or GBNF (``root ::= ...``), converted to Lark for llguidance
    json_object: any JSON object
    disable_any_whitespace: JSON without optional whitespace
    disable_additional_properties: object schemas without ``additionalProperties``
           allow no keys beyond ``properties``
    whitespace_pattern: the regex of JSON's optional whitespace
    """

    json: str | dict[str, Any] | bool | None = None  # a dict or bool: kept as its JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        j = self.json
        if j is not None and not isinstance(j, str):
            if not isinstance(j, (dict, bool)):
                raise InvalidRequestError(
                    "structured_outputs.json must be a JSON schema (an object)",
                    "structured_outputs",
                )
            object.__setattr__(self, "json", _json.dumps(j, ensure_ascii=False))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(
                    "structured_outputs.choice must be a list of strings", "structured_outputs"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise InvalidRequestError(
                    "structured_outputs.choice must not be empty", "structured_outputs"
                )
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs must set exactly one of "
                f"{', '.join(KINDS)} (got {', '.join(given) or 'none'})",
                "structured_outputs",
            )
        for k in ("json", "regex", "grammar"):
            v = getattr(self, k)
            if v is not None and not isinstance(v, str):
                raise InvalidRequestError(
                    f"structured_outputs.{k} must be a string", "structured_outputs"
                )
            if v is not None and len(v.encode("utf-8", "replace")) > MAX_CONSTRAINT_BYTES:
                raise InvalidRequestError(
                    f"structured_outputs.{k} is larger than {MAX_CONSTRAINT_BYTES} bytes",
                    "structured_outputs",
                )
        if self.json is not None:
            try:
                schema = _json.loads(cast(str, self.json))  # text after __post_init__
            except ValueError as e:
                raise InvalidRequestError(
                    f"structured_outputs.json is not JSON: {e}", "structured_outputs"
                ) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(
                    "a JSON schema must be an object (or true/false)", "structured_outputs"
                )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """The content key of the compiled grammar (the cache's key)."""
        return (
            self.kind,
            getattr(self, self.kind),
            self.disable_any_whitespace,
            self.disable_additional_properties,
            self.whitespace_pattern,
        )

    def schema(self) -> Any:
        """The JSON schema (json, json_object) as a Python value."""
        if self.json is not None:
            return _json.loads(cast(str, self.json))
        return {"type": "object"}

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams | None:
        """From a dict (vLLM's JSON shape) or an instance; None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError("structured_outputs must be an object", "structured_outputs")
        known = set(cls.__dataclass_fields__)
        extra = sorted(set(value) - known)
        if extra:
            raise InvalidRequestError(
                f"structured_outputs has unknown field(s) {extra}; known: {sorted(known)}",
                "structured_outputs",
            )
        return cls(**value)


def from_response_format(rf: dict | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``: ``text`` (None), ``json_object`` or ``json_schema``
    (``{"json_schema": {"name", "schema", "strict"}}``)."""
    if rf is None:
        return None
    t = rf.get("type")
    if t == "text":
        return None
    if t == "json_object":
        return StructuredOutputsParams(json_object=True)
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError(
                'response_format of type "json_schema" needs a json_schema object',
                "response_format",
            )
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema.schema must be an object", "response_format"
            )
        # strict: OpenAI's own schema subset; any schema is enforced exactly here
        return StructuredOutputsParams(json=schema)
    raise InvalidRequestError(
        f"response_format type must be text, json_object or json_schema (got {t!r})",
        "response_format",
    )


GUIDED_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def from_fields(
    structured: dict | None,
    response_format: dict | None,
    guided: dict[str, Any],
    whitespace_pattern: str | None = None,
) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, from ``structured_outputs``, OpenAI's
    ``response_format`` and vLLM's deprecated ``guided_*`` fields (given: name ->
    value of those present); asking in two ways is a 400."""
    asked = []
    if structured is not None:
        asked.append(("structured_outputs", StructuredOutputsParams.of(structured)))
    rf = from_response_format(response_format)
    if rf is not None:
        asked.append(("response_format", rf))
    g = {GUIDED_ALIASES[k]: v for k, v in guided.items() if v is not None}
    if g:
        if whitespace_pattern is not None:
            g["whitespace_pattern"] = whitespace_pattern
        asked.append((", ".join(sorted(guided)), StructuredOutputsParams(**g)))
    if len(asked) > 1:
        raise InvalidRequestError(
            "ask for one output constraint: " + " and ".join(n for n, _ in asked) + " both set",
            asked[1][0].split(",")[0],
        )
    return asked[0][1] if asked else None
