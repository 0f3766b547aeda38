"""Bounds a JSON schema leaves open but a small model runs into: an integer's digits, a number's
integer and fraction digits, and the fraction of a second in `format: time` / `date-time` (and
a `duration`'s digits). Left open, a model at temperature 0 wrote "10:10:10.000000000000..." and
integers of ever more digits until max_tokens, and an answer cut there is not valid JSON. As
llama.cpp's json-schema-to-grammar caps them (integers at 16 digits, fractions at 16, time
fractions at 3), the schema is rewritten with keywords llguidance enforces before it compiles:
`minimum`/`maximum` where the schema sets none, `multipleOf` on numbers without one, and a
bounded `pattern` in place of those formats (only where the schema has no pattern of its own).
Every answer these allow is valid against the original schema.

A recursive `$ref` (a tree node whose children are nodes, a list node's `next`) is bounded the
same way: left open, a model nested it until max_tokens. The definitions on a reference cycle
are unrolled into `ref_depth` levels (copies in `$defs`, each referring to the next), and at
the deepest level a reference to them is what the schema allows without it: an optional
property left out, an array left empty, an `anyOf`/`oneOf` branch dropped (so a nullable node
is null). A schema that cannot end without recursing there (a required child node), or whose
cycles run through references other than `#`, `#/$defs/...` and `#/definitions/...` or through
keywords other than properties, items, additionalProperties, anyOf, oneOf and allOf, is left as
it is.

An object schema that lists its `properties` and says nothing of others
(`additionalProperties`, `patternProperties`, `unevaluatedProperties`) gets `"additionalProperties":
false`, as llama.cpp's converter defaults it: left open, SmolLM2 wrote a tool call's arguments
past its declared properties, the same key again and again, until max_tokens (LangChain's
function_calling with an optional field). `"additionalProperties": true` keeps an object open;
allOf's parts, each one part of an object's properties, are left as they are.

A schema overrides the defaults at its root: `"x-mdi-bounds": {"integer_digits": 18,
"fraction_digits": 6, "time_fraction_digits": 9, "ref_depth": 12}` (0 for a kind: leave it
unbounded).
"""
import copy
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Optional

OVERRIDE_KEY = "x-mdi-bounds"
DATA_KEYS = ("enum", "const", "default", "examples", "required")  # values that are data, not schemas
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


class BoundsError(ValueError):
    """A bad `x-mdi-bounds` object, or a numeric keyword no grammar can enforce exactly."""


@dataclass(frozen=True)
class Bounds:
    # 15, not llama.cpp's 16: llguidance reads bounds as doubles, exact up to 2^53 (16 digits is not)
    integer_digits: int = 15
    # llguidance takes multipleOf down to 1e-9 (a float's decimal expansion past that is refused)
    fraction_digits: int = 9
    # microseconds: what Python's datetime (and most clients' parsers) keeps
    time_fraction_digits: int = 6
    # levels of a recursive definition: a tree node and 5 generations of children below it
    ref_depth: int = 6


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
    if limits.ref_depth:
        out = _unrolled(out, limits.ref_depth)
    return out


def _types(schema: Dict[str, Any]) -> set:
    kind = schema.get("type")
    return set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()


def _walk(schema: Any, b: Bounds, closable: bool = True) -> None:
    if isinstance(schema, list):
        for item in schema:
            _walk(item, b, closable)
        return
    if not isinstance(schema, dict):
        return
    types = _types(schema)
    _check_exact(schema, types)
    if closable and isinstance(schema.get("properties"), dict) and not (
            {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(schema)):
        schema["additionalProperties"] = False
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
            # allOf's parts each list some of one object's properties: closed, they would refuse each other's
            _walk(value, b, key != "allOf")


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


NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
SAFE_INTEGER = 2 ** 53 - 1  # every integer up to it, and one past it, is a double
INT64_LIMIT = 2 ** 63  # llguidance saturates an integer's bounds here


def _check_exact(schema: Dict[str, Any], types: set) -> None:
    """A numeric keyword llguidance cannot hold exactly is a BoundsError. It reads them as
    doubles, saturated to int64 for integers: `minimum` 9007199254740993 was read as ...992 and
    allowed that (and `exclusiveMinimum` ...992 allowed ...992), an integer's `minimum` 1e300 was
    int64's largest, and a `multipleOf` past 2^53 (or beside bounds past it) counts in doubles
    too, so a `"stop"` answer broke the schema. Bounds that are doubles exactly (1e18, 2^62) hold."""
    integer = "integer" in types or not types
    given = {key: schema[key] for key in NUMBER_KEYWORDS if _number(schema.get(key))}
    for key, value in given.items():
        if not math.isfinite(value):
            problem = "is not a finite number"
        elif isinstance(value, int) and float(value) != value:
            problem = "is not a double: llguidance would read it as %r" % float(value)
        elif isinstance(value, int) and key.startswith("exclusive") and any(
                float(value + step) != value + step for step in (-1, 1)):
            problem = "has neighbours that are not doubles"
        elif integer and abs(value) >= INT64_LIMIT:
            problem = "is past int64, which llguidance holds an integer's bounds in"
        elif "multipleOf" in given and abs(value) > SAFE_INTEGER:
            problem = "is past 2^53 - 1 (%d) beside multipleOf, which counts in doubles" % SAFE_INTEGER
        else:
            continue
        raise BoundsError("%s %r %s: it cannot be enforced exactly" % (key, value, problem))


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


# --- recursive references ------------------------------------------------------------------------

DEF_MAPS = ("$defs", "definitions")
ROOT = ("#", "")  # the node of the graph that is the schema's root
ROOT_ONLY = ("$schema", "$id", "x-guidance")  # keys of the root, not of the copies of it


class _Unbounded(Exception):
    """The recursion cannot be cut here (a keyword the rewrite does not reason about)."""


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _target(ref: Any) -> Optional[tuple]:
    """(map, name) of a local reference to a definition, ROOT for "#", None for any other."""
    if not isinstance(ref, str):
        return None
    if ref == "#":
        return ROOT
    for kind in DEF_MAPS:
        head = "#/%s/" % kind
        if ref.startswith(head) and "/" not in ref[len(head):]:
            return kind, ref[len(head):].replace("~1", "/").replace("~0", "~")
    return None


def _refs(schema: Any, found: list) -> list:
    """Every `$ref` value in `schema` (data keywords left out)."""
    if isinstance(schema, list):
        for item in schema:
            _refs(item, found)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key == "$ref":
                found.append(value)
            elif key not in DATA_KEYS:
                _refs(value, found)
    return found


def _unrolled(schema: Dict[str, Any], depth: int) -> Dict[str, Any]:
    """`schema` with its reference cycles unrolled `depth` levels deep (or as it is, see above)."""
    nodes = {ROOT: {k: v for k, v in schema.items() if k not in DEF_MAPS}}
    for kind in DEF_MAPS:
        if isinstance(schema.get(kind), dict):
            nodes.update(((kind, name), sub) for name, sub in schema[kind].items())
    edges = {}
    for node, sub in nodes.items():
        targets = [_target(r) for r in _refs(sub, [])]
        if any(t is None or t not in nodes for t in targets):
            return schema  # a reference the rewrite does not follow: it may close a cycle
        edges[node] = set(targets)
    cyclic = {n for n in nodes if _reaches(n, n, edges)}
    if not cyclic:
        return schema
    maps = {kind: dict(schema[kind]) for kind in DEF_MAPS if isinstance(schema.get(kind), dict)}
    root_map = "$defs" if "$defs" in maps or not maps else next(iter(maps))

    def name(node: tuple, level: int) -> tuple:
        if level == 0:
            return node
        if node == ROOT:
            return root_map, "mdi-root-%d" % level
        return node[0], "%s-mdi-%d" % (node[1], level)

    levels: list = [None] * depth  # levels[k]: node -> its schema at level k (None: cannot end)
    try:
        for level in range(depth - 1, -1, -1):
            def link(target: Optional[tuple], ref: str, level: int = level) -> Optional[str]:
                if target not in cyclic:
                    return ref
                if level + 1 == depth or levels[level + 1][target] is None:
                    return None
                kind, key = name(target, level + 1)
                return "#/%s/%s" % (kind, _escape(key))
            levels[level] = {n: _prune(copy.deepcopy(nodes[n]), link) for n in cyclic}
    except _Unbounded:
        return schema
    if any(s is None for s in levels[0].values()):
        return schema  # a definition that cannot end without recursing: the schema as it is
    out = dict(levels[0].get(ROOT) or nodes[ROOT])
    for level, built in enumerate(levels):
        for node, sub in built.items():
            if sub is not None and (level or node != ROOT):
                if node == ROOT:  # the root's copies: a definition each, without the root's own keys
                    sub = {k: v for k, v in sub.items() if k not in ROOT_ONLY}
                kind, key = name(node, level)
                maps.setdefault(kind, {})[key] = sub
    out.update(maps)
    return out


def _reaches(start: tuple, goal: tuple, edges: Dict[tuple, set]) -> bool:
    seen, todo = set(), list(edges.get(start, ()))
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    return False


def _prune(schema: Any, link) -> Any:
    """`schema` with its references to cyclic definitions pointing one level down (`link`: the
    new reference of (target, reference), None where that level cannot be reached), and what a cut reference makes of
    it: None where it cannot be satisfied. Raises _Unbounded where a cut falls in a keyword this
    does not reason about."""
    if isinstance(schema, list):
        return [_prune(item, link) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        target = _target(schema["$ref"])
        new = link(target, schema["$ref"])
        if new is None:
            return None
        schema["$ref"] = new
    for key in list(schema):
        value = schema[key]
        if key in DATA_KEYS or key == "$ref" or not isinstance(value, (dict, list)):
            continue
        if key == "properties" and isinstance(value, dict):
            for prop in list(value):
                sub = _prune(value[prop], link)
                if sub is None:
                    if prop in (schema.get("required") or []):
                        return None
                    sub = False  # left out
                value[prop] = sub
        elif key in ("anyOf", "oneOf") and isinstance(value, list):
            kept = [sub for sub in (_prune(v, link) for v in value) if sub is not None]
            if not kept:
                return None
            schema[key] = kept
        elif key == "allOf" and isinstance(value, list):
            kept = [_prune(v, link) for v in value]
            if any(sub is None for sub in kept):
                return None
            schema[key] = kept
        elif key == "items" and isinstance(value, dict):
            sub = _prune(value, link)
            if sub is None:
                if schema.get("minItems", 0) > 0:
                    return None
                schema["maxItems"] = 0  # left empty
                sub = False
            schema[key] = sub
        elif key == "additionalProperties" and isinstance(value, dict):
            sub = _prune(value, link)
            schema[key] = False if sub is None else sub
        else:
            sub = _prune(value, link)
            if sub is None or (isinstance(sub, list) and any(x is None for x in sub)) or (
                    isinstance(sub, dict) and any(x is None for x in sub.values())):
                raise _Unbounded(key)
            schema[key] = sub
    return schema
