"""OpenAI's legacy function calling, still sent by older clients: `functions` (a list of
{name, description, parameters}) and `function_call` ("none", "auto" or {"name": ...}) are
mapped onto `tools` and `tool_choice`, so one code path constrains and parses the calls. A
request in the legacy shape is answered in it (`message.function_call`, `finish_reason:
"function_call"`, streamed as `delta.function_call`), with at most one call, as OpenAI did.
Legacy messages (an assistant's `function_call`, `role: "function"` results) become
tool calls and tool results for the template (`prompts`).
"""
from typing import Any, Dict, List

from mdi.serving.tools import ToolError, check_tool_choice, check_tools


def _renamed(e: ToolError) -> ToolError:
    """A tools error as the legacy field names it ("tools[1].function.name" -> "functions[1].name")."""
    param = e.param.replace("tools", "functions", 1).replace(".function", "", 1)
    message = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
    return ToolError(param, message)


def check_functions(value: List[Any], checked: Dict[str, Any]) -> List[Dict[str, Any]]:
    """`functions` as checked tools (tools.check_tools' shape and rules)."""
    if checked.get("tools"):
        raise ToolError("functions", "send tools or the legacy functions, not both")
    try:
        return check_tools([{"type": "function", "function": f} for f in value], checked)
    except ToolError as e:
        raise _renamed(e) from None


def check_function_call(value: Any, checked: Dict[str, Any]) -> Any:
    """`function_call` as a tool_choice for the legacy functions."""
    if not checked.get("functions"):
        raise ToolError("function_call", "only with functions")
    if checked.get("tool_choice") is not None:
        raise ToolError("function_call", "send tool_choice or the legacy function_call, not both")
    if isinstance(value, str):
        if value not in ("auto", "none"):
            raise ToolError("function_call", 'expected "auto", "none" or {"name": ...}')
        return value
    if set(value) != {"name"} or not isinstance(value["name"], str):
        raise ToolError("function_call", 'expected {"name": ...}')
    try:
        return check_tool_choice({"type": "function", "function": {"name": value["name"]}},
                                 {"tools": checked["functions"]})
    except ToolError as e:
        raise ToolError("function_call", str(e).split(": ", 1)[1].replace("in tools", "in functions")) from None


def legacy_message(m: Dict[str, Any], where: str) -> Dict[str, Any]:
    """A legacy message in the current shape: an assistant's `function_call` as one tool call,
    a `role: "function"` result as a tool message. Legacy calls carry no id: the function's
    name stands for it, which is what ties a result to its call there."""
    if m.get("role") == "function":
        if not isinstance(m.get("name"), str) or not m["name"]:
            raise ToolError(where + ".name", "a function message needs the function's name")
        return {"role": "tool", "tool_call_id": m["name"], "content": m.get("content") or ""}
    call = m["function_call"]
    if m.get("role") != "assistant" or m.get("tool_calls") is not None:
        raise ToolError(where + ".function_call", "only assistant messages without tool_calls carry it")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or set(call) - {"name", "arguments"} \
            or not isinstance(call.get("arguments", "{}"), str):
        raise ToolError(where + ".function_call", 'expected {"name": string, "arguments": JSON text}')
    out = dict(m)
    del out["function_call"]
    out["tool_calls"] = [{"id": call["name"], "type": "function",
                          "function": {"name": call["name"], "arguments": call.get("arguments", "{}")}}]
    return out


def function_call_body(entry: Dict[str, Any]) -> Dict[str, Any]:
    """A tool_calls entry as the legacy `function_call` ({"name", "arguments"})."""
    fn = entry["function"]
    return {"name": fn["name"], "arguments": fn["arguments"]}

