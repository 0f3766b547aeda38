"""OpenAI's rule for a `strict: true` schema (response_format's json_schema, a tool's
parameters): every object sets `"additionalProperties": false` and lists every one of its
properties in `required` (an optional value is written nullable: `{"type": ["string", "null"]}`).

mdi refuses a strict schema that breaks the rule, with a 400 naming the rule and where, as
OpenAI does, rather than tightening it silently: a client that sends strict gets what OpenAI
would give it or an error that says why, never keys its schema allowed and OpenAI would not
(or, tightened, answers that drop keys the client meant to allow). `strict: false` (OpenAI's
default) and llama.cpp's `json_schema` stay plain JSON Schema.
"""
from typing import Any, Iterator, Optional, Tuple

# Where subschemas sit: keyword -> whether it holds one schema, a list or a name -> schema map.
ONE, LIST, MAP = "one", "list", "map"
SUBSCHEMAS = (("properties", MAP), ("$defs", MAP), ("definitions", MAP), ("patternProperties", MAP),
              ("items", ONE), ("items", LIST), ("prefixItems", LIST), ("additionalProperties", ONE),
              ("anyOf", LIST), ("allOf", LIST), ("oneOf", LIST), ("not", ONE),
              ("if", ONE), ("then", ONE), ("else", ONE), ("contains", ONE))


def _pointer(path: str, key: Any) -> str:
    return "%s/%s" % (path, str(key).replace("~", "~0").replace("/", "~1"))


def _children(schema: dict, path: str) -> Iterator[Tuple[Any, str]]:
    for key, shape in SUBSCHEMAS:
        value = schema.get(key)
        where = _pointer(path, key)
        if shape == ONE and isinstance(value, dict):
            yield value, where
        elif shape == LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                yield sub, _pointer(where, i)
        elif shape == MAP and isinstance(value, dict):
            for name, sub in value.items():
                yield sub, _pointer(where, name)


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def strict_violation(schema: Any, path: str = "#") -> Optional[str]:
    """What in `schema` breaks OpenAI's strict rule, as one line naming the rule and the JSON
    pointer where (None: it holds). Walks every subschema, $defs included, depth first."""
    if not isinstance(schema, dict):
        return None
    if _is_object(schema):
        if schema.get("additionalProperties") is not False:
            return 'strict schemas need "additionalProperties": false on every object, not at %s' % path
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        missing = [name for name in props if name not in required]
        if missing:
            return ('strict schemas list every property in "required" (make an optional one nullable, '
                    '{"type": [..., "null"]}): %s is not, at %s' % (missing[0], path))
    for sub, where in _children(schema, path):
        found = strict_violation(sub, where)
        if found is not None:
            return found
    return None
