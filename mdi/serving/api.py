"""`mdi-start --serve`: the ring as a service, with an OpenAI-compatible HTTP API.

Routes (JSON only; bodies up to 1 MiB; errors in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`):
  POST /v1/completions, POST /v1/chat/completions   (`stream: true` answers server-sent events)
  GET  /v1/models, GET /health, GET /metrics (Prometheus text format)
With a shared secret (MDI_TOKEN / MDI_TOKEN_FILE / runtime.token_file) every route needs
`Authorization: Bearer <secret>`, as on the workers' control plane.

Request fields: model (any string; the answer names the served model), prompt (a string or a
list of token ids) or messages, max_tokens (completions default 16, chat default the rest of the
slot), temperature, top_p, top_k, stop (a string or up to 4), seed, stream, stream_options.
include_usage; n, best_of, echo, penalties, logit_bias and logprobs only at their defaults.
Unset sampling fields take the YAML's `generation` values. Chat prompts use the tokenizer's
chat template (the GGUF's / tokenizer_config.json's) rendered in a sandbox, else
FALLBACK_CHAT_TEMPLATE ("role: content" lines then "assistant:").
"""
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from mdi.ring.auth import is_loopback, token_matches
from mdi.runconfig import ConfigError, RunConfig
from mdi.model.source import ModelSource
from mdi.model.sampling import SamplingParams
from mdi.serving.scheduler import Request, Scheduler, SchedulerError
from mdi.model.tokenizers import Tokenizer, TokenizerError

MAX_BODY_BYTES = 1 << 20
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
KEEPALIVE = 1.0  # seconds between SSE comments while a stream waits (they also reveal a gone client)
POLL = 0.5  # seconds between checks of a waiting non-streaming request
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
CHAT_ROLES = ("system", "developer", "user", "assistant")

# Fields accepted only at a value that changes nothing: what to say, and the check.
_NEUTRAL = {
    "n": ("1", lambda v: v == 1), "best_of": ("1", lambda v: v == 1), "echo": ("false", lambda v: v is False),
    "frequency_penalty": ("0", lambda v: v == 0), "presence_penalty": ("0", lambda v: v == 0),
    "logit_bias": ("{}", lambda v: v == {}), "logprobs": ("false/null", lambda v: v is False),
    "top_logprobs": ("0", lambda v: v == 0), "suffix": ("an empty string", lambda v: v == ""),
    "user": ("a string", lambda v: isinstance(v, str)),
    "response_format": ('{"type": "text"}', lambda v: v == {"type": "text"}), "tools": ("[]", lambda v: v == []),
    "tool_choice": ('"none"', lambda v: v == "none"),
    "parallel_tool_calls": ("true/false", lambda v: isinstance(v, bool)),
}
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
           "n", "user", "frequency_penalty", "presence_penalty", "logit_bias")
COMPLETION_KEYS = frozenset(_COMMON + ("prompt", "echo", "logprobs", "best_of", "suffix"))
CHAT_KEYS = frozenset(_COMMON + ("messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                 "response_format", "tools", "tool_choice", "parallel_tool_calls"))

log = logging.getLogger("mdi.serve")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj), status=status, mimetype="application/json")


# --------------------------------------------------------------------------- validation

def _field(body: Dict[str, Any], key: str, kinds: Tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, "'%s': expected %s, got %s" % (key, what, json.dumps(value)[:60]), key)
    return value


def _check_keys(body: Dict[str, Any], allowed: frozenset) -> None:
    for key in sorted(body):
        if key not in allowed:
            raise ApiError(400, "unrecognized request argument: '%s'" % key, key)
        neutral = _NEUTRAL.get(key)
        if neutral is not None and body[key] is not None and not neutral[1](body[key]):
            raise ApiError(400, "'%s': only %s is supported" % (key, neutral[0]), key)


def _stops(body: Dict[str, Any]) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop': expected a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise ApiError(400, "'stop': at most %d stop sequences" % MAX_STOP, "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, "'stop': a stop sequence is longer than %d characters" % MAX_STOP_CHARS, "stop")
    return [s for s in stops if s]


class Options:
    """The validated, model-independent part of a request."""

    def __init__(self, body: Dict[str, Any], defaults: SamplingParams, max_tokens_key: str = "max_tokens") -> None:
        _field(body, "model", (str,), "a string")  # any name: the answer names the served model
        self.max_tokens = _field(body, max_tokens_key, (int,), "an integer")
        if max_tokens_key != "max_tokens" and self.max_tokens is None:
            self.max_tokens = _field(body, "max_tokens", (int,), "an integer")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ApiError(400, "'max_tokens': expected an integer >= 1", "max_tokens")
        temperature = _field(body, "temperature", (int, float), "a number")
        if temperature is not None and not 0 <= temperature <= 2:
            raise ApiError(400, "'temperature': expected a number in [0, 2]", "temperature")
        top_p = _field(body, "top_p", (int, float), "a number")
        if top_p is not None and not 0 < top_p <= 1:
            raise ApiError(400, "'top_p': expected a number in (0, 1]", "top_p")
        top_k = _field(body, "top_k", (int,), "an integer")
        if top_k is not None and top_k < 1:
            raise ApiError(400, "'top_k': expected an integer >= 1", "top_k")
        self.params = SamplingParams(defaults.temperature if temperature is None else float(temperature),
                                     defaults.top_k if top_k is None else top_k,
                                     defaults.top_p if top_p is None else float(top_p))
        self.seed = _field(body, "seed", (int,), "an integer")
        self.stop = _stops(body)
        self.stream = bool(_field(body, "stream", (bool,), "true or false"))
        options = _field(body, "stream_options", (dict,), "an object")
        if options is not None and not self.stream:
            raise ApiError(400, "'stream_options': only allowed with stream: true", "stream_options")
        options = options or {}
        unknown = sorted(set(options) - {"include_usage"})
        if unknown:
            raise ApiError(400, "'stream_options': unknown key '%s'" % unknown[0], "stream_options")
        if not isinstance(options.get("include_usage", False), bool):
            raise ApiError(400, "'stream_options.include_usage': expected true or false", "stream_options")
        self.include_usage = options.get("include_usage") is True


# --------------------------------------------------------------------------- prompts

class ChatTemplate:
    """The model's chat template (Jinja, sandboxed as transformers renders it) or the fallback."""

    def __init__(self, tokenizer: Tokenizer, log_fn: Callable[[str], None] = print) -> None:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self.tokenizer = tokenizer
        self.source = "fallback"
        source = tokenizer.chat_template
        self.template = None
        if source:
            try:
                self.template = env.from_string(source)
                self.source = "model"
            except TemplateError as e:
                log_fn("mdi: serve: the model's chat template does not compile (%s); using the fallback" % e)
        if self.template is None:
            self.template = env.from_string(FALLBACK_CHAT_TEMPLATE)
        self.bos = self._token_text(tokenizer.bos_id)
        self.eos = self._token_text(tokenizer.eos_id)

    def _token_text(self, token_id: Optional[int]) -> str:
        if token_id is None:
            return ""
        try:
            return self.tokenizer.decode([token_id])
        except TokenizerError:
            return ""

    def render(self, messages: List[Dict[str, str]]) -> str:
        from jinja2 import TemplateError
        try:
            text = self.template.render(messages=messages, add_generation_prompt=True,
                                        bos_token=self.bos, eos_token=self.eos)
        except TemplateError as e:
            raise ApiError(400, "the chat template refused these messages: %s" % e, "messages")
        if self.tokenizer.add_bos and self.bos and text.startswith(self.bos):
            text = text[len(self.bos):]  # the tokenizer adds BOS itself
        return text


def _messages(body: Dict[str, Any]) -> List[Dict[str, str]]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages': expected a non-empty list of messages", "messages")
    if len(raw) > MAX_MESSAGES:
        raise ApiError(400, "'messages': at most %d messages" % MAX_MESSAGES, "messages")
    out = []
    for i, m in enumerate(raw):
        where = "messages[%d]" % i
        if not isinstance(m, dict):
            raise ApiError(400, "'%s': expected an object with 'role' and 'content'" % where, where)
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise ApiError(400, "'%s': unknown key '%s'" % (where, unknown[0]), where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, "'%s.role': expected one of %s" % (where, ", ".join(CHAT_ROLES)), where + ".role")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, "'%s.content': only text parts are supported" % where, where + ".content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(400, "'%s.content': expected a string" % where, where + ".content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt_ids(body: Dict[str, Any], tokenizer: Tokenizer) -> List[int]:
    """The completion prompt as token ids: a string, [string] or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _encode(tokenizer, prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise ApiError(400, "'prompt': token ids must be in [0, %d)" % tokenizer.vocab_size, "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "'prompt': one prompt per request (send several requests: they run concurrently)",
                       "prompt")
    raise ApiError(400, "'prompt': expected a string or a list of token ids", "prompt")


def _encode(tokenizer: Tokenizer, text: str) -> List[int]:
    try:
        return tokenizer.encode_prompt(text)
    except TokenizerError as e:
        raise ApiError(400, "cannot tokenize the prompt: %s" % e, "prompt")


def _budget(n_prompt: int, max_tokens: Optional[int], default: Optional[int], max_len: int) -> int:
    """max_tokens for this request, or a 400 when prompt + max_tokens cannot fit a slot."""
    room = max_len - n_prompt
    if room < 1:
        raise ApiError(400, "this server's maximum context length is %d tokens, but the prompt has %d tokens"
                       % (max_len, n_prompt), "messages" if default is None else "prompt", "context_length_exceeded")
    if max_tokens is None:
        return room if default is None else min(default, room)
    if max_tokens > room:
        raise ApiError(400, "this server's maximum context length is %d tokens; you requested %d tokens "
                       "(%d in the prompt, %d for the completion)" % (max_len, n_prompt + max_tokens, n_prompt,
                                                                     max_tokens),
                       "max_tokens", "context_length_exceeded")
    return max_tokens


# --------------------------------------------------------------------------- the app

def _client_gone(environ: Dict[str, Any]) -> bool:
    """True when the client of a waiting request has closed its connection."""
    sock = environ.get("werkzeug.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def create_app(sched: Scheduler, model_id: str, token: Optional[str], template: ChatTemplate) -> Flask:
    app = Flask("mdi-serve")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    tokenizer = sched.tokenizer

    @app.before_request
    def check_token():
        if not token_matches(token, request.headers.get("Authorization")):
            return _json(ApiError(401, "missing or wrong bearer token", code="invalid_api_key").body(), 401)
        return None

    @app.errorhandler(ApiError)
    def api_error(e: ApiError):
        return _json(e.body(), e.status)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        message = {404: "no such route: %s %s" % (request.method, request.path),
                   405: "method %s not allowed on %s" % (request.method, request.path),
                   413: "request body larger than %d bytes" % MAX_BODY_BYTES}.get(e.code or 0, e.description)
        return _json(ApiError(e.code or 500, message).body(), e.code or 500)

    @app.errorhandler(Exception)
    def internal_error(e: Exception):
        log.exception("request failed")
        return _json(ApiError(500, "internal error: %s" % type(e).__name__, kind="server_error").body(), 500)

    def body_json() -> Dict[str, Any]:
        if request.mimetype != "application/json":
            raise ApiError(400, "expected Content-Type: application/json")
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise ApiError(413, "request body larger than %d bytes" % MAX_BODY_BYTES)
        raw = request.get_data(cache=False)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ApiError(400, "the body is not valid JSON: %s" % e)
        except RecursionError:
            raise ApiError(400, "the body is nested too deeply")
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        return data

    @app.route("/health", methods=["GET"])
    def health():
        up = sched.state == "up" and sched.alive
        body = {"ok": up, "state": sched.state, "model": model_id, "slots": sched.slots,
                "max_len": sched.max_len, "error": sched.error}
        return _json(body, 200 if up else 503)

    @app.route("/v1/models", methods=["GET"])
    def models():
        return _json({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "mdi",
             "max_model_len": sched.max_len}]})

    @app.route("/metrics", methods=["GET"])
    def metrics():
        return Response(metrics_text(sched), mimetype="text/plain; version=0.0.4; charset=utf-8")

    @app.route("/v1/completions", methods=["POST"])
    def completions():
        body = body_json()
        _check_keys(body, COMPLETION_KEYS)
        opts = Options(body, sched.params)
        ids = _prompt_ids(body, tokenizer)
        max_tokens = _budget(len(ids), opts.max_tokens, DEFAULT_COMPLETION_TOKENS, sched.max_len)
        return _run(Request(ids, max_tokens, opts.params, opts.seed, opts.stop), opts, chat=False)

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat_completions():
        body = body_json()
        _check_keys(body, CHAT_KEYS)
        opts = Options(body, sched.params, "max_completion_tokens")
        ids = _encode(tokenizer, template.render(_messages(body)))
        max_tokens = _budget(len(ids), opts.max_tokens, None, sched.max_len)
        return _run(Request(ids, max_tokens, opts.params, opts.seed, opts.stop), opts, chat=True)

    def _run(req: Request, opts: Options, chat: bool) -> Response:
        try:
            sched.submit(req)
        except SchedulerError as e:
            raise ApiError(e.status, str(e), kind="server_error" if e.status >= 500 else "rate_limit_error")
        env = request.environ
        if opts.stream:
            resp = Response(_stream(req, opts, chat), mimetype="text/event-stream")
            resp.headers["Cache-Control"] = "no-cache"
            resp.headers["X-Accel-Buffering"] = "no"
            return resp
        return _complete(req, chat, env)

    def _next(req: Request, timeout: float) -> Optional[Tuple[str, Any]]:
        event = req.next_event(timeout)
        if event is None and not sched.alive:
            event = req.next_event(0) or ("error", "the scheduler stopped")
        return event

    def _complete(req: Request, chat: bool, env: Dict[str, Any]) -> Response:
        parts = []
        check = time.monotonic() + POLL
        while True:
            event = _next(req, POLL)
            if time.monotonic() >= check:
                check = time.monotonic() + POLL
                if _client_gone(env):
                    sched.cancel(req)
                    return _json(ApiError(499, "client closed the request").body(), 499)
            if event is None:
                continue
            kind, value = event
            if kind == "text":
                parts.append(value)
            elif kind == "error":
                raise ApiError(503, value, kind="server_error")
            else:
                return _json(_final(req, "".join(parts), value, chat))

    def _final(req: Request, text: str, reason: str, chat: bool) -> Dict[str, Any]:
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {"id": ("chatcmpl-" if chat else "cmpl-") + req.id,
                "object": "chat.completion" if chat else "text_completion",
                "created": req.created, "model": model_id, "choices": [choice], "usage": req.usage}

    def _chunk(req: Request, chat: bool, text: Optional[str], reason: Optional[str] = None,
               first: bool = False) -> Dict[str, Any]:
        if chat:
            delta = {}  # type: Dict[str, Any]
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return {"id": ("chatcmpl-" if chat else "cmpl-") + req.id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": req.created, "model": model_id, "choices": [choice]}

    def _stream(req: Request, opts: Options, chat: bool) -> Iterator[str]:
        over = False
        try:
            if chat:
                yield _sse(_chunk(req, chat, "", first=True))
            event = None  # type: Optional[Tuple[str, Any]]
            while True:
                event = event or _next(req, KEEPALIVE)
                if event is None:
                    yield ": keep-alive\n\n"
                    continue
                kind, value = event
                if kind != "text":
                    break
                event = req.next_event(0)
                while event is not None and event[0] == "text":  # what is already there: one chunk
                    value += event[1]
                    event = req.next_event(0)
                yield _sse(_chunk(req, chat, value))
            over = True
            if kind == "error":
                yield _sse(ApiError(503, value, kind="server_error").body())
                return
            last = _chunk(req, chat, None if chat else "", value)
            last["usage"] = None if opts.include_usage else req.usage
            yield _sse(last)
            if opts.include_usage:
                usage = _chunk(req, chat, None)
                usage["choices"], usage["usage"] = [], req.usage
                yield _sse(usage)
            yield "data: [DONE]\n\n"
        finally:
            if not over:  # the client went away (or the server is stopping): free the slot
                sched.cancel(req)

    return app


def _sse(obj: Dict[str, Any]) -> str:
    return "data: %s\n\n" % json.dumps(obj)


# --------------------------------------------------------------------------- /metrics

def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def metrics_text(sched: Scheduler) -> str:
    # Gauges first, then counters: a request is counted as finished before it leaves the
    # ring, so a scrape that shows it gone also counts it. Workers are polled last (slow).
    in_flight, queued = sched.in_flight, sched.queue_length
    snap = sched.stats.snapshot()
    nodes = sched.node_counters()
    out = []  # type: List[str]

    def metric(name: str, kind: str, text: str, samples: List[Tuple[str, Any]]) -> None:
        samples = [(labels, v) for labels, v in samples if v is not None]
        if not samples:
            return
        out.append("# HELP %s %s" % (name, text))
        out.append("# TYPE %s %s" % (name, kind))
        for labels, value in samples:
            out.append("%s%s %s" % (name, labels, repr(float(value)) if isinstance(value, float) else value))

    def per_node(key: str) -> List[Tuple[str, Any]]:
        return [('{node="%s"}' % _label(n["node"]), n.get(key)) for n in nodes]

    metric("mdi_up", "gauge", "1 while the ring is up and serving.",
           [("", 1 if sched.state == "up" and sched.alive else 0)])
    metric("mdi_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
           [("", snap["tokens_per_second"])])
    metric("mdi_generated_tokens_total", "counter", "Tokens generated.", [("", snap["tokens_total"])])
    metric("mdi_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
           [("", snap["prompt_tokens_total"])])
    metric("mdi_samples_in_flight", "gauge", "Samples holding a KV cache slot on the ring.",
           [("", in_flight)])
    metric("mdi_slots", "gauge", "Samples in flight at most (KV cache slots per node).", [("", sched.slots)])
    metric("mdi_queue_length", "gauge", "Requests waiting for a slot.", [("", queued)])
    metric("mdi_requests_total", "counter", "Finished requests by finish reason.",
           [('{finish_reason="%s"}' % r, n) for r, n in sorted(snap["requests"].items())])
    metric("mdi_request_duration_seconds", "summary", "Arrival to last token.",
           [("_sum", snap["latency_sum"]), ("_count", snap["latency_count"])])
    metric("mdi_time_to_first_token_seconds", "summary", "Arrival to first token.",
           [("_sum", snap["ttft_sum"]), ("_count", snap["ttft_count"])])
    metric("mdi_token_interval_seconds", "gauge", "Mean time between two tokens of one sample (recent).",
           [("", snap["token_interval_seconds"])])
    metric("mdi_node_step_seconds", "gauge", "Compute seconds per frame on each node (recent mean; workers "
           "that report compute_seconds).", per_node("step_seconds"))
    metric("mdi_node_frames_total", "counter", "Frames each node computed.", per_node("frames"))
    metric("mdi_node_compute_seconds_total", "counter", "Seconds each node spent computing frames.",
           per_node("compute_seconds"))
    metric("mdi_node_up", "gauge", "1 when the worker answered /status.",
           [(labels, v) for labels, v in per_node("up")])
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- mdi-start --serve

def default_model_id(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    return os.path.splitext(name)[0] if name.endswith((".gguf", ".pt")) else name


def serve(cfg: RunConfig, host: Optional[str] = None, port: Optional[int] = None, insecure: bool = False,
          log_fn: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> int:
    """Open the ring, then serve until SIGINT/SIGTERM. Raises ConfigError (bad settings) or
    RuntimeError (the ring cannot be opened); returns the exit code otherwise."""
    from werkzeug.serving import make_server
    host = host or cfg.serve.host
    port = port if port is not None else (cfg.serve.port or cfg.starter.port)
    token = cfg.runtime.token
    if token is None and not insecure and not is_loopback(host):
        raise ConfigError("refusing to serve on %s without a shared secret: set MDI_TOKEN or runtime.token_file "
                          "(or pass --insecure on a trusted network)" % host)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    source = ModelSource(cfg.model.path)
    sched = Scheduler(cfg, source, log_fn)
    model_id = cfg.serve.model_name or default_model_id(cfg.model.path)
    app = create_app(sched, model_id, token, ChatTemplate(source.tokenizer, log_fn))
    try:
        server = make_server(host, port, app, threaded=True)
    except OSError as e:
        raise RuntimeError("cannot listen on %s:%d: %s" % (host, port, e.strerror or e))
    server.daemon_threads = True
    stop = threading.Event()
    try:
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    except ValueError:  # not the main thread (embedded use): stop with KeyboardInterrupt only
        previous = None
    http = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="mdi-http", daemon=True)
    http.start()
    code = 0
    try:
        sched.start()
        deadline = time.monotonic() + cfg.runtime.init_timeout + 60
        while not sched.ready.wait(0.5):
            if stop.is_set() or time.monotonic() > deadline:
                raise RuntimeError("the ring did not open within %.0f s" % (cfg.runtime.init_timeout + 60))
        if sched.open_error is not None:
            raise sched.open_error
        print("mdi-start serving %s on http://%s:%d: %d samples in flight x %d positions, %d nodes, %s admission"
              % (model_id, host, port, sched.slots, sched.max_len, len(sched.nodes), sched.policy), flush=True)
        while not stop.wait(0.5):
            if not sched.alive:
                log_fn("mdi: serve: the scheduler stopped: %s" % (sched.error or "see the log above"))
                code = 1
                break
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        sched.stop()
        server.server_close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return code
