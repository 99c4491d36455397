"""JSON schemas the structured-output benchmarks use, each with one instance that matches it.

Twenty schemas of the kinds apps send (nested objects, arrays, enums, bounded numbers, optional fields,
string patterns and formats, unions, recursion), written as OpenAI's strict mode and pydantic emit them.
"""

from __future__ import annotations

from typing import Any

_ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False}

# (name, schema, instance)
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("flat", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada", "age": 36}),
    ("bounded_numbers", {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "minimum": 1, "maximum": 100}},
        "required": ["score", "count"], "additionalProperties": False},
     {"score": 0.75, "count": 12}),
    ("enum", {"type": "object", "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number"}}, "required": ["sentiment", "confidence"], "additionalProperties": False},
     {"sentiment": "neutral", "confidence": 0.5}),
    ("array_of_strings", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5}},
        "required": ["tags"], "additionalProperties": False},
     {"tags": ["llm", "serving"]}),
    ("nested", {"type": "object", "properties": {"name": {"type": "string"}, "address": _ADDRESS},
                "required": ["name", "address"], "additionalProperties": False},
     {"name": "Bo", "address": {"street": "1 Main St", "city": "Oslo", "zip": "01234"}}),
    ("array_of_objects", {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False},
     {"items": [{"sku": "A1", "qty": 2}, {"sku": "B7", "qty": 1}]}),
    ("optional_fields", {"type": "object", "properties": {
        "title": {"type": "string"}, "subtitle": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "year": {"type": "integer"}}, "required": ["title"], "additionalProperties": False},
     {"title": "Dune", "subtitle": None}),
    ("booleans", {"type": "object", "properties": {"done": {"type": "boolean"}, "urgent": {"type": "boolean"}},
                  "required": ["done", "urgent"], "additionalProperties": False},
     {"done": False, "urgent": True}),
    ("string_lengths", {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 3, "maxLength": 8}}, "required": ["code"],
        "additionalProperties": False},
     {"code": "XK-42"}),
    ("date_format", {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                                      "email": {"type": "string", "format": "email"}},
                     "required": ["when", "email"], "additionalProperties": False},
     {"when": "2026-11-25", "email": "ops@example.com"}),
    ("union", {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
               "required": ["value"], "additionalProperties": False},
     {"value": "seven"}),
    ("defs_ref", {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"},
                                                                        "y": {"type": "number"}},
                                      "required": ["x", "y"], "additionalProperties": False}},
                  "type": "object", "properties": {"a": {"$ref": "#/$defs/Point"}, "b": {"$ref": "#/$defs/Point"}},
                  "required": ["a", "b"], "additionalProperties": False},
     {"a": {"x": 0, "y": 1.5}, "b": {"x": -2, "y": 3}}),
    ("recursive_tree", {"$defs": {"Node": {"type": "object", "properties": {
        "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
        "required": ["label", "children"], "additionalProperties": False}}, "$ref": "#/$defs/Node"},
     {"label": "root", "children": [{"label": "leaf", "children": []}]}),
    ("matrix", {"type": "object", "properties": {"rows": {"type": "array", "items": {
        "type": "array", "items": {"type": "integer"}}}}, "required": ["rows"], "additionalProperties": False},
     {"rows": [[1, 2], [3, 4]]}),
    ("const_and_enum_ints", {"type": "object", "properties": {"version": {"const": 2},
                                                              "level": {"enum": [1, 2, 3]}},
                             "required": ["version", "level"], "additionalProperties": False},
     {"version": 2, "level": 3}),
    ("person_record", {"type": "object", "properties": {
        "first_name": {"type": "string"}, "last_name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "emails": {"type": "array", "items": {"type": "string"}},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]}, "active": {"type": "boolean"}},
        "required": ["first_name", "last_name", "age", "emails", "role", "active"], "additionalProperties": False},
     {"first_name": "Grace", "last_name": "Hopper", "age": 85, "emails": ["g@navy.mil"], "role": "admin",
      "active": True}),
    ("invoice", {"type": "object", "properties": {
        "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"}, "total": {"type": "number", "minimum": 0},
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
        "lines": {"type": "array", "items": {"type": "object", "properties": {
            "description": {"type": "string"}, "amount": {"type": "number"}},
            "required": ["description", "amount"], "additionalProperties": False}}},
        "required": ["number", "total", "currency", "lines"], "additionalProperties": False},
     {"number": "INV-0042", "total": 12.5, "currency": "EUR", "lines": [{"description": "tea", "amount": 12.5}]}),
    ("tool_arguments", {"type": "object", "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location", "unit"],
        "additionalProperties": False},
     {"location": "Paris, France", "unit": "celsius"}),
    ("dictionary", {"type": "object", "properties": {"counts": {"type": "object",
                                                                "additionalProperties": {"type": "integer"}}},
                    "required": ["counts"], "additionalProperties": False},
     {"counts": {"a": 1, "b": 2}}),
    ("top_level_array", {"type": "array", "items": {"type": "object", "properties": {
        "q": {"type": "string"}, "a": {"type": "string"}}, "required": ["q", "a"], "additionalProperties": False},
        "minItems": 1},
     [{"q": "2+2?", "a": "4"}]),
]
