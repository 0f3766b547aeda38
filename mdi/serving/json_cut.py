"""JSON cut short, told from malformed JSON: a model's answer stopped by max_tokens or a stop
string may end inside the JSON of a call or a reply (mdi.serving.tool_calls), which must then be
dropped or read as far as it goes, where malformed JSON stays text."""
import json
import re
from typing import Any, List, Optional

JSON = json.JSONDecoder()
# JSON's tokens, for telling JSON cut short from malformed JSON (`cut_short`)
_STRING = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'  # a string's opening and its characters
_TOKEN = re.compile(r'\s*(?:(%s")|(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null)|([{}\[\]:,]))'
                    % _STRING)
_PARTIAL_KEY = re.compile(r'\s*(?:%s(?:\\(?:u[0-9a-fA-F]{0,3})?)?)?' % _STRING)  # a key cut short, or none yet
_PARTIAL_VALUE = re.compile(r'\s*(?:%s(?:\\(?:u[0-9a-fA-F]{0,3})?)?|-|-?(?:0|[1-9][0-9]*)(?:\.[0-9]*)?'
                            r'(?:[eE][+-]?[0-9]*)?|t(?:ru?)?|f(?:a(?:ls?)?)?|n(?:ul?)?)?' % _STRING)  # cut, or none
STRING_SO_FAR = re.compile(r'(%s)(.*)' % _STRING, re.S)
CLOSES = {"}": "{", "]": "["}  # a closing bracket's opening one
_PARTIAL = {"value": _PARTIAL_VALUE, "key": _PARTIAL_KEY, "colon": re.compile(r"\s*"), "more": re.compile(r"\s*")}


def cut_short(text: str, pos: int) -> bool:
    """Whether text[pos:] is JSON cut short: nothing yet, or the start of a value that more
    text would complete; neither a whole value nor malformed. A loop, not recursion: a
    model's deep nesting cannot exhaust the stack."""
    stack: List[str] = []  # the open "{" and "["
    want, first = "value", False  # what may come next; just after "{" or "[" (it may close at once)
    while not _PARTIAL[want].fullmatch(text, pos):  # else the end, inside a token or between two
        m = _TOKEN.match(text, pos)
        want = "" if m is None else _json_next(want, first, stack, m)
        if m is None or not want:  # malformed, or a whole value
            return False
        first, pos = m.group(3) in ("{", "["), m.end()
    return True


def _json_next(want: str, first: bool, stack: List[str], m: Any) -> str:
    """What may follow the token `m` read where `want` was expected ("" where it may not
    stand there, or where it ends the whole value); `stack` follows the brackets."""
    string, scalar, mark = m.group(1), m.group(2), m.group(3) or ""
    if want == "key" and string is not None:
        return "colon"
    if want == "colon" and mark == ":":
        return "value"
    if want == "more" and mark == ",":
        return "key" if stack[-1] == "{" else "value"
    if want == "value" and mark in ("{", "["):
        stack.append(mark)
        return "key" if mark == "{" else "value"
    closes = mark in CLOSES and bool(stack) and stack[-1] == CLOSES[mark] and (want == "more" or first)
    if closes:
        stack.pop()
    elif not (want == "value" and (string is not None or scalar is not None)):
        return ""
    return "more" if stack else ""  # a value ended; the whole one: not cut


def string_so_far(value: str) -> Optional[str]:
    """A JSON string's characters up to where it was cut, decoded (a cut escape, or half a
    surrogate pair, left out); None where it is not a string alone."""
    m = STRING_SO_FAR.match(value)
    if m is None:
        return None
    head, rest = m.groups()
    if rest.startswith('"') and rest[1:].strip():
        return None  # more JSON after the string: not a reply's text
    if not rest.startswith('"') and not re.fullmatch(r"(?:\\(?:u[0-9a-fA-F]{0,3})?)?", rest):
        return None
    text = JSON.decode(head + '"')
    return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text
