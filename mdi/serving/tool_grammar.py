"""The grammar a request's tool calls must obey (llguidance's Lark dialect, each call's
arguments as `%json` of the function's `parameters`), for the constrained sampler
(mdi/model/constraints/constraint.py) through `Request.grammar`.

What is constrained (as llama.cpp's handlers do, whatever `strict` says):
  tool_choice "required" or a named function: the whole answer is one call (one or more with
    parallel_tool_calls, except Llama 3.x, whose templates take one call per message), in the
    family's format, every function's arguments obeying its schema;
  "auto" (the default with tools): a call or text, never a half-call. Hermes: free text, and
    from "<tool_call>" on a call (llguidance's lazy trigger), text after the calls holding no
    other "<tool_call>"; Llama 3.x: a call, or text that holds nothing a parser would read as
    one (no '{"name"'); generic: the JSON reply, a call or {"response": text}, as llama.cpp.
    With response_format (json_object, json_schema; or llama.cpp's top-level json_schema) the
    text is that JSON instead (generic: the value of "response"). With `grammar` or `regex`
    the client's grammar shapes the whole answer and calls are parsed from it (None here).
A strict function's arguments obey its schema wholly (keywords llguidance cannot enforce are
refused); a non-strict one's as plain JSON Schema (strict: false: those keywords are ignored).
"""
import json
from typing import Any, Dict, List, Optional, Tuple

from mdi.model.constraints.constraint import json_options
from mdi.model.constraints.grammar_spec import GrammarSpec
from mdi.model.constraints.schema_bounds import DATA_KEYS, DEF_MAPS, BoundsError, bounded
from mdi.serving.tools import HERMES, LLAMA3, ToolChoice, ToolFormat
from mdi.serving.validation import ApiError

# Text that holds no call a parser would read (tool_calls.STARTS), per family.
HERMES_REST = r'/(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/'
LLAMA3_TEXT = r'/[^{](.|\n)*/ & ~/(.|\n)*\{\s*"name"(.|\n)*/'  # "{" first: read as a call


def _json(schema: Dict[str, Any], strict: bool) -> str:
    """`%json` of `schema`, its spacing response_format's, keywords llguidance cannot enforce
    refused (strict) or ignored; the schema's own "x-guidance" options win."""
    options = dict(json_options(strict), **(schema.get("x-guidance") or {}))
    return "%json " + json.dumps(dict(schema, **{"x-guidance": options}))


def _call(fn: Dict[str, Any], args_key: str) -> str:
    """One call's JSON: its name, then its arguments obeying the function's parameters."""
    params = bounded(fn["parameters"])
    # The parameters' references are to their own root: their definitions move to the call's
    # root (where "#/$defs/..." now points) and other local pointers go under args_key.
    defs = {k: params.pop(k) for k in DEF_MAPS if isinstance(params, dict) and k in params}
    params, defs = _rebased(params, args_key), _rebased(defs, args_key)
    return _json(dict({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                       "required": ["name", args_key], "additionalProperties": False}, **defs),
                 bool(fn.get("strict")))


def _rebased(schema: Any, args_key: str) -> Any:
    """`schema` with its local references other than to definitions under /properties/args_key."""
    if isinstance(schema, list):
        return [_rebased(item, args_key) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")) \
                and not any(value.startswith("#/%s/" % k) for k in DEF_MAPS):
            value = "#/properties/%s%s" % (args_key, value[1:])
        elif key not in DATA_KEYS:
            value = _rebased(value, args_key)
        out[key] = value
    return out


def _text(spec: Optional[GrammarSpec]) -> Optional[str]:
    """The JSON the text must be (response_format's), or None: free text."""
    if spec is None:
        return None
    try:
        schema = {"type": "object"} if spec.kind == "json_object" else bounded(json.loads(spec.text))
    except BoundsError as e:
        raise ApiError(400, "'%s': %s" % (spec.field, e), spec.field) from None
    return _json(schema, spec.strict and spec.kind == "json_schema")


def _lit(text: str) -> str:
    return json.dumps(text)


def parameter_specs(choice: ToolChoice) -> List[Tuple[str, GrammarSpec]]:
    """Each function's name and its parameters as a grammar of their own, for the server to
    compile alone: one no text satisfies shows at once there, where inside the call's grammar it
    showed only once a sample reached it (a 503 after seconds of holding a slot)."""
    specs = []
    for f in choice.functions:
        try:
            specs.append((f["name"], GrammarSpec("json_schema", json.dumps(bounded(f["parameters"])), "tools",
                                                 bool(f.get("strict")))))
        except BoundsError as e:
            raise _refused(f, e) from None
    return specs


def _refused(function: Dict[str, Any], error: BoundsError) -> ApiError:
    return ApiError(400, "'tools': function %r's parameters: %s" % (function["name"][:64], error), "tools")


def tool_grammar(choice: Optional[ToolChoice], fmt: ToolFormat,
                 output: Optional[GrammarSpec] = None) -> Optional[GrammarSpec]:
    """The grammar for `choice`'s answers, or None where they are free (no tools; auto with a
    client's own `grammar` or `regex`); `output`: the request's response_format (or grammar),
    what an auto answer's text obeys. A 400 naming `tools` where llguidance refuses a schema."""
    if choice is None:
        return None
    required = choice.mode != "auto"
    if not required and output is not None and output.kind not in ("json_schema", "json_object"):
        return None
    args_key = "parameters" if fmt.family == LLAMA3 else "arguments"
    calls = []
    for f in choice.functions:
        try:
            calls.append(_call(f, args_key))
        except BoundsError as e:
            raise _refused(f, e) from None
    text = None if required else _text(output)
    lines = ["%llguidance {}"] + ["call%d: %s" % (i, c) for i, c in enumerate(calls)]
    lines.append("body: " + " | ".join("call%d" % i for i in range(len(calls))))
    if fmt.family == HERMES:
        lines.append('call: "<tool_call>\\n" body "\\n</tool_call>"')
        calls_rule = "call" + (' ("\\n" call)*' if choice.parallel else "")
        if required:
            lines.append("start: " + calls_rule)
        elif text is not None:  # the calls, or response_format's JSON
            lines += ["start: %s | json_text" % calls_rule, "json_text: " + text]
        else:  # free text; once it writes <tool_call>, a call (lazy: the text stops at the marker)
            lines += ["start: tagged%s REST" % ("*" if choice.parallel else "?"), "REST: " + HERMES_REST,
                      'head[lazy]: /(.|\\n)*/ "<tool_call>"', 'tagged: head "\\n" body "\\n</tool_call>"']
    elif fmt.family == LLAMA3:
        lines.append("call: " + ("<|python_tag|> body | body" if fmt.python_tag else "body"))
        if required:
            lines.append("start: call")
        elif text is not None:
            lines += ["start: call | json_text", "json_text: " + text]
        else:
            lines += ["start: call | TEXT", "TEXT: " + LLAMA3_TEXT]
    else:  # llama.cpp's generic reply, in response_format's spacing
        lines.append('calls: %s body %s%s' % (_lit('{"tool_calls": ['), ('(%s body)* ' % _lit(", "))
                                              if choice.parallel else "", _lit("]}")))
        if required:
            lines.append("start: calls")
        else:
            lines += ["start: calls | %s response %s" % (_lit('{"response": '), _lit("}")),
                      "response: " + (text or _json({"type": "string"}, True))]
    grammar = "\n".join(lines) + "\n"
    error = grammar_error(grammar)
    if error:
        raise ApiError(400, "'tools': the functions' schemas cannot be compiled: %s" % error[:300], "tools")
    return GrammarSpec("lark", grammar, "tools")


def grammar_error(lark: str) -> str:
    """llguidance's complaint about `lark` ("" where it compiles, or where llguidance is not
    installed: the constrained sampler then refuses the request itself)."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        return ""
    return LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark))
