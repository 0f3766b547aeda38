"""What a request asks its output to obey, before any library compiles it: a JSON schema, a
grammar or a regex, with the request field it came from (errors name that field)."""
from dataclasses import dataclass

# llguidance's Lark dialect is the one grammar kind the compiler takes natively; the others are
# turned into it (GBNF) or given to it as they are (JSON schema, regex).
GRAMMAR_KINDS = ("json_schema", "json_object", "lark", "gbnf", "regex")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KINDS
    text: str  # the schema as JSON text, the grammar or the regex ("" for json_object)
    field: str  # the request field it came from: "response_format", "grammar", "regex", "tools"
    # A JSON schema's keywords the compiler cannot enforce (uniqueItems, not, if/then...):
    # refused (strict, OpenAI's rule for strict schemas) or ignored (best effort, as llama.cpp).
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError("unknown grammar kind %r" % self.kind)
