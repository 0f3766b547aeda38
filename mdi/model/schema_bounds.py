"""Bounds a JSON schema leaves open but a small model runs into: an integer's digits, a number's
integer and fraction digits, and the fraction of a second in `format: time` / `date-time` (and
a `duration`'s digits). Left open, a model at temperature 0 wrote "10:10:10.000000000000..." and
integers of ever more digits until max_tokens, and an answer cut there is not valid JSON. As
llama.cpp's json-schema-to-grammar caps them (integers at 16 digits, fractions at 16, time
fractions at 3), the schema is rewritten with keywords llguidance enforces before it compiles:
`minimum`/`maximum` where the schema sets none, `multipleOf` on numbers without one, and a
bounded `pattern` in place of those formats (only where the schema has no pattern of its own).
Every answer these allow is valid against the original schema.

A schema overrides the defaults at its root: `"x-mdi-bounds": {"integer_digits": 18,
"fraction_digits": 6, "time_fraction_digits": 9}` (0 for a kind: leave it unbounded).
"""
import copy
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Optional

OVERRIDE_KEY = "x-mdi-bounds"
DATA_KEYS = ("enum", "const", "default", "examples", "required")  # values that are data, not schemas
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


class BoundsError(ValueError):
    """A bad `x-mdi-bounds` object."""


@dataclass(frozen=True)
class Bounds:
    # 15, not llama.cpp's 16: llguidance reads bounds as doubles, exact up to 2^53 (16 digits is not)
    integer_digits: int = 15
    # llguidance takes multipleOf down to 1e-9 (a float's decimal expansion past that is refused)
    fraction_digits: int = 9
    # microseconds: what Python's datetime (and most clients' parsers) keeps
    time_fraction_digits: int = 6


def _override(schema: Dict[str, Any], bounds: Bounds) -> Bounds:
    given = schema.get(OVERRIDE_KEY)
    if given is None:
        return bounds
    names = [f.name for f in fields(Bounds)]
    if not isinstance(given, dict) or set(given) - set(names) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 30 for v in given.values()):
        raise BoundsError("%s: expected an object of %s, each an integer from 0 to 30"
                          % (OVERRIDE_KEY, ", ".join(names)))
    if given.get("fraction_digits", 0) > 9:
        raise BoundsError("%s.fraction_digits: at most 9 (or 0: unbounded)" % OVERRIDE_KEY)
    return replace(bounds, **given)


def bounded(schema: Any, bounds: Optional[Bounds] = None) -> Any:
    """`schema` with the bounds added (a copy; the input is left as it is)."""
    if not isinstance(schema, dict):
        return schema
    limits = _override(schema, bounds or Bounds())
    out = copy.deepcopy(schema)
    out.pop(OVERRIDE_KEY, None)
    _walk(out, limits)
    return out


def _types(schema: Dict[str, Any]) -> set:
    kind = schema.get("type")
    return set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()


def _walk(schema: Any, b: Bounds) -> None:
    if isinstance(schema, list):
        for item in schema:
            _walk(item, b)
        return
    if not isinstance(schema, dict):
        return
    types = _types(schema)
    if types & {"integer", "number"}:
        _bound_numbers(schema, types, b)
    if "string" in types and "pattern" not in schema and schema.get("format") in _FORMATS:
        pattern = _FORMATS[schema["format"]](b.time_fraction_digits)
        if pattern is not None:
            del schema["format"]
            schema["pattern"] = pattern
    for key, value in schema.items():
        if key in DATA_KEYS:
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                _walk(sub, b)
        elif isinstance(value, (dict, list)):
            _walk(value, b)


def _bound_numbers(schema: Dict[str, Any], types: set, b: Bounds) -> None:
    if b.integer_digits:
        cap = 10 ** b.integer_digits - 1
        low, high = schema.get("minimum", schema.get("exclusiveMinimum")), \
            schema.get("maximum", schema.get("exclusiveMaximum"))
        # A side the schema bounds itself keeps its bound; a cap that would exclude every value
        # the other side allows is left out (the schema asked for numbers that long).
        if low is None and (high is None or _number(high) and high >= -cap):
            schema["minimum"] = -cap
        if high is None and (low is None or _number(low) and low <= cap):
            schema["maximum"] = cap
    if "number" in types and b.fraction_digits and "multipleOf" not in schema:
        schema["multipleOf"] = float("1e-%d" % b.fraction_digits)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# RFC 3339's full-date, full-time and (appendix A) duration, with bounded digits.
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
OFFSET = r"([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"


def _time(fraction: int) -> str:
    frac = r"(\.[0-9]{1,%d})?" % fraction if fraction else r"(\.[0-9]+)?"
    return r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)" + frac + OFFSET


def _duration(_: int) -> str:
    n = "[0-9]{1,9}"  # a duration's numbers: 9 digits is over 30 years in seconds
    time = "T(%sH(%sM)?(%sS)?|%sM(%sS)?|%sS)" % ((n,) * 6)
    date = "(%sY(%sM)?(%sD)?|%sM(%sD)?|%sD)" % ((n,) * 6)
    return "P(%s(%s)?|%s|%sW)" % (date, time, time, n)


_FORMATS = {
    "time": lambda f: "^%s$" % _time(f),
    "date-time": lambda f: "^%s[Tt]%s$" % (DATE, _time(f)),
    "duration": lambda f: "^%s$" % _duration(f),
}
