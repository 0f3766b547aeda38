"""Whether a Lark grammar (what llguidance compiles GBNF and Lark requests to) derives any text.

llguidance finds a grammar with no text at its start (`root ::= root "a"`: nothing may come
first) but not one whose first token is fine and whose rest has none (`root ::= "b" y`, `y ::= y
"b"`): a request would then stream "b" and end wherever its budget does. The classic test says
it up front: a rule is productive when one of its alternatives is made only of productive parts
(a literal, a terminal, an optional or repeated-zero-times part, a productive rule), computed
as a fixed point (a worklist); the grammar is empty when `start` is not productive.

Only what it can read is judged: any syntax it does not know (templates, lookarounds, special
tokens) makes the answer "unknown", so a grammar is never refused on a guess. Terminals are
taken as non-empty (llguidance's lexer finds an empty one where it is the only way on).
"""
import re
from typing import AbstractSet, Dict, Iterator, List, Optional, Sequence, Set, Tuple

_TOKEN = re.compile(r'''
    (?P<ws>\s+|//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>-?\d+)
  | (?P<punct>\.\.|->|[:|()\[\]?*+~{},.])
''', re.X)
_DEFINITION = re.compile(r"^[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:", re.M)
_SKIPPED_LINES = ("%llguidance", "%ignore", "%import")

# A parsed rule body: ("alt", [body...]) | ("seq", [body...]) | ("ref", name) | ("yes",)
# (always derives text: a literal, a terminal, an optional part) | ("same", body) (derives
# text when its part does: one or more repeats, a grouping).
Body = Tuple[object, ...]


class Unknown(ValueError):
    """Syntax this check does not read: no verdict."""


def _tokens(text: str) -> List[Tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        if text.startswith("%json", pos):  # an embedded JSON schema: text of its own
            pos = json_end(text, pos + len("%json"))
            out.append(("string", "%json"))
            continue
        m = _TOKEN.match(text, pos)
        if m is None:
            raise Unknown("unknown syntax at %r" % text[pos:pos + 20])
        if m.lastgroup != "ws":
            out.append((m.lastgroup or "", m.group()))
        pos = m.end()
    return out


def json_end(text: str, pos: int) -> int:
    """Where the JSON object starting at the first "{" from `pos` ends (Unknown, a ValueError, where it does not)."""
    start = text.index("{", pos)
    depth, i, in_string = 0, start, False
    while i < len(text):
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise Unknown("unbalanced braces")


class _Parser:
    def __init__(self, tokens: Sequence[Tuple[str, str]]) -> None:
        self.tokens, self.i = list(tokens), 0

    def peek(self) -> Tuple[str, str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else ("end", "")

    def take(self, value: Optional[str] = None) -> Tuple[str, str]:
        tok = self.peek()
        if value is not None and tok[1] != value:
            raise Unknown("expected %r, got %r" % (value, tok[1]))
        self.i += 1
        return tok

    def alternatives(self) -> Body:
        alts = [self.sequence()]
        while self.peek()[1] == "|":
            self.take()
            alts.append(self.sequence())
        return ("alt", alts)

    def sequence(self) -> Body:
        items = []
        while self.peek()[0] != "end" and self.peek()[1] not in ("|", ")", "]"):
            if self.peek()[1] == "->":  # an alias names the alternative: nothing to derive
                self.take()
                self.take()
                continue
            items.append(self.repeated())
        return ("seq", items)

    def repeated(self) -> Body:
        part = self.atom()
        while True:
            op = self.peek()[1]
            if op in ("?", "*"):
                self.take()
                part = ("yes",)
            elif op == "+":
                self.take()
                part = ("same", part)
            elif op == "~":
                self.take()
                low = int(self.take()[1])
                if self.peek()[1] == "..":
                    self.take()
                    self.take()
                part = ("yes",) if low == 0 else ("same", part)
            elif op == "{":
                self.take()
                low = int(self.take()[1]) if self.peek()[0] == "number" else 0
                while self.peek()[1] != "}":
                    if self.peek()[1] not in (",",) and self.peek()[0] != "number":
                        raise Unknown("bad repeat")
                    self.take()
                self.take("}")
                part = ("yes",) if low == 0 else ("same", part)
            else:
                return part

    def atom(self) -> Body:
        kind, value = self.take()
        if value == "(":
            body = self.alternatives()
            self.take(")")
            return ("same", body)
        if value == "[":
            self.alternatives()
            self.take("]")
            return ("yes",)
        if kind == "string":
            if self.peek()[1] == "..":  # a character range "a".."z"
                self.take()
                self.take()
            return ("yes",)
        if kind == "regex":
            return ("yes",)
        if kind == "name":
            after = self.tokens[self.i + 1] if self.i + 1 < len(self.tokens) else ("end", "")
            if self.peek()[1] == "{" and after[0] != "number" and after[1] != ",":  # a template's arguments
                raise Unknown("templates")
            return ("ref", value)
        raise Unknown("unexpected %r" % value)


def _rules(lark: str) -> Dict[str, Body]:
    lines = [line for line in lark.splitlines() if not line.lstrip().startswith(_SKIPPED_LINES)]
    if any(line.lstrip().startswith("%") for line in lines):
        raise Unknown("directives")
    text = "\n".join(lines)
    starts = list(_DEFINITION.finditer(text))
    if not starts or text[:starts[0].start()].strip():
        raise Unknown("no rules")
    rules: Dict[str, Body] = {}
    for k, m in enumerate(starts):
        end = starts[k + 1].start() if k + 1 < len(starts) else len(text)
        parser = _Parser(_tokens(text[m.end():end]))
        body = parser.alternatives()
        if parser.peek()[0] != "end":
            raise Unknown("trailing %r" % parser.peek()[1])
        name = m.group(1)
        rules[name] = ("alt", [rules[name], body]) if name in rules else body
    return rules


def _refs(body: Body) -> Iterator[str]:
    if body[0] == "ref":
        yield body[1]  # type: ignore[misc]
    elif body[0] == "same":
        yield from _refs(body[1])  # type: ignore[arg-type]
    elif body[0] in ("alt", "seq"):
        for part in body[1]:  # type: ignore[attr-defined]
            yield from _refs(part)


def _derives(body: Body, productive: AbstractSet[str]) -> bool:
    kind = body[0]
    if kind == "yes":
        return True
    if kind == "ref":
        return body[1] in productive
    if kind == "same":
        return _derives(body[1], productive)  # type: ignore[arg-type]
    parts: List[Body] = body[1]  # type: ignore[assignment]
    return (any if kind == "alt" else all)(_derives(p, productive) for p in parts)


def derives_text(lark: str, start: str = "start") -> Optional[bool]:
    """False when `lark`'s `start` derives no text at all; True when it does; None when this
    check cannot read the grammar (no verdict)."""
    try:
        rules = _rules(lark)
    except (Unknown, ValueError, IndexError):
        return None
    if start not in rules or any(ref not in rules for body in rules.values() for ref in _refs(body)):
        return None  # a name defined elsewhere (%import): no verdict
    users: Dict[str, Set[str]] = {}  # rule -> the rules that name it
    for name, body in rules.items():
        for ref in _refs(body):
            users.setdefault(ref, set()).add(name)
    # a worklist: a rule is judged again only when a rule it names turns productive (a chain of
    # 8,300 rules, judged all again per round, took 43 s)
    productive: Set[str] = set()
    todo = list(rules)
    while todo:
        name = todo.pop()
        if name not in productive and _derives(rules[name], productive):
            productive.add(name)
            todo.extend(user for user in users.get(name, ()) if user not in productive)
    return start in productive
