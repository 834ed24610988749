"""Ten JSON schemas of different shapes (nested objects, arrays, enums, numeric bounds,
optional fields, anyOf, pattern, const, ``additionalProperties: false``): the sampled
validity test and ``benchmarks/bench_peer_structured.py`` use the same ones."""

from __future__ import annotations

import json


def _s(maxlen=10):
    return {"type": "string", "maxLength": maxlen}


SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": _s(), "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # nested objects
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "nick": _s(6),
                },
                "required": ["id", "nick"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
        "additionalProperties": False,
    },
    {  # an array of enums
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    {  # numeric bounds
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
    {  # optional fields
        "type": "object",
        "properties": {
            "title": _s(12),
            "subtitle": _s(8),
            "pages": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 5},
    {"enum": ["north", "south", "east", "west"]},
    {  # anyOf
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, _s(5), {"type": "null"}]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    {  # array of objects
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # const and a boolean
        "type": "object",
        "properties": {"version": {"const": 2}, "beta": {"type": "boolean"}, "code": _s(4)},
        "required": ["version", "beta", "code"],
        "additionalProperties": False,
    },
]
SCHEMAS = [json.loads(json.dumps(s)) for s in SCHEMAS]  # plain JSON values
