"""The OpenAI request fields this server accepts, as tables, and the one validator that walks them.

`FIELDS`: fields with a meaning here (name, accepted JSON types, range, default, routes).
`NEUTRAL`: fields accepted only at the value that changes nothing (n=1, echo=false, ...), so
clients that always send them keep working. Any other key is refused. JSON null counts as
absent everywhere. Prompts and messages are only type-checked here: `prompts` reads them.
"""
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mdi.model.sampling import SamplingParams
from mdi.runconfig import ConfigError, SpeculationSpec, parse_speculation

COMPLETIONS, CHAT = "completions", "chat"  # the two generation routes
BOTH = (COMPLETIONS, CHAT)
MAX_STOP = 4
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """An answer in OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(name: str, expected: str) -> ApiError:
    return ApiError(400, "'%s': %s" % (name, expected), name)


# --- checks beyond type and range (take the value and the fields checked before it) ------

def _speculation(value: Any, _: Dict[str, Any]) -> SpeculationSpec:
    """mdi's extension: this request's speculative decoding, as generation.speculation says it."""
    try:
        return parse_speculation("speculation", value)
    except ConfigError as e:
        raise ApiError(400, str(e), "speculation")  # "speculation.max_draft: expected ..."


def _stop_strings(value: Any, _: Dict[str, Any]) -> List[str]:
    stops = [value] if isinstance(value, str) else value
    if not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "expected a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise _bad("stop", "at most %d stop sequences" % MAX_STOP)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad("stop", "a stop sequence is longer than %d characters" % MAX_STOP_CHARS)
    return [s for s in stops if s]


MAX_LORA_ENTRIES = 8
MAX_LORA_SCALE = 100.0  # beyond this a delta swamps the base; almost certainly a typo


def _lora(value: Any, _: Dict[str, Any]) -> List[Dict[str, Any]]:
    """llama.cpp's per-request adapters: [{"id": index in GET /v1/models' adapters, "scale": s}]
    (scale 1 when left out). Several entries mix their scaled adapters; scale 0 leaves one out."""
    used, seen = [], set()
    if len(value) > MAX_LORA_ENTRIES:
        raise _bad("lora", "at most %d entries" % MAX_LORA_ENTRIES)
    for entry in value:
        if not isinstance(entry, dict) or set(entry) - {"id", "scale"} or not isinstance(entry.get("id"), int) \
                or isinstance(entry.get("id"), bool):
            raise _bad("lora", 'expected a list of {"id": integer, "scale": number}')
        scale = entry.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or abs(scale) > MAX_LORA_SCALE:
            raise _bad("lora", "scale: expected a number from -%g to %g, got %s"
                       % (MAX_LORA_SCALE, MAX_LORA_SCALE, json.dumps(scale)[:20]))
        if entry["id"] in seen:
            raise _bad("lora", "id %d is listed twice" % entry["id"])
        seen.add(entry["id"])
        used.append({"id": entry["id"], "scale": float(scale)})
    return used


def _stream_options(value: Dict[str, Any], checked: Dict[str, Any]) -> Dict[str, Any]:
    if not checked["stream"]:
        raise _bad("stream_options", "only allowed with stream: true")
    unknown = sorted(set(value) - {"include_usage"})
    if unknown:
        raise _bad("stream_options", "unknown key '%s'" % unknown[0])
    if not isinstance(value.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options.include_usage': expected true or false", "stream_options")
    return value


@dataclass(frozen=True)
class Field:
    name: str
    types: Tuple[type, ...]  # accepted JSON types (bool is never an int here unless listed)
    expected: str  # what the error message says was expected
    low: Optional[float] = None  # range: low <= value (low < value when low_open) ...
    high: Optional[float] = None  # ... <= high
    low_open: bool = False
    default: Any = None  # when absent; None: the YAML's generation value or the route's budget
    routes: Tuple[str, ...] = BOTH
    required: bool = False
    check: Optional[Callable[[Any, Dict[str, Any]], Any]] = None  # further checks; returns the value to use

    def range_text(self) -> str:
        if self.high is None:
            return "%s >= %g" % (self.expected, self.low)
        return "%s in %s%g, %g]" % (self.expected, "(" if self.low_open else "[", self.low, self.high)

    def in_range(self, value: Any) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return bool(above and (self.high is None or value <= self.high))  # NaN fails both


FIELDS = (  # in checking order: a check may read the fields above it
    Field("model", (str,), "a string"),  # the served model or one of its adapters (any name without adapters)
    Field("lora", (list,), "a list", default=[], check=_lora),
    Field("prompt", (str, list), "a string or a list of token ids", routes=(COMPLETIONS,), required=True),
    Field("messages", (list,), "a non-empty list of messages", routes=(CHAT,), required=True),
    Field("max_tokens", (int,), "an integer", low=1),  # default: 16 for completions, the slot for chat
    Field("max_completion_tokens", (int,), "an integer", low=1, routes=(CHAT,)),  # wins over max_tokens
    Field("temperature", (int, float), "a number", low=0, high=2),
    Field("top_p", (int, float), "a number", low=0, high=1, low_open=True),
    Field("top_k", (int,), "an integer", low=1),
    Field("seed", (int,), "an integer"),
    Field("stop", (str, list), "a string or a list of strings", default=(), check=_stop_strings),
    Field("stream", (bool,), "true or false", default=False),
    Field("stream_options", (dict,), "an object", default={}, check=_stream_options),
    Field("speculation", (str, dict, bool), "off, ngram or an object like generation.speculation",
          check=_speculation),  # None: the server's generation.speculation
    # llama.cpp's: false computes the whole prompt again, reusing nothing the prefix cache holds
    Field("cache_prompt", (bool,), "true or false", default=True),
)


@dataclass(frozen=True)
class Neutral:
    name: str
    only: str  # the accepted value, as the error message says it
    accepts: Callable[[Any], bool]
    routes: Tuple[str, ...] = BOTH


NEUTRAL = (
    Neutral("n", "1", lambda v: v == 1),
    Neutral("user", "a string", lambda v: isinstance(v, str)),
    Neutral("frequency_penalty", "0", lambda v: v == 0),
    Neutral("presence_penalty", "0", lambda v: v == 0),
    Neutral("logit_bias", "{}", lambda v: v == {}),
    Neutral("logprobs", "false/null", lambda v: v is False),
    Neutral("best_of", "1", lambda v: v == 1, (COMPLETIONS,)),
    Neutral("echo", "false", lambda v: v is False, (COMPLETIONS,)),
    Neutral("suffix", "an empty string", lambda v: v == "", (COMPLETIONS,)),
    Neutral("top_logprobs", "0", lambda v: v == 0, (CHAT,)),
    Neutral("response_format", '{"type": "text"}', lambda v: v == {"type": "text"}, (CHAT,)),
    Neutral("tools", "[]", lambda v: v == [], (CHAT,)),
    Neutral("tool_choice", '"none"', lambda v: v == "none", (CHAT,)),
    Neutral("parallel_tool_calls", "true/false", lambda v: isinstance(v, bool), (CHAT,)),
)


def validate(body: Dict[str, Any], route: str) -> Dict[str, Any]:
    """Every field of `route` by name: the checked value, or its default when absent."""
    fields = dict((f.name, f) for f in FIELDS if route in f.routes)
    neutral = dict((n.name, n) for n in NEUTRAL if route in n.routes)
    for key in sorted(body):
        if key not in fields and key not in neutral:
            raise ApiError(400, "unrecognized request argument: '%s'" % key, key)
        if key in neutral and body[key] is not None and not neutral[key].accepts(body[key]):
            raise _bad(key, "only %s is supported" % neutral[key].only)
    checked: Dict[str, Any] = {}
    for f in fields.values():
        value = body.get(f.name)
        if value is None:
            if f.required:
                raise _bad(f.name, "expected %s" % f.expected)
            checked[f.name] = f.default
            continue
        if isinstance(value, bool) and bool not in f.types or not isinstance(value, f.types):
            raise _bad(f.name, "expected %s, got %s" % (f.expected, json.dumps(value)[:60]))
        if f.low is not None and not f.in_range(value):
            raise _bad(f.name, "expected %s" % f.range_text())
        checked[f.name] = f.check(value, checked) if f.check is not None else value
    return checked


@dataclass
class Options:
    """The validated, model-independent part of a generation request."""
    max_tokens: Optional[int]  # None: the route's default
    params: SamplingParams
    seed: Optional[int]
    stop: Sequence[str]
    stream: bool
    include_usage: bool
    speculation: Optional[SpeculationSpec] = None  # None: the server's
    cache_prompt: bool = True  # may start from what the prefix cache holds


def parse_options(body: Dict[str, Any], route: str, defaults: SamplingParams) -> Tuple[Options, Dict[str, Any]]:
    """The request's options (unset sampling fields take `defaults`, the YAML's) and all checked fields."""
    v = validate(body, route)
    max_tokens = v.get("max_completion_tokens")
    params = SamplingParams(defaults.temperature if v["temperature"] is None else float(v["temperature"]),
                            defaults.top_k if v["top_k"] is None else v["top_k"],
                            defaults.top_p if v["top_p"] is None else float(v["top_p"]))
    options = Options(max_tokens if max_tokens is not None else v["max_tokens"], params, v["seed"], v["stop"],
                      v["stream"], v["stream_options"].get("include_usage") is True, v["speculation"],
                      v["cache_prompt"])
    return options, v
