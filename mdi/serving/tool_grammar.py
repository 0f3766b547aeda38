"""The grammar a request's tool calls must obey (llguidance's Lark dialect, each call's
arguments as `%json` of the function's `parameters`), for the constrained sampler
(mdi/model/constraint.py) through `Request.grammar`.

What is constrained:
  tool_choice "required" or a named function: the whole answer is one call (one or more with
    parallel_tool_calls, except Llama 3.x, whose templates take one call per message), in the
    family's format, every function's arguments obeying its schema;
  "auto" with a `strict` function: free text, and from the family's call marker on a call
    (Hermes: llguidance's lazy trigger on "<tool_call>"; Llama 3.x: text that does not open
    with "{", or a call; generic: the JSON reply, a call or {"response": text}, as llama.cpp
    does); only strict functions' arguments obey their schemas there;
  "auto" without a strict function: nothing; the answer is parsed as it comes (`tool_calls`).
"""
import json
from typing import Any, Dict, List, Optional

from mdi.model.constraint import json_options
from mdi.model.grammar_spec import GrammarSpec
from mdi.model.schema_bounds import BoundsError, bounded
from mdi.serving.tools import HERMES, LLAMA3, ToolChoice, ToolFormat
from mdi.serving.validation import ApiError

ANY_OBJECT: Dict[str, Any] = {"type": "object"}


def _call_schema(fn: Dict[str, Any], args_key: str, schema: bool) -> Dict[str, Any]:
    """One call's JSON: its name, then its arguments (the function's schema where `schema`)."""
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             args_key: bounded(fn["parameters"]) if schema else ANY_OBJECT},
            "required": ["name", args_key], "additionalProperties": False}


def _one_of(schemas: List[Dict[str, Any]]) -> Dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def tool_grammar(choice: Optional[ToolChoice], fmt: ToolFormat) -> Optional[GrammarSpec]:
    """The grammar for `choice`'s answers, or None where they are free (no tools, auto with
    nothing strict); a 400 naming `tools` where llguidance refuses a schema."""
    if choice is None:
        return None
    required = choice.mode != "auto"
    if not required and not any(f.get("strict") for f in choice.functions):
        return None
    args_key = "parameters" if fmt.family == LLAMA3 else "arguments"
    try:
        calls = _one_of([_call_schema(f, args_key, required or bool(f.get("strict"))) for f in choice.functions])
    except BoundsError as e:
        raise ApiError(400, "'tools': %s" % e, "tools") from None
    # The JSON's spacing as response_format's; a non-strict function's schema is followed as far
    # as llguidance can (keywords it cannot enforce are ignored), a strict one's wholly or not at all.
    options = {"x-guidance": json_options(all(f.get("strict") for f in choice.functions
                                              if required or f.get("strict")))}
    body = "%json " + json.dumps(dict(calls, **options))
    lines = ["%llguidance {}"]
    if fmt.family == HERMES:
        lines += ['call: "<tool_call>\\n" body "\\n</tool_call>"', "body: " + body]
        if required:
            lines.insert(1, "start: call" + (' ("\\n" call)*' if choice.parallel else ""))
        else:  # free text; once it writes <tool_call>, a call (lazy: the text stops at the marker)
            lines += ["start: tagged%s TEXT" % ("*" if choice.parallel else "?"), "TEXT: /(.|\\n)*/",
                      'head[lazy]: TEXT "<tool_call>"', 'tagged: head "\\n" body "\\n</tool_call>"']
    elif fmt.family == LLAMA3:
        lines += ["call: " + ("<|python_tag|> body | body" if fmt.python_tag else "body"), "body: " + body]
        lines.insert(1, "start: call" if required else "start: TEXT | call")
        if not required:
            lines.append("TEXT: /[^{](.|\\n)*/")  # text that opens with "{" would be read as a call
    else:
        many: Dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if not choice.parallel:
            many["maxItems"] = 1
        reply = {"type": "object", "properties": {"tool_calls": many}, "required": ["tool_calls"],
                 "additionalProperties": False}
        if not required:
            reply = {"anyOf": [reply, {"type": "object", "properties": {"response": {"type": "string"}},
                                       "required": ["response"], "additionalProperties": False}]}
        lines.append("start: %json " + json.dumps(dict(reply, **options)))
    text = "\n".join(lines) + "\n"
    error = grammar_error(text)
    if error:
        raise ApiError(400, "'tools': the functions' schemas cannot be compiled: %s" % error[:300], "tools")
    return GrammarSpec("lark", text, "tools")


def grammar_error(lark: str) -> str:
    """llguidance's complaint about `lark` ("" where it compiles, or where llguidance is not
    installed: the constrained sampler then refuses the request itself)."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        return ""
    return LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark))
