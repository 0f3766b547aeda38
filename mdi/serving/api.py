"""`mdi-start --serve`: the ring as a service, with an OpenAI-compatible HTTP API.

Routes (JSON only; bodies up to 1 MiB; errors in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`):
  POST /v1/completions, POST /v1/chat/completions   (`stream: true` answers server-sent events)
  GET  /v1/models (the model and its LoRA adapters), /v1/models/<id>, GET /health, GET /metrics (Prometheus)
  POST /v1/mdi/adapters {"name", "path"}, DELETE /v1/mdi/adapters/<name>: load or unload a LoRA
       adapter while the ring serves (a request picks one by "model" or llama.cpp's "lora": `adapter_routes`)
  POST / GET / DELETE /v1/mdi/train: start, report and stop a LoRA training job on the serving
       ring, beside the requests (`train_routes`, `train_job`)
  GET  /v1/mdi/state (the dashboard's JSON: the same snapshot as /metrics); GET /, /ui/<file> and
       /v1/mdi/info (the dashboard page, see `dashboard`: the only routes that need no token, they
       hold no data)
With a shared secret (MDI_TOKEN / MDI_TOKEN_FILE / runtime.token_file) every route needs
`Authorization: Bearer <secret>`: the API key OpenAI clients send. Over plain HTTP it crosses
the network in clear, so --serve belongs behind TLS (a reverse proxy) or on a trusted network;
the workers' control plane never sends the secret (it signs requests, mdi/ring/auth.py).

Request fields: see the tables in `validation` (max_tokens defaults to 16 for completions and
to the rest of the slot for chat; unset sampling fields take the YAML's `generation` values).
Chat prompts use the tokenizer's chat template rendered in a sandbox, else a fallback
(`prompts`). Like llama.cpp's server: HTTP threads -> one scheduler thread (`scheduler`) ->
each request's event queue, read back here as one answer or as a stream.
"""
import dataclasses
import json
import logging
import select
import socket
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from mdi.model.constraints.constraint import Constraint, ConstraintError, check_repeats, server_grammars
from mdi.model.constraints.constraint import unavailable as constraint_unavailable
from mdi.model.constraints.grammar_spec import GrammarSpec
from mdi.serving.dashboard import register_dashboard
from mdi.serving.metrics import Observer
from mdi.serving.prompts import (DEFAULT_COMPLETION_TOKENS, FALLBACK_STOPS, ChatTemplate, chat_messages, encode,
                                 prompt_list, token_budget)
from mdi.serving.choices import Choices
from mdi.serving.control_tokens import ControlTokens
from mdi.serving.logprob_bodies import TokenTexts
from mdi.serving.openai_bodies import Reply
from mdi.serving.openai_fields import IGNORED_HEADER
from mdi.serving.tool_calls import ToolReplies
from mdi.serving.tool_grammar import parameter_specs, tool_grammar
from mdi.serving.tools import ToolChoice, tool_choice_of
from mdi.serving.request import ErrorEvent, FinishEvent, GenerationOptions, Request, RequestEvent, TextEvent
from mdi.serving.streaming import TokenLogprob
from mdi.serving.admission import SchedulerError
from mdi.serving.scheduler import Scheduler
from mdi.serving.train_routes import TrainControl
from mdi.serving.adapter_routes import AdapterControl
from mdi.serving.served_files import ServedFiles
from mdi.serving.validation import CHAT, COMPLETIONS, ApiError, Options, parse_options

MAX_BODY_BYTES = 1 << 20
KEEPALIVE = 1.0  # seconds between SSE comments while a stream waits (they also reveal a gone client)
POLL = 0.5  # seconds between checks of a waiting non-streaming request
MAX_SOUND_PARAMETERS = 256  # tools' parameter schemas remembered as compiling (then forgotten at once)

log = logging.getLogger(__name__)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj), status=status, mimetype="application/json")


def _sse(obj: Dict[str, Any]) -> str:
    return "data: %s\n\n" % json.dumps(obj)


def _client_gone(environ: Dict[str, Any]) -> bool:
    """True when the client of a waiting request has closed its connection."""
    gone = environ.get("waitress.client_disconnected")  # mdi's server (mdi/system/http_server.py)
    if gone is not None:
        return bool(gone())
    sock = environ.get("werkzeug.socket")  # werkzeug's development server (tests, embedding)
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class Routes:
    """One method per route; generation requests go to the scheduler thread and their events
    come back through the request's queue."""

    def __init__(self, sched: Scheduler, model_id: str, token: Optional[str], template: ChatTemplate) -> None:
        self.sched, self.model_id, self.token, self.template = sched, model_id, token, template
        self.token_texts = TokenTexts(sched.tokenizer)  # the tokens' texts and bytes that logprobs show
        self.control = ControlTokens(sched.tokenizer, template.tool_format)  # what answers' text leaves out
        # None: response_format, grammar and regex answer 400
        self.grammars = server_grammars(sched.tokenizer, sched.source.config.vocab_size,
                                        sched.cfg.serve.mask_deadline_ms / 1e3)
        self._sound_parameters: Set[GrammarSpec] = set()  # tools' parameters that compiled (_check_parameters)
        # POST /v1/mdi/adapters reads only under the model's folder and the configured adapters';
        # training writes there too, never over what is served (`served_files`).
        cfg = sched.cfg
        self.files = ServedFiles(cfg.model.path, cfg.adapters)
        self.observer = Observer(sched, model_id, sched.cfg.runtime.token)  # /metrics and /v1/mdi/state
        self.adapters = AdapterControl(sched, self.files, model_id, bool(cfg.adapters),
                                       lambda name: self.training.reserves(name),
                                       lambda real: self.training.writes(real))
        self.training = TrainControl(sched, self.files, model_id, self.adapters.made)
        self.observer.job_report = self.training.shown  # /v1/mdi/state shows no server paths either
        self.ignored_said: Set[str] = set()  # ignored OpenAI fields the log has named
        self.started = int(time.time())  # the models' "created": when this server began serving them

    def register(self, app: Flask) -> None:
        register_dashboard(app, self.observer, self.token, "serve")  # also the token rule for every route
        app.register_error_handler(ApiError, self.api_error)
        app.register_error_handler(HTTPException, self.http_error)
        app.register_error_handler(Exception, self.internal_error)
        app.add_url_rule("/health", "health", self.health, methods=["GET"])
        app.add_url_rule("/v1/models", "models", self.models, methods=["GET"])
        app.add_url_rule("/v1/models/<path:model_id>", "model", self.model, methods=["GET"])
        app.add_url_rule("/v1/completions", "completions", self.completions, methods=["POST"])
        app.add_url_rule("/v1/chat/completions", "chat_completions", self.chat_completions, methods=["POST"])
        app.add_url_rule("/v1/mdi/adapters", "load_adapter", lambda: _json(self.adapters.load(_json_body())),
                         methods=["POST"])
        app.add_url_rule("/v1/mdi/adapters/<name>", "unload_adapter", lambda name: _json(self.adapters.unload(name)),
                         methods=["DELETE"])
        app.add_url_rule("/v1/mdi/train", "train", self.train, methods=["POST", "GET", "DELETE"])

    # --- errors ----------------------------------------------------------------------
    def api_error(self, e: ApiError) -> Response:
        return _json(self._shown(e), e.status)

    def _shown(self, e: ApiError) -> Dict[str, Any]:
        """`e`'s body, paths under the models folders shown relative to them (`ServedFiles.scrub`):
        loaders' and workers' messages name files by the server's own paths."""
        body = e.body()
        body["error"]["message"] = self.files.scrub(body["error"]["message"])
        return body

    def http_error(self, e: HTTPException) -> Response:
        message = {404: "no such route: %s %s" % (request.method, request.path),
                   405: "method %s not allowed on %s" % (request.method, request.path),
                   413: "request body larger than %d bytes" % MAX_BODY_BYTES}.get(e.code or 0, e.description or e.name)
        return _json(ApiError(e.code or 500, message).body(), e.code or 500)

    def internal_error(self, e: Exception) -> Response:
        log.exception("request failed")
        return _json(ApiError(500, "internal error: %s" % type(e).__name__, kind="server_error").body(), 500)

    # --- routes ------------------------------------------------------------------------
    def health(self) -> Response:
        sched = self.sched
        body = {"ok": sched.serving, "state": sched.state, "model": self.model_id, "slots": sched.slots,
                "max_len": sched.max_len, "error": sched.error}
        return _json(body, 200 if sched.serving else 503)

    def models(self) -> Response:
        return _json({"object": "list", "data": self._model_cards()})

    def model(self, model_id: str) -> Response:
        """GET /v1/models/<id>: one card of the list (OpenAI's "retrieve model"), else a 404."""
        for card in self._model_cards():
            if card["id"] == model_id:
                return _json(card)
        raise ApiError(404, "the model %r does not exist" % model_id[:80], "model", code="model_not_found")

    def _model_cards(self) -> List[Dict[str, Any]]:
        base = {"id": self.model_id, "object": "model", "created": self.started, "owned_by": "mdi",
                "max_model_len": self.sched.max_len}
        return [base] + [{"id": name, "object": "model", "created": self.started, "owned_by": "mdi",
                          "parent": self.model_id, "max_model_len": self.sched.max_len, "lora_id": i}
                         for i, (_, name) in enumerate(self.adapters.loaded())]

    def completions(self) -> Response:
        opts, fields = parse_options(_json_body(), COMPLETIONS, self.sched.params)
        adapter = self.adapters.adapter_of(fields)
        prompts = prompt_list(fields["prompt"], self.sched.tokenizer, self.sched.max_len)
        budgets = [token_budget(len(ids) + self._virtual(adapter), opts.max_tokens, DEFAULT_COMPLETION_TOKENS,
                                self.sched.max_len) for ids in prompts]
        choices = self._request(prompts[0], budgets[0], opts, adapter, opts.grammar,
                                more_prompts=list(zip(prompts[1:], budgets[1:])))
        return self._generate(choices, opts, self.adapters.answered_as(fields, adapter), chat=False)

    def chat_completions(self) -> Response:
        opts, fields = parse_options(_json_body(), CHAT, self.sched.params)
        adapter = self.adapters.adapter_of(fields)
        tools = tool_choice_of(fields, self.template.tool_format)  # None: no tools, or tool_choice "none"
        grammar = tool_grammar(tools, self.template.tool_format, opts.grammar)  # None: the calls are free
        if grammar is not None and self.grammars is None and tools is not None and tools.mode == "auto" \
                and opts.grammar is None and not any(f.get("strict") for f in tools.functions):
            grammar = None  # no constrained sampler (llguidance missing): auto answers are parsed only
        if grammar is not None and tools is not None and self.grammars is not None:
            self._check_parameters(tools)
            if opts.grammar is not None:  # inside the calls' grammar: its cost is its own field's
                self._check_repeats(opts.grammar)
        prompt = self.template.render(chat_messages(fields["messages"]), tools.tools if tools else None,
                                      fields["chat_template_kwargs"])
        if self.template.source == "fallback" and tools is None and opts.grammar is None:  # (a grammar ends it)
            opts = dataclasses.replace(opts, stop=tuple(opts.stop) + FALLBACK_STOPS)
        ids = encode(self.sched.tokenizer, prompt, self.sched.max_len, "messages")
        max_tokens = token_budget(len(ids) + self._virtual(adapter), opts.max_tokens, None, self.sched.max_len,
                                  "max_completion_tokens" if fields.get("max_completion_tokens") else "max_tokens")
        # the calls' grammar wins; an auto answer's text inside it follows response_format
        choices = self._request(ids, max_tokens, opts, adapter, grammar or opts.grammar, tools is not None)
        return self._generate(choices, opts, self.adapters.answered_as(fields, adapter), chat=True, tools=tools,
                              tools_constrained=grammar is not None)

    def _request(self, ids: List[int], max_tokens: int, opts: Options, adapter: int, grammar: Optional[GrammarSpec],
                 tools: bool = False, more_prompts: Sequence[Tuple[List[int], int]] = ()) -> Choices:
        """The request's choices, once the fields that depend on the server are checked;
        `grammar`: what their output must obey (compiled here: a bad one is this request's 400)."""
        vocab = self.sched.tokenizer.vocab_size
        for field, ids_named in (("logit_bias", opts.params.logit_bias), ("stop_token_ids", opts.stop_token_ids)):
            outside = [t for t in ids_named if t >= vocab]
            if outside:
                raise ApiError(400, "'%s': token id %d is outside the vocabulary (0 to %d)"
                               % (field, min(outside), vocab - 1), field)
        spec = opts.speculation
        if spec is not None and spec.method == "draft" and self.sched.cfg.generation.speculation.method != "draft":
            raise ApiError(400, "'speculation': this server has no draft model (generation.speculation: "
                           "{draft: PATH} in its config)", "speculation")
        if opts.n > self.sched.slots > 0:  # 0 while the ring starts: the submit's 503 says so
            raise ApiError(400, "'n': at most %d choices (the samples this server runs at once)" % self.sched.slots,
                           "n")
        req = Request(ids, options=GenerationOptions(max_tokens, opts.params, opts.seed, tuple(opts.stop), adapter,
                                                     opts.speculation, opts.top_logprobs, opts.cache_prompt, grammar,
                                                     opts.stop_token_ids, opts.min_tokens, opts.ignore_eos,
                                                     opts.include_stop_str))
        if req.grammar is not None:  # every sample (prompts x n) computes its own masks each step
            req.constraint = self._compile(req.grammar, opts.n * (1 + len(more_prompts)))
        req.hidden_ids = self.control.hidden(opts.skip_special_tokens, tools)
        return Choices(req, opts.n, more_prompts)

    def _compile(self, spec: GrammarSpec, choices: int) -> Constraint:
        if self.grammars is None:
            raise ApiError(400, "'%s': structured outputs are off on this server: %s"
                           % (spec.field, constraint_unavailable()), spec.field)
        try:
            return self.grammars.compile(spec, choices)
        except ConstraintError as e:
            raise _refused(e) from None

    @staticmethod
    def _check_repeats(spec: GrammarSpec) -> None:
        try:
            check_repeats(spec)
        except ConstraintError as e:
            raise _refused(e) from None

    def _check_parameters(self, tools: ToolChoice) -> None:
        """Each function's parameters compiled alone, once per schema (agents send the same tools
        with every request): a 400 naming the function where no text satisfies them."""
        assert self.grammars is not None  # (the caller asks only where a constrained sampler exists)
        for name, spec in parameter_specs(tools):
            if spec in self._sound_parameters:
                continue
            try:
                self.grammars.compile(spec)
            except ConstraintError as e:
                raise ApiError(400, "'tools': function %r's parameters: %s" % (name[:64], e), "tools") from None
            if len(self._sound_parameters) >= MAX_SOUND_PARAMETERS:
                self._sound_parameters.clear()
            self._sound_parameters.add(spec)

    # --- adapters ------------------------------------------------------------------------
    def _virtual(self, adapter: int) -> int:
        engine = self.sched.engine
        return engine.virtual_tokens(adapter) if engine is not None else 0

    # --- training beside serving ---------------------------------------------------------------
    def train(self) -> Response:
        if request.method == "POST":
            return _json(self.training.start(_json_body()))
        if request.method == "DELETE":
            return _json(self.training.stop())
        return _json(self.training.report())

    # --- one generation ----------------------------------------------------------------
    def _generate(self, choices: Choices, opts: Options, model: str, chat: bool, tools: Optional[ToolChoice] = None,
                  tools_constrained: bool = False) -> Response:
        try:
            self.sched.submit(choices.requests)
        except SchedulerError as e:
            kind = {400: "invalid_request_error", 429: "rate_limit_error"}.get(e.status, "server_error")
            param = None if e.status != 400 else "prompt" if len(choices) > choices.n else "n"
            raise ApiError(e.status, str(e), param=param, kind=kind)
        hide_tag = opts.skip_special_tokens and self.control.python_tag_is_control
        reply = Reply(choices.requests, model, chat, self.token_texts,
                      ToolReplies(tools, self.template.tool_format, hide_tag, tools_constrained)
                      if tools is not None else None, choices.n, opts.continuous_usage, opts.include_usage)
        if not opts.stream:
            resp = self._whole(choices, reply, request.environ)
        else:
            resp = Response(self._stream(choices, reply), mimetype="text/event-stream")
            resp.headers["Cache-Control"] = "no-cache"
            resp.headers["X-Accel-Buffering"] = "no"
        if opts.ignored:
            resp.headers[IGNORED_HEADER] = ", ".join(opts.ignored)
            self._say_ignored(opts.ignored)
        return resp

    def _say_ignored(self, names: Sequence[str]) -> None:
        """Log each ignored field the first time a request sets it: clients that send one send
        it on every call, and a line per request would bury the log."""
        new = [n for n in names if n not in self.ignored_said]
        if new:
            self.ignored_said.update(new)
            log.info("mdi: serve: ignoring OpenAI field(s) %s (accepted, not acted on; answers name them in %s)",
                     ", ".join(new), IGNORED_HEADER)

    def _cancel(self, reqs: List[Request]) -> None:
        for req in reqs:
            self.sched.cancel(req)  # nothing for one already finished

    def _next_event(self, choices: Choices, timeout: float) -> Optional[Tuple[int, RequestEvent]]:
        got = choices.next_event(timeout)
        if got is None and not self.sched.alive:
            got = choices.next_event(0) or (0, ErrorEvent("the scheduler stopped"))
        return got

    def _whole(self, choices: Choices, reply: Reply, environ: Dict[str, Any]) -> Response:
        """Wait for every choice's events, watching for a client that hangs up (it frees the slots)."""
        n = len(choices)
        parts: List[List[str]] = [[] for _ in range(n)]
        logprobs: List[List[TokenLogprob]] = [[] for _ in range(n)]
        reasons: List[Any] = [None] * n
        check = time.monotonic() + POLL
        while any(r is None for r in reasons):
            got = self._next_event(choices, POLL)
            if time.monotonic() >= check:
                check = time.monotonic() + POLL
                if _client_gone(environ):
                    self._cancel(choices.requests)
                    return _json(ApiError(499, "client closed the request").body(), 499)
            if got is None:
                continue
            i, event = got
            if isinstance(event, TextEvent):
                parts[i].append(event.text)
                logprobs[i].extend(event.logprobs)
            elif isinstance(event, ErrorEvent):
                self._cancel(choices.requests)
                raise ApiError(503, event.message, kind="server_error")
            elif isinstance(event, FinishEvent):
                reasons[i] = event.reason
        return _json(reply.whole(["".join(p) for p in parts], reasons, logprobs))

    def _stream(self, choices: Choices, reply: Reply) -> Iterator[str]:
        over, left = False, len(choices)
        try:
            if reply.chat:
                for i in range(left):
                    yield _sse(reply.chunk("", first=True, index=i))
            got: Optional[Tuple[int, RequestEvent]] = None
            heard = time.monotonic()  # when the client last got a byte: text held back (a tool call being written) sends none
            while left:
                got = got or self._next_event(choices, KEEPALIVE)
                if got is None or time.monotonic() - heard >= KEEPALIVE:
                    heard = time.monotonic()
                    yield ": keep-alive\n\n"
                    continue
                (i, event), got = got, None
                if isinstance(event, TextEvent):
                    text, entries = event.text, list(event.logprobs)
                    got = choices.next_event(0)
                    while got is not None and got[0] == i and isinstance(got[1], TextEvent):  # already there: one chunk
                        text += got[1].text
                        entries += got[1].logprobs
                        got = choices.next_event(0)
                    for body in reply.chunks(text, i, entries):
                        heard = time.monotonic()
                        yield _sse(body)
                    continue
                if isinstance(event, ErrorEvent):
                    self._cancel(choices.requests)  # the other choices with it
                    over = True
                    yield _sse(self._shown(ApiError(503, event.message, kind="server_error")))
                    yield "data: [DONE]\n\n"  # (as vLLM ends a stream that failed: clients wait for it)
                    return
                left -= 1
                over = not left
                for body in reply.last_chunks(event.reason, index=i):
                    yield _sse(body)
            if reply.include_usage:
                yield _sse(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            if not over:  # the client went away (or the server is stopping): free the slots
                self._cancel(choices.requests)


def _json_body() -> Dict[str, Any]:
    if request.mimetype != "application/json":
        raise ApiError(400, "expected Content-Type: application/json")
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise ApiError(413, "request body larger than %d bytes" % MAX_BODY_BYTES)
    # Read at most one byte past the limit ourselves: a chunked body has no Content-Length, and
    # werkzeug's own limit (MAX_CONTENT_LENGTH, left unset for that reason) would cut it at the
    # limit and leave the JSON parser to fail on half a body.
    raw = request.stream.read(MAX_BODY_BYTES + 1)
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, "request body larger than %d bytes" % MAX_BODY_BYTES)
    try:
        data = json.loads(raw.decode("utf-8"))
        # JSON may escape a lone UTF-16 surrogate ("\ud800"): no tokenizer can encode that text.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the body holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text")
    except (UnicodeDecodeError, ValueError) as e:
        if "integer string conversion" in str(e):  # CPython's limit, its message naming its own setting
            raise ApiError(400, "the body holds a number of more than 4300 digits")
        raise ApiError(400, "the body is not valid JSON: %s" % e)
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply")
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    return data


def create_app(sched: Scheduler, model_id: str, token: Optional[str], template: ChatTemplate) -> Flask:
    app = Flask("mdi-serve")
    Routes(sched, model_id, token, template).register(app)
    return app


def _refused(e: ConstraintError) -> ApiError:
    """A grammar's refusal as the request's 400, naming its field."""
    return ApiError(400, "'%s': %s" % (e.field, e), e.field)
