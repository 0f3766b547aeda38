"""What a constraint costs per token, bounded before a request is admitted.

A request's token masks are computed on the scheduler's one thread, between every user's
steps: a costly one slows them all. llguidance's mask time grows with counted repetitions
(`a{100000}` in a regex or a schema's `pattern`: ~75 ms a token, nested counts multiply:
`(a{1000}){100}` costs as much), so a request whose counts, multiplied along their nesting,
pass MAX_REPEAT is refused at once. What this count does not see (a grammar's rules that
repeat each other) the timed probe in GrammarCompiler catches: one mask past the start,
timed on the request's own thread against MASK_BUDGET_S.

Neither sees a grammar that turns costly further on (alternations of counted wildcards build
new lexer states token after token: `(.{10}a|.{22}b|...){3}` starts at 1 ms and reaches 19).
So every mask during generation is timed too, in CPU time (what it costs the scheduler, however
busy the machine): a sample whose mask takes more than MASK_DEADLINE_S ends with an error naming
its grammar, and the other samples go on. llguidance holds the GIL while it computes a mask
(measured: a thread beside it stalls for the whole mask), so a worker thread would not free the
scheduler; the deadline bounds what one sample can take instead.
"""
import json
from typing import Any, Iterator, List, Tuple

MAX_REPEAT = 1000  # the largest product of nested counted repetitions ({n}, {n,m}, {n,})
MASK_BUDGET_S = 0.02  # one token mask, measured once before admission (typical ones: < 1 ms)
MASK_DEADLINE_S = 0.05  # any token mask during generation (`serve.mask_deadline_ms` sets it)


def _count(text: str, i: int) -> Tuple[int, int]:
    """(the largest count of a `{n}`, `{n,}` or `{n,m}` at text[i] == "{", index past it), or
    (0, i + 1) where it is a literal brace."""
    end = text.find("}", i)
    if end < 0:
        return 0, i + 1
    parts = [p.strip() for p in text[i + 1:end].split(",")]
    if not 1 <= len(parts) <= 2 or not parts[0].isdigit() or (len(parts) == 2 and parts[1] and not parts[1].isdigit()):
        return 0, i + 1
    return max(int(p) for p in parts if p), end + 1


def largest_repeat(text: str, quoted: bool = False) -> int:
    """The largest product of counted repetitions along their nesting in a regex (or, with
    `quoted`, in GBNF/Lark text, whose quoted literals hold no syntax)."""
    depth_max: List[int] = [1]  # per open group: the largest product inside it so far
    last = 1  # the product inside the atom just read (a group's, or 1)
    best, i, n = 1, 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i, last = i + 2, 1
        elif ch == "[":  # a character class: one atom
            j = i + 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, last = j + 1, 1
        elif quoted and ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i, last = j + 1, 1
        elif ch == "(":
            depth_max.append(1)
            i += 1
        elif ch == ")":
            last = depth_max.pop() if len(depth_max) > 1 else 1
            depth_max[-1] = max(depth_max[-1], last)
            i += 1
        elif ch == "{":
            count, i = _count(text, i)
            if count:
                product = count * last
                depth_max[-1] = max(depth_max[-1], product)
                best = max(best, product)
                last = product
        else:
            i, last = i + 1, 1
    return max([best] + depth_max)


def schema_patterns(schema: Any) -> Iterator[str]:
    """Every regex a JSON schema holds: `pattern` values and `patternProperties` keys."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from (k for k in value if isinstance(k, str))
                yield from schema_patterns(value)
            elif key not in ("enum", "const", "examples", "default"):  # data, not schemas
                yield from schema_patterns(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from schema_patterns(item)


def spec_repeat(kind: str, text: str) -> int:
    """The largest nested counted repetition of a GrammarSpec's text (0 where it has none)."""
    if kind == "regex":
        return largest_repeat(text)
    if kind in ("gbnf", "lark"):
        return largest_repeat(text, quoted=True)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError:
            return 0  # the compiler says what is wrong with it
        return max([0] + [largest_repeat(p) for p in schema_patterns(schema)])
    return 0
