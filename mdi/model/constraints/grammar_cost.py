"""What a constraint costs per token, bounded before a request is admitted.

A request's token masks are computed on the scheduler's one thread, between every user's
steps: a costly one slows them all. llguidance's mask time grows with counted repetitions
(`a{100000}` in a regex or a schema's `pattern`: ~75 ms a token, nested counts multiply:
`(a{1000}){100}` costs as much; sequential ones add up), so a request whose counts, multiplied
along their nesting, pass MAX_REPEAT, or whose copies added pass MAX_REPEAT_ADDED, is refused at
once. What this count does not see (a grammar's rules that repeat each other) the timed probe in
GrammarCompiler catches: one mask past the start, timed on the request's own thread against
MASK_BUDGET_S, for all of a request's choices (each computes its own mask every step).

Neither sees a grammar that turns costly further on (alternations of counted wildcards build
new lexer states token after token: `(.{10}a|.{22}b|...){3}` started at 1 ms and reached 19).
So every mask during generation is timed too, in CPU time (what it costs the scheduler, however
busy the machine): a sample whose masks take more than MASK_DEADLINE_S (two within SLOW_WINDOW
masks, or one FAR_PAST times it) ends with an error naming its grammar, and the other samples go
on. llguidance holds the GIL while it computes a mask (measured: a thread beside it stalls for
the whole mask), so a worker thread would not free the scheduler; the deadline bounds what one
sample can take instead.
"""
import json
from dataclasses import dataclass
from typing import Any, Iterator, List, Tuple

from mdi.model.constraints.grammar_empty import json_end
from mdi.model.constraints.schema_bounds import DATA_KEYS, SCHEMA_MAPS

MAX_REPEAT = 1000  # the largest product of nested counted repetitions ({n}, {n,m}, {n,})
# The copies all counts add, summed: sequential ones add up (60 of `x{999}y` in a row, each count
# under MAX_REPEAT, cost 13 ms a mask). Measured on SmolLM2's tokens (AVX2, one thread): ~0.2 ms
# a mask per 1,000 copies, linear from 1,000 to 60,000, so this keeps a mask near 2 ms.
MAX_REPEAT_ADDED = 10000
MASK_BUDGET_S = 0.02  # one token mask, measured once before admission (typical ones: < 1 ms)
MASK_DEADLINE_S = 0.05  # any token mask during generation (`serve.mask_deadline_ms` sets it)
SLOW_WINDOW = 64  # a second mask past the deadline within this many masks ends a sample
FAR_PAST = 4  # a mask past this many deadlines ends it at once


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


@dataclass(frozen=True)
class RepeatCost:
    """What a regex's counted repetitions make of it: `largest`, the largest product of counts
    along their nesting (one atom's copies); `added`, the copies every count adds, nested ones
    multiplied, summed over the text (what sizes the lexer: sequential counts add up)."""
    largest: int = 1
    added: int = 0

    def __add__(self, other: "RepeatCost") -> "RepeatCost":  # two regexes in one grammar
        return RepeatCost(max(self.largest, other.largest), self.added + other.added)


def repeat_cost(text: str, quoted: bool = False) -> RepeatCost:
    """The counted repetitions of a regex (or, with `quoted`, of GBNF/Lark text, whose quoted
    literals hold no syntax). An atom's size is 1 plus the copies counts add inside it (a group's
    plain characters and alternatives are not copies: a 20,000-word alternation costs little)."""
    groups: List[List[int]] = [[1, 0]]  # per open group: [the largest product inside it, the copies added in it]
    last, size = 1, 1  # the atom just read: the product inside it, its size
    best, i, n = 1, 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i, last, size = i + 2, 1, 1
        elif ch == "[":  # a character class: one atom
            j = i + 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, last, size = j + 1, 1, 1
        elif quoted and ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i, last, size = j + 1, 1, 1
        elif ch == "(":
            groups.append([1, 0])
            i += 1
        elif ch == ")":
            largest, added = groups.pop() if len(groups) > 1 else (1, 0)
            last, size = largest, 1 + added
            groups[-1][0] = max(groups[-1][0], last)
            groups[-1][1] += added
            i += 1
        elif ch == "{":
            count, i = _count(text, i)
            if count:
                product = count * last
                groups[-1][0] = max(groups[-1][0], product)
                groups[-1][1] += (count - 1) * size
                best = max(best, product)
                last, size = product, count * size
        else:
            i, last, size = i + 1, 1, 1
    return RepeatCost(max([best] + [g[0] for g in groups]), sum(g[1] for g in groups))


def schema_patterns(schema: Any) -> Iterator[str]:
    """Every regex a JSON schema holds: `pattern` values and `patternProperties` keys. Maps of
    named schemas (`properties`...) are walked whatever their names (a property called `enum`
    is a schema), data keywords' values (`enum`, `default`...) are not."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key in SCHEMA_MAPS and isinstance(value, dict):
                if key == "patternProperties":
                    yield from (k for k in value if isinstance(k, str))
                for sub in value.values():
                    yield from schema_patterns(sub)
            elif key not in DATA_KEYS:
                yield from schema_patterns(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from schema_patterns(item)


def embedded_schemas(lark: str) -> Iterator[Any]:
    """The JSON schemas a Lark grammar embeds (`%json {...}`: a tool call's arguments, an
    answer's response_format inside the calls' grammar), whose patterns its text hides in quotes."""
    at = lark.find("%json")
    while at >= 0:
        try:
            end = json_end(lark, at + len("%json"))
            yield json.loads(lark[lark.index("{", at):end])
        except ValueError:  # unbalanced or not JSON: llguidance says what is wrong with it
            return
        at = lark.find("%json", end)


def spec_repeat(kind: str, text: str) -> RepeatCost:
    """The counted repetitions of a GrammarSpec's text (a schema's patterns together: one lexer)."""
    if kind == "regex":
        return repeat_cost(text)
    if kind in ("gbnf", "lark"):
        return sum((repeat_cost(p) for schema in embedded_schemas(text) for p in schema_patterns(schema)),
                   repeat_cost(text, quoted=True))
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError:
            return RepeatCost()  # the compiler says what is wrong with it
        return sum((repeat_cost(p) for p in schema_patterns(schema)), RepeatCost())
    return RepeatCost()
