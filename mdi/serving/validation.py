"""The OpenAI request fields this server accepts, as tables, and the one validator that walks them.

`FIELDS`: fields with a meaning here (name, accepted JSON types, range, default, routes).
`NEUTRAL`: fields accepted only at the value that changes nothing (echo=false, ...), so
clients that always send them keep working. `openai_fields.IGNORED`: OpenAI's fields mdi does
not act on, type-checked, then named in the answer's X-MDI-Ignored-Fields header. Any other
key is refused. JSON null counts as absent everywhere. Prompts and messages are only
type-checked here: `prompts` reads them.
"""
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mdi.model.constraints.grammar_spec import GrammarSpec
from mdi.model.sampling import MAX_REPEAT_PENALTY, SamplingParams
from mdi.runconfig import ConfigError, SpeculationSpec, parse_speculation
from mdi.serving import legacy_functions, tools
from mdi.serving.openai_fields import ignored_names, set_aside
from mdi.serving.strict_schema import strict_violation

COMPLETIONS, CHAT = "completions", "chat"  # the two generation routes
BOTH = (COMPLETIONS, CHAT)
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_N = 128  # choices per request; the server's slots bound it further (api)
MAX_LOGIT_BIAS = 1024  # entries (OpenAI takes 300; llama.cpp has no limit)


class ApiError(Exception):
    """An answer in OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_field(name: str, expected: str) -> ApiError:
    """The 400 for a body field `name` that is not what was `expected`, naming it."""
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
        raise bad_field("stop", "expected a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise bad_field("stop", "at most %d stop sequences" % MAX_STOP)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_field("stop", "a stop sequence is longer than %d characters" % MAX_STOP_CHARS)
    return [s for s in stops if s]


def _stop_token_ids(value: Any, _: Dict[str, Any]) -> Tuple[int, ...]:
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise bad_field("stop_token_ids", "expected a list of token ids (integers >= 0)")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise bad_field("stop_token_ids", "at most %d token ids" % MAX_STOP_TOKEN_IDS)
    return tuple(value)  # each below the vocabulary's size: checked by the server (api)


# Set by the server where it renders a chat template: a request's chat_template_kwargs may not
RENDER_NAMES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")
TEMPLATE_KWARG = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _template_kwargs(value: Dict[str, Any], _: Dict[str, Any]) -> Dict[str, Any]:
    for key in value:
        if not TEMPLATE_KWARG.fullmatch(key) or key in RENDER_NAMES:
            raise bad_field("chat_template_kwargs", "%r is not a name the request may set (a Python name, "
                            "none of %s)" % (key[:64], ", ".join(RENDER_NAMES)))
    return value


MAX_STOP_TOKEN_IDS = 64
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limits
MAX_TOP_LOGPROBS = 20
MAX_LORA_ENTRIES = 8
MAX_LORA_SCALE = 100.0  # beyond this a delta swamps the base; almost certainly a typo


def _lora(value: Any, _: Dict[str, Any]) -> List[Dict[str, Any]]:
    """llama.cpp's per-request adapters: [{"id": index in GET /v1/models' adapters, "scale": s}]
    (scale 1 when left out). Several entries mix their scaled adapters; scale 0 leaves one out."""
    used, seen = [], set()
    if len(value) > MAX_LORA_ENTRIES:
        raise bad_field("lora", "at most %d entries" % MAX_LORA_ENTRIES)
    for entry in value:
        if not isinstance(entry, dict) or set(entry) - {"id", "scale"} or not isinstance(entry.get("id"), int) \
                or isinstance(entry.get("id"), bool):
            raise bad_field("lora", 'expected a list of {"id": integer, "scale": number}')
        scale = entry.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or abs(scale) > MAX_LORA_SCALE:
            raise bad_field("lora", "scale: expected a number from -%g to %g, got %s"
                       % (MAX_LORA_SCALE, MAX_LORA_SCALE, json.dumps(scale)[:20]))
        if entry["id"] in seen:
            raise bad_field("lora", "id %d is listed twice" % entry["id"])
        seen.add(entry["id"])
        used.append({"id": entry["id"], "scale": float(scale)})
    return used


def _logit_bias(value: Dict[str, Any], _: Dict[str, Any]) -> Dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]}; the ids are checked against the vocabulary
    by the route (`api`), which knows it."""
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_field("logit_bias", "at most %d entries" % MAX_LOGIT_BIAS)
    bias = {}
    for key, v in value.items():
        if not key.isdigit() or len(key) > 12:
            raise bad_field("logit_bias", "keys are token ids (strings of digits), got %s" % json.dumps(key)[:30])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad_field("logit_bias", "token %s: expected a number from -100 to 100, got %s" % (key, json.dumps(v)[:20]))
        bias[int(key)] = float(v)
    return bias


def _top_logprobs(value: int, checked: Dict[str, Any]) -> int:
    if value and not checked["logprobs"]:  # 0 stays accepted alone, as it was when it was all there was
        raise bad_field("top_logprobs", "only allowed with logprobs: true")
    return value


STREAM_OPTIONS = ("include_usage", "include_obfuscation", "continuous_usage_stats")


def _stream_options(value: Dict[str, Any], checked: Dict[str, Any]) -> Dict[str, Any]:
    if not checked["stream"]:
        raise bad_field("stream_options", "only allowed with stream: true")
    # include_obfuscation pads OpenAI's chunks against a side channel; mdi's have no padding to drop
    unknown = sorted(set(value) - set(STREAM_OPTIONS))
    if unknown:
        raise bad_field("stream_options", "unknown key %r" % unknown[0])
    for key in STREAM_OPTIONS:
        if not isinstance(value.get(key, False), bool):
            raise ApiError(400, "'stream_options.%s': expected true or false" % key, "stream_options")
    return value


SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def _response_format(value: Dict[str, Any], _: Dict[str, Any]) -> Optional[GrammarSpec]:
    """OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    "strict", "description"}}; llama.cpp's {"type": "json_object", "schema": ...} too."""
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) <= {"type", "schema"}:
        if value.get("schema") is None:
            return GrammarSpec("json_object", "", "response_format")
        return _schema_spec(value["schema"], "response_format", strict=False)  # llama.cpp's, best effort
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        inner = value["json_schema"]
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict) \
                or set(inner) - {"name", "schema", "strict", "description"}:
            raise bad_field("response_format", 'json_schema: expected {"name": ..., "schema": {...}, "strict": true}')
        name = inner.get("name")
        if name is not None and not (isinstance(name, str) and SCHEMA_NAME.fullmatch(name)):
            raise bad_field("response_format", "json_schema.name: expected 1 to 64 of a-z, A-Z, 0-9, _ and -")
        if inner.get("strict") is not None and not isinstance(inner["strict"], bool):  # null: absent
            raise bad_field("response_format", "json_schema.strict: expected true or false")
        if inner.get("strict"):
            broken = strict_violation(inner["schema"])
            if broken is not None:
                raise bad_field("response_format", "json_schema.schema: " + broken)
        return _schema_spec(inner["schema"], "response_format", strict=bool(inner.get("strict")))
    raise bad_field("response_format", 'expected {"type": "text"}, {"type": "json_object"} or '
               '{"type": "json_schema", "json_schema": {...}}')


def _schema_spec(schema: Any, field: str, strict: bool) -> GrammarSpec:
    """`strict` (OpenAI's json_schema.strict, false unless sent): refuse a schema's keywords the
    decoder cannot enforce; else ignore them (OpenAI's non-strict mode and llama.cpp do)."""
    if not isinstance(schema, dict):
        raise bad_field(field, "the schema must be a JSON object")
    return GrammarSpec("json_schema", json.dumps(schema), field, strict)


def _grammar(value: str, _: Dict[str, Any]) -> Optional[GrammarSpec]:
    return GrammarSpec("gbnf", value, "grammar") if value else None  # llama.cpp: "" is no grammar


def _regex(value: str, _: Dict[str, Any]) -> Optional[GrammarSpec]:
    return GrammarSpec("regex", value, "regex") if value else None  # as grammar: "" is none (README)


OUTPUT_SHAPES = ("response_format", "json_schema", "grammar", "regex")  # at most one per request


def _tool_check(check: Callable[[Any, Dict[str, Any]], Any]) -> Callable[[Any, Dict[str, Any]], Any]:
    def checked_tools(value: Any, checked: Dict[str, Any]) -> Any:
        try:
            return check(value, checked)
        except tools.ToolError as e:
            raise ApiError(400, str(e), e.param)
    return checked_tools


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
        assert self.low is not None  # asked only of a field with a range
        if self.high is None:
            return "%s >= %g" % (self.expected, self.low)
        return "%s in %s%g, %g]" % (self.expected, "(" if self.low_open else "[", self.low, self.high)

    def in_range(self, value: Any) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return bool(above and (self.high is None or value <= self.high))  # NaN fails both


FIELDS = (  # in checking order: a check may read the fields above it
    Field("model", (str,), "a string"),  # the served model or one of its adapters (any name without adapters)
    Field("lora", (list,), "a list", default=[], check=_lora),
    Field("prompt", (str, list), "a string, token ids, or a list of either", routes=(COMPLETIONS,), required=True),
    Field("messages", (list,), "a non-empty list of messages", routes=(CHAT,), required=True),
    Field("max_tokens", (int,), "an integer", low=1),  # default: 16 for completions, the slot for chat
    Field("max_completion_tokens", (int,), "an integer", low=1, routes=(CHAT,)),  # wins over max_tokens
    Field("temperature", (int, float), "a number", low=0, high=2),
    Field("top_p", (int, float), "a number", low=0, high=1, low_open=True),
    Field("top_k", (int,), "an integer", low=-1),  # 0 and -1: off, as llama.cpp and vLLM read them
    Field("seed", (int,), "an integer"),
    Field("n", (int,), "an integer", low=1, high=MAX_N, default=1),  # choices; seeds seed, seed + 1, ...
    Field("min_p", (int, float), "a number", low=0, high=1),
    Field("presence_penalty", (int, float), "a number", low=-2, high=2),
    Field("frequency_penalty", (int, float), "a number", low=-2, high=2),
    Field("repeat_penalty", (int, float), "a number", low=0, high=MAX_REPEAT_PENALTY, low_open=True),  # llama.cpp's
    Field("repeat_last_n", (int,), "an integer", low=-1),  # llama.cpp's: -1 every token, 0 off
    # vLLM's: repeat_penalty over every prompt and generated token (repeat_last_n -1)
    Field("repetition_penalty", (int, float), "a number", low=0, high=MAX_REPEAT_PENALTY, low_open=True),
    Field("logit_bias", (dict,), "an object", default={}, check=_logit_bias),
    # Completions: logprobs N gives each token's and N alternatives'; chat: logprobs true, top_logprobs N.
    Field("logprobs", (int,), "an integer", low=0, high=MAX_COMPLETION_LOGPROBS, routes=(COMPLETIONS,)),
    Field("logprobs", (bool,), "true or false", default=False, routes=(CHAT,)),
    Field("top_logprobs", (int,), "an integer", low=0, high=MAX_TOP_LOGPROBS, routes=(CHAT,), check=_top_logprobs),
    Field("stop", (str, list), "a string or a list of strings", default=(), check=_stop_strings),
    # vLLM's: the text keeps the stop string it ends at; ids that end the answer as the end token
    # does; end tokens left out of the first min_tokens; generating on past the end token
    Field("include_stop_str_in_output", (bool,), "true or false", default=False),
    Field("stop_token_ids", (list,), "a list of token ids", default=(), check=_stop_token_ids),
    Field("min_tokens", (int,), "an integer", low=0, default=0),
    Field("ignore_eos", (bool,), "true or false", default=False),
    # vLLM's: more names for the chat template (Qwen3's enable_thinking...)
    Field("chat_template_kwargs", (dict,), "an object", default={}, routes=(CHAT,), check=_template_kwargs),
    Field("stream", (bool,), "true or false", default=False),
    Field("stream_options", (dict,), "an object", default={}, check=_stream_options),
    Field("speculation", (str, dict, bool), "off, ngram or an object like generation.speculation",
          check=_speculation),  # None: the server's generation.speculation
    # llama.cpp's: false computes the whole prompt again, reusing nothing the prefix cache holds
    Field("cache_prompt", (bool,), "true or false", default=True),
    # vLLM's: false shows control tokens (<|im_end|>, <start_of_image>) in the text (`control_tokens`)
    Field("skip_special_tokens", (bool,), "true or false", default=True),
    # What the output must obey (mdi.model.constraints.constraint): OpenAI's response_format, llama.cpp's
    # json_schema and GBNF grammar, and mdi's regex.
    Field("response_format", (dict,), "an object", check=_response_format),
    Field("json_schema", (dict,), "an object", check=lambda v, _: _schema_spec(v, "json_schema", strict=False)),
    Field("grammar", (str,), "a string (a GBNF grammar)", check=_grammar),
    Field("regex", (str,), "a string (a regular expression)", check=_regex),
    # Function calling (`tools`): the functions, which of them the answer must call, and how many.
    Field("tools", (list,), "a list of tools", default=[], routes=(CHAT,), check=_tool_check(tools.check_tools)),
    Field("tool_choice", (str, dict), '"auto", "none", "required", {"type": "function", ...} or '
          '{"type": "allowed_tools", ...}', routes=(CHAT,),
          check=_tool_check(tools.check_tool_choice)),
    # None: what the chat template supports (tools.parallel_default), as llama.cpp decides it
    Field("parallel_tool_calls", (bool,), "true or false", routes=(CHAT,)),
    # OpenAI's legacy function calling, mapped onto the tools (`legacy_functions`)
    Field("functions", (list,), "a list of functions", default=[], routes=(CHAT,),
          check=_tool_check(legacy_functions.check_functions)),
    Field("function_call", (str, dict), '"auto", "none" or {"name": ...}', routes=(CHAT,),
          check=_tool_check(legacy_functions.check_function_call)),
)


@dataclass(frozen=True)
class Neutral:
    name: str
    only: str  # the accepted value, as the error message says it
    accepts: Callable[[Any], bool]
    routes: Tuple[str, ...] = BOTH


NEUTRAL = (
    Neutral("modalities", '["text"] (this server writes no audio)',
            lambda v: isinstance(v, list) and all(m == "text" for m in v), (CHAT,)),
    Neutral("best_of", "1", lambda v: v == 1, (COMPLETIONS,)),
    Neutral("echo", "false", lambda v: v is False, (COMPLETIONS,)),
    Neutral("suffix", "an empty string", lambda v: v == "", (COMPLETIONS,)),
)


def validate(body: Dict[str, Any], route: str) -> Dict[str, Any]:
    """Every field of `route` by name: the checked value, or its default when absent."""
    fields = dict((f.name, f) for f in FIELDS if route in f.routes)
    neutral = dict((n.name, n) for n in NEUTRAL if route in n.routes)
    ignorable = set(ignored_names(route))  # all of them: one sent as null is accepted, and not named
    ignored, wrong = set_aside(body, route)
    if wrong is not None:
        raise bad_field(*wrong)
    for key in sorted(body):
        if key not in fields and key not in neutral and key not in ignorable:
            raise ApiError(400, "unrecognized request argument: '%s'" % key, key)
        if key in neutral and body[key] is not None and not neutral[key].accepts(body[key]):
            raise bad_field(key, "only %s is supported" % neutral[key].only)
    checked: Dict[str, Any] = {"ignored": ignored}
    for f in fields.values():
        value = body.get(f.name)
        if value is None:
            if f.required:
                raise bad_field(f.name, "expected %s" % f.expected)
            checked[f.name] = f.default
            continue
        if isinstance(value, bool) and bool not in f.types or not isinstance(value, f.types):
            raise bad_field(f.name, "expected %s, got %s" % (f.expected, json.dumps(value)[:60]))
        if f.low is not None and not f.in_range(value):
            raise bad_field(f.name, "expected %s" % f.range_text())
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
    n: int = 1  # choices
    top_logprobs: Optional[int] = None  # None: no logprobs; else each token's and this many alternatives'
    cache_prompt: bool = True  # may start from what the prefix cache holds
    grammar: Optional[GrammarSpec] = None  # what the output must obey (None: free text)
    ignored: Sequence[str] = ()  # OpenAI fields the request set that mdi does not act on
    skip_special_tokens: bool = True  # the text leaves out control tokens
    include_stop_str: bool = False  # the text keeps the stop string it ends at
    stop_token_ids: Tuple[int, ...] = ()  # ids that end the answer as the end token does
    min_tokens: int = 0  # the end tokens (and stop_token_ids) may not be drawn before this many tokens
    ignore_eos: bool = False  # the model's end tokens do not end the answer
    continuous_usage: bool = False  # vLLM's continuous_usage_stats (with include_usage): the usage in every chunk


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repeat_penalty", "repeat_last_n")  # the SamplingParams fields a request may set


def parse_options(body: Dict[str, Any], route: str, defaults: SamplingParams) -> Tuple[Options, Dict[str, Any]]:
    """The request's options (unset sampling fields take `defaults`, the YAML's) and all checked fields."""
    v = validate(body, route)
    max_tokens = v.get("max_completion_tokens")
    given: Dict[str, Any] = dict((name, v[name] if name in ("top_k", "repeat_last_n") else float(v[name]))
                 for name in SAMPLING_FIELDS if v[name] is not None)
    if v["repetition_penalty"] is not None and v["repeat_penalty"] is None:
        given.update(repeat_penalty=float(v["repetition_penalty"]),
                     repeat_last_n=-1 if v["repeat_last_n"] is None else v["repeat_last_n"])
    if given.get("top_k", 1) < 1:
        given["top_k"] = None  # off, even where the YAML sets one
    params = dataclasses.replace(defaults, logit_bias=v["logit_bias"] or defaults.logit_bias, **given)
    if route == CHAT:
        top = (v["top_logprobs"] or 0) if v["logprobs"] else None
    else:
        top = v["logprobs"]
    usage = v["stream_options"].get("include_usage") is True
    options = Options(max_tokens if max_tokens is not None else v["max_tokens"], params, v["seed"], _stops(v),
                      v["stream"], usage, v["speculation"], v["n"], top,
                      v["cache_prompt"], _one_shape(v), v["ignored"], v["skip_special_tokens"],
                      v["include_stop_str_in_output"], v["stop_token_ids"], v["min_tokens"], v["ignore_eos"],
                      continuous_usage=usage and v["stream_options"].get("continuous_usage_stats") is True)
    return options, v


def _stops(checked: Dict[str, Any]) -> Sequence[str]:
    """The stop strings; none where the answer must be calls (tool_choice "required" or a
    named function, the legacy function_call {"name": ...}): the constrained answer is then
    all calls, with no text for a stop string to end, and one matching inside a call's
    arguments (stop: ["Paris"] and a city) would only cut the call the client asked for."""
    offered, choice, _ = tools.asked_tools(checked)
    return () if offered and tools.answer_is_calls(choice) else checked["stop"]


def _one_shape(checked: Dict[str, Any]) -> Optional[GrammarSpec]:
    shapes = [checked[name] for name in OUTPUT_SHAPES if checked[name] is not None]
    if len(shapes) > 1:
        raise bad_field(shapes[1].field, "only one of %s may shape the output" % ", ".join(OUTPUT_SHAPES))
    return shapes[0] if shapes else None
