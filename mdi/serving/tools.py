"""OpenAI's function calling on chat: the `tools`, `tool_choice` and `parallel_tool_calls`
fields, the messages that carry calls (assistant `tool_calls`) and results (`role: "tool"`),
the format a model writes its calls in (by template family, decided here once), and how the
chat template gets all of it.

A template that renders tools itself (Qwen2.5, Qwen3, Llama 3.x, Hermes) gets them as
transformers' apply_chat_template passes them: `tools=[...]` and the messages as they are,
with each call's arguments as an object. Any other template (SmolLM2's ChatML, the fallback)
gets what llama.cpp's "generic" handler does: the tools and the reply format in a system
message, earlier calls written out as the assistant's text, results as user messages.
Parsing the answer is `tool_calls`; constraining it is `tool_grammar`.
"""
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from mdi.model.tokenizers import Tokenizer
from mdi.serving.strict_schema import strict_violation

MAX_TOOLS = 128  # OpenAI's limit
MAX_CALLS_IN_MESSAGE = 128
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_KEYS, FUNCTION_KEYS = ("type", "function"), ("name", "description", "parameters", "strict")
CHOICES = ("auto", "none", "required")
# what a schema may say of an object's keys: one saying none of these takes no arguments
KEY_KEYWORDS = ("properties", "additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames",
                "required", "minProperties", "maxProperties", "anyOf", "oneOf", "allOf", "$ref", "$dynamicRef",
                "$recursiveRef", "if", "not", "dependentSchemas", "dependentRequired", "dependencies", "enum", "const")
# The template families by the calls their models write (tool_calls.FAMILIES parses each).
HERMES, LLAMA3, GENERIC = "hermes", "llama3", "generic"


class ToolError(ValueError):
    """A bad tools field or tool message: `validation` and `prompts` answer it as a 400 naming
    `param` (the full path, as the messages' errors name it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__("'%s': %s" % (param, message))
        self.param = param


def _bad(param: str, message: str) -> ToolError:
    return ToolError(param, message)


# --- the request fields ------------------------------------------------------------------

def check_tools(value: List[Any], _: Dict[str, Any]) -> List[Dict[str, Any]]:
    """`tools`, each as {"type": "function", "function": {name, description, parameters, strict}}
    with parameters an object schema (a valid JSON schema where jsonschema is installed)."""
    if len(value) > MAX_TOOLS:
        raise _bad("tools", "at most %d tools" % MAX_TOOLS)
    tools, names = [], set()
    for i, tool in enumerate(value):
        where = "tools[%d]" % i
        if not isinstance(tool, dict) or set(tool) - set(TOOL_KEYS):
            raise _bad(where, 'expected {"type": "function", "function": {...}}')
        if tool.get("type") != "function":
            raise _bad(where + ".type", 'only "function" tools are supported, got %s' % json.dumps(tool.get("type"))[:40])
        fn = tool.get("function")
        if not isinstance(fn, dict) or set(fn) - set(FUNCTION_KEYS):
            raise _bad(where + ".function", "expected an object with name, description, parameters, strict")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad(where + ".function.name", "expected 1 to 64 letters, digits, '_' or '-', got %s"
                       % json.dumps(name)[:70])
        if name in names:
            raise _bad(where + ".function.name", "%r is listed twice" % name)
        names.add(name)
        if not isinstance(fn.get("description") or "", str) or fn.get("strict") is not None \
                and not isinstance(fn["strict"], bool):  # null: absent, as OpenAI's schema allows
            raise _bad(where + ".function", "description: expected a string; strict: true or false")
        params = fn.get("parameters")
        params = {} if params is None else _object_schema(params, where)
        # No parameters, {} and {"type": "object"} (MCP tools without input, several SDKs) say
        # nothing of keys: a function taking none, as OpenAI reads them. Left open, SmolLM2 filled
        # {} with the reply format's example ({"arg1": "some_value"}), and strict mode let it through.
        takes_none = not any(key in params for key in KEY_KEYWORDS)
        params = dict(params, type="object", properties={}) if takes_none else params
        if fn.get("strict"):
            broken = strict_violation(dict(params, additionalProperties=False) if takes_none else params)
            if broken is not None:
                raise _bad(where + ".function.parameters", broken)
        entry: Dict[str, Any] = {"name": name}  # in OpenAI's order: templates list them as they are
        if fn.get("description"):
            entry["description"] = fn["description"]
        entry["parameters"] = params
        if fn.get("strict"):
            entry["strict"] = True
        tools.append({"type": "function", "function": entry})
    return tools


def _object_schema(schema: Any, where: str) -> Dict[str, Any]:
    param = where + ".function.parameters"
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise _bad(param, 'expected a JSON schema of an object ({"type": "object", ...})')
    try:
        from jsonschema import SchemaError
        from jsonschema.validators import validator_for
    except ImportError:  # structural checks only
        if not isinstance(schema.get("properties", {}), dict) or not isinstance(schema.get("required", []), list):
            raise _bad(param, "properties: expected an object; required: a list")
        return schema
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise _bad(param, "not a valid JSON schema: %s" % e.message[:200])
    except RecursionError:  # jsonschema walks a schema by recursion; the body's own limit is deeper
        raise _bad(param, "nested too deeply to check")
    return schema


def check_tool_choice(value: Any, checked: Dict[str, Any]) -> Any:
    """"auto", "none", "required", {"type": "function", "function": {"name": one of tools}}, or
    {"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [such
    functions]}}: OpenAI's way to let the answer call some of the tools only, all of them still
    in the prompt (which a prefix cache keeps)."""
    names = [t["function"]["name"] for t in checked["tools"]]
    if isinstance(value, str):
        if value not in CHOICES:
            raise _bad("tool_choice", 'expected "auto", "none", "required" or {"type": "function", ...}')
        if value == "required" and not names:
            raise _bad("tool_choice", '"required" needs tools')
        return value
    if value.get("type") == "allowed_tools":
        return _allowed_tools(value, names)
    return {"type": "function", "function": {"name": _function_name(value, names, "tool_choice")}}


def _function_name(value: Any, names: List[str], where: str, exact: bool = True) -> str:
    """The name in {"type": "function", "function": {"name": one of `names`}}; not `exact`: the
    function may carry more (a whole tool, as clients send allowed_tools)."""
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or value.get("type") != "function" or not isinstance(fn.get("name"), str) \
            or exact and (set(value) - {"type", "function"} or set(fn) != {"name"}):
        raise _bad(where, 'expected {"type": "function", "function": {"name": ...}}')
    if fn["name"] not in names:
        raise _bad(where, "no tool named %s in tools" % json.dumps(fn["name"])[:70])
    return fn["name"]


def _allowed_tools(value: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
    inner = value.get("allowed_tools")
    if set(value) != {"type", "allowed_tools"} or not isinstance(inner, dict) or set(inner) != {"mode", "tools"}:
        raise _bad("tool_choice", 'expected {"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}')
    if inner["mode"] not in ("auto", "required"):
        raise _bad("tool_choice.allowed_tools.mode", 'expected "auto" or "required"')
    if not isinstance(inner["tools"], list) or not inner["tools"]:
        raise _bad("tool_choice.allowed_tools.tools", "expected a list of one or more tools")
    allowed = [_function_name(t, names, "tool_choice.allowed_tools.tools[%d]" % i, exact=False)
               for i, t in enumerate(inner["tools"])]
    tools = [{"type": "function", "function": {"name": n}} for n in dict.fromkeys(allowed)]  # (each once)
    return {"type": "allowed_tools", "allowed_tools": {"mode": inner["mode"], "tools": tools}}


def answer_is_calls(choice: Any) -> bool:
    """Whether a checked tool_choice leaves the answer no text: "required", a named function, or
    allowed tools in "required" mode."""
    if isinstance(choice, dict):
        return choice["type"] == "function" or choice["allowed_tools"]["mode"] == "required"
    return choice == "required"


@dataclass(frozen=True)
class ToolChoice:
    """What one request offers and asks: the functions the model may call, and the rule."""
    tools: List[Dict[str, Any]]  # checked OpenAI tool dicts
    mode: str  # "auto", "required" or "named"
    name: Optional[str]  # the named function ("named" only)
    parallel: bool  # more than one call allowed
    legacy: bool = False  # asked with the legacy `functions`: answered as one `function_call`
    allowed: Optional[Tuple[str, ...]] = None  # the only functions the answer may call (allowed_tools)

    @property
    def functions(self) -> List[Dict[str, Any]]:
        """The functions the answer may call."""
        fns = [t["function"] for t in self.tools]
        may = (self.name,) if self.mode == "named" else self.allowed
        return fns if may is None else [f for f in fns if f["name"] in may]


def parallel_default(fmt: "ToolFormat") -> bool:
    """parallel_tool_calls when the request leaves it out: llama.cpp's rule, what the template
    supports. Only a template that renders tools itself in the Hermes/Qwen format lists several
    calls in one message; Llama 3.x templates take one, and a template with no tool format
    (SmolLM2's, the fallback) none: free to add calls, a small model there called a
    parameterless tool again and again until max_tokens."""
    return fmt.native and fmt.family == HERMES


def asked_tools(fields: Dict[str, Any]) -> Tuple[Any, Any, bool]:
    """(the tools offered, the choice asked, whether in the legacy shape) of the checked chat
    fields: the legacy `functions` and `function_call` read as tools and tool_choice."""
    legacy = bool(fields.get("functions"))
    tools = fields["functions"] if legacy else fields.get("tools")
    choice = (fields.get("function_call") if legacy else fields.get("tool_choice")) or "auto"
    return tools, choice, legacy


def tool_choice_of(fields: Dict[str, Any], fmt: "ToolFormat") -> Optional[ToolChoice]:
    """The checked chat fields' tool request (the legacy `functions` and `function_call` as
    tools); None when there are no tools or the choice is "none"."""
    tools, choice, legacy = asked_tools(fields)
    if not tools or choice == "none":
        return None
    parallel = fields.get("parallel_tool_calls")
    named = isinstance(choice, dict) and choice["type"] == "function"
    if legacy:
        parallel = False  # a legacy message holds one function_call
    elif parallel is None:  # a named function: one call of it, as OpenAI and vLLM answer (Instructor counts on one)
        parallel = parallel_default(fmt) and not named
    if named:
        return ToolChoice(tools, "named", choice["function"]["name"], parallel, legacy)
    if isinstance(choice, dict):
        allowed = choice["allowed_tools"]
        return ToolChoice(tools, allowed["mode"], None, parallel, legacy,
                          tuple(t["function"]["name"] for t in allowed["tools"]))
    return ToolChoice(tools, choice, None, parallel, legacy)


# --- messages that carry calls and results -------------------------------------------------

def tool_message(m: Dict[str, Any], role: str, content: Any, where: str) -> Dict[str, Any]:
    """A `role: "tool"` message (tool_call_id, content) or an assistant message with
    `tool_calls` (content may be null), as the template gets it."""
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            raise _bad(where + ".tool_call_id", "a tool message needs the id of the call it answers")
        if not isinstance(content, str):
            raise _bad(where + ".content", "expected a string")
        if m.get("tool_calls") is not None:
            raise _bad(where + ".tool_calls", "only assistant messages carry tool calls")
        return {"role": "tool", "tool_call_id": m["tool_call_id"], "content": content}
    if role != "assistant":
        raise _bad(where + ".tool_calls", "only assistant messages carry tool calls")
    if content is not None and not isinstance(content, str):
        raise _bad(where + ".content", "expected a string or null")
    calls = m["tool_calls"]
    if not isinstance(calls, list) or not 0 < len(calls) <= MAX_CALLS_IN_MESSAGE:
        raise _bad(where + ".tool_calls", "expected a list of 1 to %d calls" % MAX_CALLS_IN_MESSAGE)
    return {"role": "assistant", "content": content or "",
            "tool_calls": [_call(c, "%s.tool_calls[%d]" % (where, j)) for j, c in enumerate(calls)]}


def check_answered_calls(messages: List[Dict[str, Any]]) -> None:
    """ToolError where a tool message (as tool_message made it) answers no call of the
    assistant message before it (only other tool messages between), as OpenAI refuses it: an
    agent that lost its call ids gets a 400 naming the message, not an answer to a history the
    model cannot follow. Calls sent without an id (clients that never had them) match any."""
    calls = None  # type: Optional[List[str]]
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if calls is None:
                raise _bad("messages[%d]" % i, "a tool message must answer a call of the assistant message before it "
                                              "(that message has no tool_calls)")
            if m["tool_call_id"] not in calls and "" not in calls:
                raise _bad("messages[%d].tool_call_id" % i, "%r is not the id of a call in the assistant message before "
                                                            "it" % m["tool_call_id"][:64])
            continue
        calls = [c["id"] for c in m["tool_calls"]] if m["role"] == "assistant" and m.get("tool_calls") else None


def _call(c: Any, where: str) -> Dict[str, Any]:
    # index (the SDK's stream helper) and parsed_arguments (its parse helpers) come back too: ignored
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or c.get("type", "function") != "function" \
            or set(c) - {"id", "type", "function", "index"} or not isinstance(c.get("index", 0), int) \
            or not isinstance(c.get("id", ""), str) or not isinstance(fn.get("name"), str) \
            or not isinstance(fn.get("arguments"), str) or set(fn) - {"name", "arguments", "parsed_arguments"}:
        raise _bad(where, 'expected {"id": string, "type": "function", "function": {"name": string, '
                          '"arguments": JSON text}}')
    try:  # templates write the arguments with `tojson`: an object, as transformers expects
        arguments: Any = json.loads(fn["arguments"])
    except ValueError:
        arguments = fn["arguments"]
    return {"id": c.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


# --- the template family -----------------------------------------------------------------

@dataclass(frozen=True)
class ToolFormat:
    family: str  # HERMES, LLAMA3 or GENERIC: how the model writes its calls
    native: bool  # the template renders tools, calls and results itself
    python_tag: bool  # Llama 3.x: the tokenizer has <|python_tag|>, which may open a call


def single_token(tokenizer: Tokenizer, text: str) -> Optional[int]:
    """The id of the one token `text` encodes to; None where it is not one token."""
    try:  # without BOS: a tokenizer that adds one (Llama 3's) would make it two
        ids = tokenizer.encode_plain(text)
    except Exception:  # a vocabulary without those characters (a char tokenizer)
        return None
    return ids[0] if len(ids) == 1 else None


def tool_format(template: Optional[str], tokenizer: Tokenizer) -> ToolFormat:
    """The family, from the template's text and the tokenizer's special tokens (the one place
    that decides it): Hermes/Qwen2.5/Qwen3 write <tool_call> blocks, Llama 3.x a bare JSON
    object, any other model the generic JSON reply the fallback rendering asks for."""
    text = template or ""
    python_tag = single_token(tokenizer, "<|python_tag|>") is not None
    if "<tool_call>" in text or single_token(tokenizer, "<tool_call>") is not None:
        family = HERMES
    elif "<|start_header_id|>" in text or python_tag:
        family = LLAMA3
    else:
        family = GENERIC
    native = family != GENERIC and "tools" in text and "tool_calls" in text
    return ToolFormat(family, native, python_tag)


def call_text(family: str, name: str, arguments: Any) -> str:
    """One call as the family's models write it."""
    if family == HERMES:
        return '<tool_call>\n{"name": %s, "arguments": %s}\n</tool_call>' % (json.dumps(name), json.dumps(arguments))
    if family == LLAMA3:
        return '{"name": %s, "parameters": %s}' % (json.dumps(name), json.dumps(arguments))
    return json.dumps({"tool_calls": [{"name": name, "arguments": arguments}]})


REPLY_FORMAT = {
    HERMES: "For each function call, reply with a JSON object with the function's name and arguments within "
            "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>",
    LLAMA3: "To call a function, reply with JSON in the format {\"name\": function name, \"parameters\": "
            "dictionary of argument name and its value}. Do not use variables.",
    GENERIC: "Reply in JSON, either with \"tool_calls\" (a request to call tools) or with \"response\" (your "
             "reply to the user), for example:\n{\"tool_calls\": [{\"name\": \"tool_name\", \"arguments\": "
             "{\"arg1\": \"some_value\"}}]}\nor\n{\"response\": \"your reply\"}",
}


def template_inputs(messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]],
                    fmt: ToolFormat) -> Tuple[List[Dict[str, Any]], Optional[List[Dict[str, Any]]]]:
    """(messages, tools) for the template: as they are where it renders tools itself, else
    with the tools and reply format in the system message and calls and results as text."""
    if fmt.native:
        return messages, tools
    out: List[Dict[str, Any]] = []
    results = False  # the last message out holds tool results
    for m in messages:
        if m["role"] == "tool":
            result = ("<tool_response>\n%s\n</tool_response>" % m["content"] if fmt.family == HERMES else
                      json.dumps({"tool_response": {"tool_call_id": m["tool_call_id"], "content": m["content"]}}))
            if results:  # a parallel call's results in one user turn, as Qwen's template puts them
                out[-1] = dict(out[-1], content=out[-1]["content"] + "\n" + result)
            else:
                out.append({"role": "user", "content": result})
            results = True
            continue
        if results and m["role"] == "user" and isinstance(m.get("content"), str):
            # a user's words after the results join their turn: templates that insist on user and
            # assistant taking turns (Gemma 3's) refused two user turns in a row
            out[-1] = dict(out[-1], content=out[-1]["content"] + "\n\n" + m["content"])
            results = False
            continue
        results = False
        if m.get("tool_calls"):
            texts = [call_text(fmt.family, c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + texts)})
        else:
            out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = "You can call the following tools:\n<tools>\n%s\n</tools>\n\n%s" % (listing, REPLY_FORMAT[fmt.family])
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + system)
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None
