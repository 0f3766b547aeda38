"""An answer's tool calls, read from its text in the family's format (`tools`): whole, into
`message.tool_calls`, or as it streams, into `delta.tool_calls` chunks. One parser does both,
so a streamed answer reassembles to the whole one: text that may be the start of a call is
held back until it is a call or cannot be one; text that does not parse as a call (malformed
JSON, an unknown function) stays content; content is trimmed of the space around calls. An
answer cut short (max_tokens, a stop string) inside a call drops that call, never shows it as
text: its complete calls are kept, and a generic {"response": ...} reply gives its text so far.
Where the tool grammar shapes the answer (`stream_reply`), a generic reply's text streams as it is
written: that grammar closes the reply right after its string, so the text cannot turn out to be
anything else.
The markers the parser reads stay in its text when they are control tokens (`control_tokens`);
a <|python_tag|> that opens no call is then left out of the content, as the other control
tokens are."""
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mdi.serving import json_cut
from mdi.serving.legacy_functions import function_call_body
from mdi.serving.streaming import held_back
from mdi.serving.tools import GENERIC, HERMES, LLAMA3, ToolChoice, ToolFormat

HERMES_OPEN, HERMES_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
# Where a call may start, per family; a JSON object is read from its "{".
STARTS = {
    HERMES: re.compile(re.escape(HERMES_OPEN)),
    LLAMA3: re.compile(re.escape(PYTHON_TAG) + r'|\{\s*"name"'),
    GENERIC: re.compile(r'\{\s*"(?:tool_calls|tool_call|response)"'),
}
KEYS = {HERMES: (), LLAMA3: ("name",), GENERIC: ("tool_calls", "tool_call", "response")}
LITERALS = {HERMES: (HERMES_OPEN,), LLAMA3: (PYTHON_TAG,), GENERIC: ()}
MARKERS = {HERMES: (HERMES_OPEN, HERMES_CLOSE), LLAMA3: (PYTHON_TAG,), GENERIC: ()}  # all the parser reads
JSON = json.JSONDecoder()
# a generic reply of calls, from its opening to its first call (the list's "[" for tool_calls)
CUT_CALLS = re.compile(r'\{\s*"(tool_calls?)"\s*(?::\s*(\[\s*)?)?')
CUT_REPLY = re.compile(r'\{\s*"response"\s*(:\s*)?')
LLAMA3_NAME = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)("?)')


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _may_start(tail: str, family: str) -> int:
    """Length of the end of `tail` that may still grow into the start of a call."""
    keep = held_back(tail, LITERALS[family])
    brace = tail.rfind("{")
    if KEYS[family] and brace >= 0:
        m = re.fullmatch(r'\{\s*(?:"(\w*))?', tail[brace:])
        if m and (m.group(1) is None or any(k.startswith(m.group(1)) for k in KEYS[family])):
            keep = max(keep, len(tail) - brace)
    return keep


def _cut_opening(tail: str, family: str) -> int:
    """At the end of an answer: the length of its end that is a call's opening cut short
    ('{"tool_ca', '<tool_c'), dropped with the rest of a cut call; a lone "<" or "{", which
    text may end with as well, stays."""
    keep = _may_start(tail, family)
    end = tail[len(tail) - keep:]
    return keep if len(end) > 1 and (not end.startswith("{") or '"' in end) else 0


def _reply_so_far(buf: str) -> Optional[str]:
    """The text of a generic {"response": ...} reply cut before it closed: a string's
    characters so far, other JSON (response_format's) as written so far; None where `buf`
    is no such reply."""
    m = CUT_REPLY.match(buf)
    if m is None:
        return None
    if m.group(1) is None:
        return ""  # cut before its value
    value = buf[m.end():]
    if value.startswith('"'):
        return json_cut.string_so_far(value)
    try:
        decoded, end = JSON.raw_decode(value)
    except ValueError:
        return value.rstrip()  # cut inside it
    return json.dumps(decoded, ensure_ascii=False) if not value[end:].strip() else None  # as a whole reply's


class CallParser:
    """One choice's answer, fed as it arrives (`feed`, then `finish`): the content to show
    now and the calls completed, each once."""

    def __init__(self, family: str, names: Sequence[str], parallel: bool, hide_tag: bool = False,
                 stream_reply: bool = False) -> None:
        self.family, self.names, self.parallel = family, set(names), parallel
        self.hide_tag = hide_tag  # a <|python_tag|> that opens no call shows no text
        self.stream_reply = stream_reply and family == GENERIC  # a {"response": "..."}'s text as it comes
        self.reply_shown = 0  # characters of the open reply's text handed out
        self.buf = ""  # text not decided yet
        self.found = 0  # calls handed out
        self.shown = False  # some content handed out
        self.space = ""  # whitespace held: shown only if content follows it
        self.after_call = False  # the last thing read was a call
        self.dropped = False  # a call cut short (max_tokens, a stop string) was left out

    def feed(self, text: str) -> Tuple[str, List[Call]]:
        self.buf += text
        return self._scan(final=False)

    def finish(self) -> Tuple[str, List[Call]]:
        return self._scan(final=True)

    def _scan(self, final: bool) -> Tuple[str, List[Call]]:
        content: List[str] = []
        calls: List[Call] = []
        while self.buf:
            if self.after_call and self.family == LLAMA3:  # Llama 3.2 splits calls by ';'
                if not self.buf.strip() and not final:
                    break
                sep = re.match(r"\s*;", self.buf)
                self.buf = self.buf[sep.end():] if sep else self.buf
                self.after_call = False
                continue
            m = STARTS[self.family].search(self.buf)
            if m is None:
                keep = _cut_opening(self.buf, self.family) if final else _may_start(self.buf, self.family)
                content.append(self.buf[:len(self.buf) - keep])
                self.buf = "" if final else self.buf[len(self.buf) - keep:]  # the end: a cut opening is dropped
                self.dropped = self.dropped or final and keep > 0
                break
            content.append(self.buf[:m.start()])
            self.buf = self.buf[m.start():]
            got = self._read_call(final)
            if got is None:  # may still become a call
                break
            used, read, text = got
            self.buf = self.buf[used:]
            content.append(text)
            if not used:  # an open reply's text so far: the rest when more comes
                break
            self.after_call = bool(read)
            for call in read:
                if self.parallel or self.found == 0:  # parallel_tool_calls false: the first only
                    calls.append(call)
                    self.found += 1
        return self._show("".join(content), final), calls

    def _show(self, text: str, final: bool) -> str:
        text = self.space + text
        if not self.shown:
            text = text.lstrip()
        shown = text.rstrip()
        self.space = "" if final else text[len(shown):]
        self.shown = self.shown or bool(shown)
        return shown

    def _read_call(self, final: bool) -> Optional[Tuple[int, List[Call], str]]:
        """At a call's start in `buf`: (characters used, the calls read, text that stays
        content), or None while more text may complete it."""
        buf = self.buf
        if self.family == HERMES:
            read = self._read_hermes_value(buf, final)
            if read is not None:
                return read if read != () else None
            end = buf.find(HERMES_CLOSE)
            if end < 0 and not final:
                return None
            body = buf[len(HERMES_OPEN):] if end < 0 else buf[len(HERMES_OPEN):end]
            if end < 0:  # the end: cut inside the closing tag, or before it
                body = body[:len(body) - held_back(body, (HERMES_CLOSE,))]
            used = len(buf) if end < 0 else end + len(HERMES_CLOSE)
            call = self._call(_loads(body.strip()), "arguments")
            if call is None and end < 0 and (self.found or json_cut.cut_short(body, 0)):  # a cut call: dropped
                self.dropped = True
                return len(buf), [], ""
            return (used, [call], "") if call is not None else (len(HERMES_OPEN), [], HERMES_OPEN)
        start = len(PYTHON_TAG) if buf.startswith(PYTHON_TAG) else 0
        brace = len(buf) - len(buf[start:].lstrip()) if start else 0
        if brace == len(buf) and not final:
            return None
        try:
            value, end = JSON.raw_decode(buf, brace)
        except ValueError:
            if not final:
                return self._open_reply(buf)  # incomplete, or malformed: known at the end
            return self._cut(buf, start, brace)
        read = self._calls(value)
        if read is None:  # JSON, but not a call: all of it stays content
            return (end, [], buf[:end]) if not start else (start, [], self._tag(buf, start))
        if isinstance(read, str):  # the generic format's {"response": text}
            return end, [], self._reply_rest(read)
        return end, read, ""

    def _read_hermes_value(self, buf: str, final: bool) -> Any:
        """A Hermes call read as a JSON value, then its closing tag: the JSON may hold the tag
        in a string (an argument that writes "</tool_call>"), so the first tag is not its end.
        _read_call's answer; () while more text may complete it; None: not a JSON call then a
        tag (read as the text up to the first tag)."""
        at = len(HERMES_OPEN)
        at += len(buf) - at - len(buf[at:].lstrip())
        try:
            value, stop = JSON.raw_decode(buf, at)
        except ValueError:  # cut short: wait for the rest, or at the end a cut call, dropped
            if not json_cut.cut_short(buf, at):
                return None  # malformed: read up to its first tag
            if not final:
                return ()
            self.dropped = True
            return len(buf), [], ""
        rest = buf[stop:].lstrip()
        if not rest.startswith(HERMES_CLOSE):
            return () if not final and HERMES_CLOSE.startswith(rest) else None
        call = self._call(value, "arguments")
        return (len(buf) - len(rest) + len(HERMES_CLOSE), [call], "") if call is not None else None

    def _open_reply(self, buf: str) -> Optional[Tuple[int, List[Call], str]]:
        """While a streamed generic reply's string is being written: its new text (nothing of
        `buf` used), or None (wait for more)."""
        m = CUT_REPLY.match(buf) if self.stream_reply else None
        if m is None or not buf[m.end():].startswith('"'):  # response_format's JSON comes whole
            return None
        so_far = json_cut.string_so_far(buf[m.end():])
        if so_far is None or len(so_far) <= self.reply_shown:
            return None
        new = so_far[self.reply_shown:]
        self.reply_shown = len(so_far)
        return 0, [], new

    def _reply_rest(self, text: str) -> str:
        """A generic reply's text less what was streamed of it already."""
        shown, self.reply_shown = self.reply_shown, 0
        return text[shown:]

    def _cut(self, buf: str, start: int, brace: int) -> Tuple[int, List[Call], str]:
        """At the end, a call whose JSON does not decode. Cut short (max_tokens, a stop
        string): the calls it completed, or a generic reply's text so far; the cut call is
        dropped, never shown as text. Malformed, or not naming a tool: it stays content."""
        as_text: Tuple[int, List[Call], str] = (start, [], self._tag(buf, start)) if start else (1, [], buf[:1])
        if not json_cut.cut_short(buf, brace):
            return as_text
        if self.family == GENERIC:
            reply = _reply_so_far(buf)
            if reply is not None:
                return len(buf), [], self._reply_rest(reply)
            calls = self._cut_calls(buf)
            if calls is None:
                return as_text
        elif not start and not self._may_name_a_tool(buf):  # Llama 3's '{"name"' in text: JSON of its own
            return as_text
        else:
            calls = []
        self.dropped = True
        return len(buf), calls, ""

    def _tag(self, buf: str, start: int) -> str:
        """The content a <|python_tag|> (buf[:start]) that opens no call shows."""
        return "" if self.hide_tag else buf[:start]

    def _may_name_a_tool(self, buf: str) -> bool:
        """Whether a cut '{"name": ...' names one of the tools, or may still (not written yet)."""
        m = LLAMA3_NAME.match(buf)
        if m is None:
            return True
        name, closed = m.groups()
        return name in self.names if closed else any(n.startswith(name) for n in self.names)

    def _cut_calls(self, buf: str) -> Optional[List[Call]]:
        """The complete calls at the head of a generic reply cut before it closed
        ('{"tool_calls": [{call}, {call}, {"na', '{"tool_call": {"na'), or None where it is
        not a reply of calls (another opening, or an entry that is not a call)."""
        m = CUT_CALLS.match(buf)
        if m is None or m.end() < len(buf) and m.group(1) == "tool_calls" and m.group(2) is None:
            return None
        calls: List[Call] = []
        pos = m.end()
        while pos < len(buf):
            try:
                value, pos = JSON.raw_decode(buf, pos)
            except ValueError:
                break  # the call the answer was cut in
            call = self._call(value, "arguments")
            if call is None:
                return None
            calls.append(call)
            sep = re.match(r"\s*,\s*", buf[pos:])
            if sep is None or m.group(1) == "tool_call":  # the singular form holds one
                break
            pos += sep.end()
        return calls

    def _calls(self, value: Any) -> Any:
        """The calls in a decoded JSON value (None: not calls; a string: a generic reply)."""
        if self.family == LLAMA3:
            call = self._call(value, "parameters") or self._call(value, "arguments")
            return [call] if call is not None else None
        if not isinstance(value, dict) or len(value) != 1:
            return None
        if "response" in value:  # text; JSON (response_format's, with tools auto) as its text
            reply = value["response"]
            return reply if isinstance(reply, str) else json.dumps(reply, ensure_ascii=False)
        entries = value.get("tool_calls") if "tool_calls" in value else [value.get("tool_call")]
        if not isinstance(entries, list) or not entries:
            return None
        calls = [self._call(e, "arguments") for e in entries]
        return calls if all(c is not None for c in calls) else None

    def _call(self, value: Any, args_key: str) -> Optional[Call]:
        if not isinstance(value, dict) or value.get("name") not in self.names or args_key not in value \
                or set(value) - {"name", args_key, "id"}:
            return None
        args = value[args_key]
        if isinstance(args, str):  # some models write the arguments as JSON text
            args = _loads(args)
        if not isinstance(args, dict):
            return None
        return Call(value["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_entries(calls: Sequence[Call]) -> List[Dict[str, Any]]:
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


class ToolReplies:
    """The tool calls of one request's choices, for its Reply: a parser per choice."""

    def __init__(self, choice: ToolChoice, fmt: ToolFormat, hide_tag: bool = False, constrained: bool = False) -> None:
        self.choice, self.fmt, self.hide_tag = choice, fmt, hide_tag  # hide_tag: CallParser's
        self.constrained = constrained  # the tool grammar shapes the answer (CallParser's stream_reply)
        self.parsers: Dict[int, CallParser] = {}
        self.counts: Dict[int, int] = {}  # calls streamed per choice

    def _parser(self, index: int) -> CallParser:
        if index not in self.parsers:
            self.parsers[index] = self._new_parser()
        return self.parsers[index]

    def _new_parser(self) -> CallParser:
        return CallParser(self.fmt.family, [f["name"] for f in self.choice.functions], self.choice.parallel,
                          self.hide_tag, self.constrained)

    @property
    def finish_reason(self) -> str:
        """A choice's finish reason when it called: the legacy shape has its own."""
        return "function_call" if self.choice.legacy else "tool_calls"

    def message(self, text: str) -> Dict[str, Any]:
        """The whole answer's message: content null when only calls, and its tool_calls (the
        legacy `function_call` for a request with `functions`)."""
        parser = self._new_parser()
        shown, calls = parser.feed(text)
        rest, more = parser.finish()
        content = shown + rest
        message: Dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls + more and self.choice.legacy:
            message["function_call"] = function_call_body(call_entries(calls + more)[0])
        elif calls + more:
            message["tool_calls"] = call_entries(calls + more)
        elif not parser.dropped:  # null where all it said was a call cut short
            message["content"] = content
        return message

    def deltas(self, index: int, text: Optional[str]) -> List[Dict[str, Any]]:
        """The deltas for this much more of choice `index` (None: its end)."""
        parser = self._parser(index)
        shown, calls = parser.finish() if text is None else parser.feed(text)
        out: List[Dict[str, Any]] = [{"content": shown}] if shown else []
        for entry in call_entries(calls):  # OpenAI's shape: id, type and name first, then the arguments
            k = self.counts.get(index, 0)
            self.counts[index] = k + 1
            fn = entry["function"]
            if self.choice.legacy:  # one call (parallel is off), without id or index
                out.append({"function_call": {"name": fn["name"], "arguments": ""}})
                out.append({"function_call": {"arguments": fn["arguments"]}})
                continue
            out.append({"tool_calls": [{"index": k, "id": entry["id"], "type": "function",
                                        "function": {"name": fn["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]})
        return out

    def called(self, index: int) -> bool:
        return self.counts.get(index, 0) > 0
