"""A request's prompt as token ids: a completion prompt (text or ids), or chat messages rendered
with the model's chat template; and the token budget that must fit one KV cache slot."""
import logging
import time
from typing import Any, Dict, List, Optional

from mdi.model.tokenizers import PromptTooLong, Tokenizer, TokenizerError
from mdi.runconfig import ConfigError
from mdi.serving.legacy_functions import legacy_message
from mdi.serving.tools import ToolError, ToolFormat, check_answered_calls, template_inputs, tool_format, tool_message
from mdi.serving.validation import ApiError
from mdi.system.interrupt import DeadlinePassed, thread_deadline
from mdi.system.memory import release_freed_memory

MAX_MESSAGES = 1024
MAX_NAME_CHARS = 64  # a message's `name` (OpenAI's limit)
# A chat template is the model file's code, run for every chat request. Jinja's sandbox bounds
# `range` only: 'x' * 10**8 built 100 MB and a list repeat 1.5 GB per request. Bounded here: a
# `*` or `**` whose result would pass MAX_TEMPLATE_VALUE items (or bits), and a rendering that
# passes MAX_TEMPLATE_CHARS (checked as its output streams) or MAX_TEMPLATE_SECONDS (a timer
# stops it, even in a loop that writes nothing: mdi.system.interrupt).
MAX_TEMPLATE_VALUE = 1 << 20
MAX_TEMPLATE_CHARS = 1 << 22
MAX_TEMPLATE_SECONDS = 2.0
MAX_TEMPLATE_FILE = 1 << 20  # serve.chat_template: a template, not a file read by mistake
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # function: legacy results
# Where an answer in the fallback's format would start the next turn: it ends there (a model
# without a template of its own would otherwise write the user's next line, and the next...)
FALLBACK_STOPS = tuple("\n%s:" % role for role in ("user", "assistant", "system", "tool"))
# An assistant message's reasoning as vLLM's servers return it and clients send it back
# (reasoning_content; vLLM >= 0.10: reasoning): the template gets it as reasoning_content, the
# name Qwen3's and DeepSeek's templates read (and most leave out of earlier turns).
REASONING_KEYS = ("reasoning_content", "reasoning")
# tool_calls, tool_call_id: `tools`; function_call: legacy calls; the rest ANSWER_KEYS
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal",
                "annotations", "audio", "parsed") + REASONING_KEYS
# An earlier answer's keys, sent back as OpenAI's SDK returns its message (`model_dump()`):
# its refusal, its content's url citations, an audio reply's id (and transcript...), what the
# SDK's parse() helpers parsed from its content, checked by OpenAI's shape. Nothing to render
# but its reasoning (`_message`); the others are ignored (`openai_fields` names a set audio).
ANSWER_KEYS = (
    ("refusal", lambda v: isinstance(v, str), "a string"),
    ("parsed", lambda v: True, "any value"),
    ("annotations", lambda v: isinstance(v, list) and all(isinstance(a, dict) for a in v), "a list of objects"),
    ("audio", lambda v: isinstance(v, dict) and isinstance(v.get("id"), str), '{"id": string}'),
) + tuple((key, lambda v: isinstance(v, str), "a string") for key in REASONING_KEYS)

log = logging.getLogger(__name__)


class ChatTemplate:
    """The model's chat template (Jinja, sandboxed as transformers renders it) or the fallback."""

    def __init__(self, tokenizer: Tokenizer, text: Optional[str] = None, where: str = "") -> None:
        """`text`: a template given instead of the model's own (`where`: its file), refused
        (ConfigError) where it does not compile rather than left for the fallback."""
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = _bounded_environment()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        env.filters["tojson"] = _tojson
        self.tokenizer = tokenizer
        self.source = "fallback"
        template = None
        if text is not None:
            try:
                template = env.from_string(text)
            except TemplateError as e:
                raise ConfigError("%s: not a Jinja chat template (%s)" % (where, " ".join(str(e).split())))
            self.source = "config"
        elif tokenizer.chat_template:
            try:
                template = env.from_string(tokenizer.chat_template)
                self.source = "model"
            except TemplateError as e:
                log.warning("mdi: serve: the model's chat template does not compile (%s); using the fallback", e)
        else:  # a GGUF may carry none (the Gemma 3 270M GGUF does not): its answers are then poor
            log.warning("mdi: serve: the model has no chat template: chat requests use a plain 'role: text' "
                        "fallback; give one with --chat-template FILE.jinja (configs/chat_templates/ holds some)")
        self.template = template if template is not None else env.from_string(FALLBACK_CHAT_TEMPLATE)
        # how the model writes tool calls, and whether the template renders tools (`tools`)
        own = {"config": text, "model": tokenizer.chat_template}.get(self.source)
        self.tool_format: ToolFormat = tool_format(own, tokenizer)
        self.bos = self._token_text(tokenizer.bos_id)
        self.eos = self._token_text(tokenizer.eos_id)

    @classmethod
    def of_config(cls, tokenizer: Tokenizer, path: Optional[str]) -> "ChatTemplate":
        """The model's template, or where `path` (serve.chat_template) names a file, that file's."""
        if not path:
            return cls(tokenizer)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(MAX_TEMPLATE_FILE + 1)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("serve.chat_template: cannot read %s (%s)" % (path, getattr(e, "strerror", None) or e))
        if len(text) > MAX_TEMPLATE_FILE:
            raise ConfigError("serve.chat_template: %s is longer than %d characters" % (path, MAX_TEMPLATE_FILE))
        return cls(tokenizer, text, "serve.chat_template: %s" % path)

    def _token_text(self, token_id: Optional[int]) -> str:
        if token_id is None:
            return ""
        try:
            return self.tokenizer.decode([token_id])
        except TokenizerError:
            return ""

    def render(self, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]] = None,
               kwargs: Optional[Dict[str, Any]] = None) -> str:
        """The prompt; `tools` (OpenAI tool dicts) rendered by the template as transformers
        passes them, or by the fallback of `tools` where the template knows no tools; `kwargs`:
        more names for the template (a request's chat_template_kwargs, e.g. enable_thinking)."""
        from jinja2 import TemplateError
        parts, size = [], 0
        extra: Dict[str, Any] = dict(kwargs or {})
        own = sorted(set(extra) & set(self.template.environment.globals))  # namespace, range, strftime_now...
        if own:
            raise ApiError(400, "%s is the chat template's own name: a request may not replace it"
                           % own[0], "chat_template_kwargs")
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages, tools = template_inputs(messages, tools, self.tool_format)
            if tools:
                extra["tools"] = tools
        try:
            with thread_deadline(MAX_TEMPLATE_SECONDS):
                for part in self.template.generate(messages=messages, add_generation_prompt=True,
                                                   bos_token=self.bos, eos_token=self.eos, **extra):
                    parts.append(part)
                    size += len(part)
                    if size > MAX_TEMPLATE_CHARS:
                        raise ApiError(400, "the chat template wrote more than %d characters for these messages"
                                       % MAX_TEMPLATE_CHARS, "messages")
        except DeadlinePassed:
            raise ApiError(400, "the chat template ran longer than %.0f s for these messages" % MAX_TEMPLATE_SECONDS,
                           "messages") from None
        except TemplateError as e:  # SecurityError included: a value past MAX_TEMPLATE_VALUE
            raise ApiError(400, "the chat template refused these messages: %s" % e, "messages")
        except (ApiError, MemoryError):
            raise
        except Exception as e:  # what the template did with a request's values ('Today: ' + 5): theirs to fix
            raise ApiError(400, "the chat template failed on these messages%s: %s: %s"
                           % (" and chat_template_kwargs" if kwargs else "", type(e).__name__, e), "messages")
        text = "".join(parts)
        if self.tokenizer.add_bos and self.bos and text.startswith(self.bos):
            text = text[len(self.bos):]  # the tokenizer adds BOS itself
        return text


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` for chat templates: plain JSON (Jinja's own escapes <, > and &
    for HTML, which would change the tool lists templates write)."""
    import json
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _bounded_environment():
    """Jinja's immutable sandbox (as transformers renders chat templates), with `*` and `**`
    refused past MAX_TEMPLATE_VALUE items or bits."""
    import operator
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
            if op == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_VALUE:
                        raise SecurityError("a repetition of more than %d items" % MAX_TEMPLATE_VALUE)
                return operator.mul(left, right)
            if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    right * max(1, abs(left)).bit_length() > MAX_TEMPLATE_VALUE:
                raise SecurityError("a power of more than %d bits" % MAX_TEMPLATE_VALUE)
            return super().call_binop(context, op, left, right)
    return Bounded


def chat_messages(raw: List[Any]) -> List[Dict[str, Any]]:
    """The `messages` list (already known to be a list) as role/content pairs for the template."""
    if not raw:
        raise ApiError(400, "'messages': expected a non-empty list of messages", "messages")
    if len(raw) > MAX_MESSAGES:
        raise ApiError(400, "'messages': at most %d messages" % MAX_MESSAGES, "messages")
    messages = [_message(m, "messages[%d]" % i) for i, m in enumerate(raw)]
    try:
        check_answered_calls(messages)
    except ToolError as e:
        raise ApiError(400, str(e), e.param)
    return messages


def _message(m: Any, where: str) -> Dict[str, Any]:
    out = _message_of(m, where)  # (an assistant's reasoning checked there, with the other ANSWER_KEYS)
    for key in REASONING_KEYS:
        if m.get(key) is not None:
            out["reasoning_content"] = m[key]
    name = m.get("name")
    if name is not None and m.get("role") != "function":  # (a legacy function result's name is its call's id)
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ApiError(400, "'%s.name': expected a participant's name, a string of 1 to %d characters"
                           % (where, MAX_NAME_CHARS), where + ".name")
        out["name"] = name  # for templates that read it (as transformers passes it on)
    return out


def _message_of(m: Any, where: str) -> Dict[str, Any]:
    if not isinstance(m, dict):
        raise ApiError(400, "'%s': expected an object with 'role' and 'content'" % where, where)
    unknown = sorted(set(m) - set(MESSAGE_KEYS))
    if unknown:
        raise ApiError(400, "'%s': unknown key %r" % (where, unknown[0]), where)
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(400, "'%s.role': expected one of %s" % (where, ", ".join(CHAT_ROLES)), where + ".role")
    _check_answer_keys(m, role, where)
    if role == "function" or m.get("function_call") is not None:
        try:
            m = legacy_message(m, where)
        except ToolError as e:
            raise ApiError(400, str(e), e.param)
        role = m["role"]
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            # an assistant's refusal sent back (OpenAI's content part) is what it said
            kind = "refusal" if role == "assistant" and isinstance(part, dict) and part.get("type") == "refusal" \
                else "text"
            if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get(kind), str):
                raise ApiError(400, "'%s.content': only text parts (and an assistant's refusal parts) are supported"
                               % where, where + ".content")
            parts.append(part[kind])
        # one line apart, as llama.cpp's server and vLLM join a message's text parts for a template
        content = "\n".join(parts)
    if role == "tool" or m.get("tool_calls") is not None:
        try:
            return tool_message(m, role, content, where)
        except ToolError as e:
            raise ApiError(400, str(e), e.param)
    if m.get("tool_call_id") is not None:
        raise ApiError(400, "'%s.tool_call_id': only tool messages answer a call" % where, where + ".tool_call_id")
    if content is None and role == "assistant":  # a refusal, or an answer cut before its first call
        content = m.get("refusal") or ""
    if not isinstance(content, str):
        raise ApiError(400, "'%s.content': expected a string" % where, where + ".content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _check_answer_keys(m: Dict[str, Any], role: str, where: str) -> None:
    """ANSWER_KEYS: null in any message, their shape in an assistant message only."""
    for key, fits, expected in ANSWER_KEYS:
        if m.get(key) is not None and not (role == "assistant" and fits(m[key])):
            raise ApiError(400, "'%s.%s': expected %s in an assistant message" % (where, key, expected),
                           "%s.%s" % (where, key))


MAX_PROMPTS = 256  # prompts in one completions request (each waits for a slot as a request would)


def prompt_list(prompt: Any, tokenizer: Tokenizer, max_len: int) -> List[List[int]]:
    """The completion prompts as token ids, as OpenAI takes them: a string, token ids, or a list
    of strings or of token-id lists (several prompts: their choices come in prompt order)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, "'prompt': at most %d prompts in one request" % MAX_PROMPTS, "prompt")
        return [prompt_ids(p, tokenizer, max_len, "prompt[%d]" % i) for i, p in enumerate(prompt)]
    return [prompt_ids(prompt, tokenizer, max_len)]


def prompt_ids(prompt: Any, tokenizer: Tokenizer, max_len: int, where: str = "prompt") -> List[int]:
    """One completion prompt as token ids: a string or token ids."""
    if isinstance(prompt, str):
        return encode(tokenizer, prompt, max_len, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise ApiError(400, "'%s': token ids must be in [0, %d)" % (where, tokenizer.vocab_size), "prompt")
        return list(prompt)
    raise ApiError(400, "'%s': expected a string or a list of token ids" % where, "prompt")


def encode(tokenizer: Tokenizer, text: str, max_len: int, param: str) -> List[int]:
    """The prompt's ids; a prompt that cannot leave a position free in a slot of `max_len`
    is refused before it is tokenized where the tokenizer can tell (Tokenizer.encode_prompt),
    and what tokenizing a refused one left behind goes back to the OS."""
    try:
        ids = tokenizer.encode_prompt(text, max_tokens=max_len - 1)
    except PromptTooLong as e:
        raise context_exceeded(max_len, "at least %d" % e.at_least, param)
    except TokenizerError as e:
        raise ApiError(400, "cannot tokenize the prompt: %s" % e, param)
    if len(ids) >= max_len:
        n = len(ids)
        del ids
        release_freed_memory()
        raise context_exceeded(max_len, str(n), param)
    return ids


def context_exceeded(max_len: int, n_prompt: str, param: str) -> ApiError:
    return ApiError(400, "this server's maximum context length is %d tokens, but the prompt has %s tokens "
                    "(a prompt leaves at least 1 for the answer)" % (max_len, n_prompt), param,
                    "context_length_exceeded")


def token_budget(n_prompt: int, max_tokens: Optional[int], default: Optional[int], max_len: int,
                 field: str = "max_tokens") -> int:
    """max_tokens for this request (`default` when unset; None: the rest of the slot), or a 400
    naming `field` (the one the request set) when prompt + max_tokens cannot fit a slot of
    `max_len` positions."""
    room = max_len - n_prompt
    if room < 1:
        raise context_exceeded(max_len, str(n_prompt), "messages" if default is None else "prompt")
    if max_tokens is None:
        return room if default is None else min(default, room)
    if max_tokens > room:
        raise ApiError(400, "this server's maximum context length is %d tokens; you requested %d tokens "
                       "(%d in the prompt, %d for the completion)" % (max_len, n_prompt + max_tokens, n_prompt,
                                                                     max_tokens),
                       field, "context_length_exceeded")
    return max_tokens
