"""OpenAI request fields mdi accepts and does not act on: their values are checked loosely (by
OpenAI's schema: the JSON type, and metadata's shape), then they are set aside, and the answer
names them in `X-MDI-Ignored-Fields` (IGNORED_HEADER) and the log says so once per field.

Why accept them at all: agent frameworks and SDK wrappers set some of these on every call
(`store`, `metadata`, `user`, `prompt_cache_key`...), OpenAI takes them, vLLM and llama.cpp's
server ignore what they do not use; a 400 for them made a client that works everywhere fail
here. Enumerated strings (`service_tier`, `verbosity`, `reasoning_effort`) are checked as
strings only: OpenAI adds values to them, and a value mdi ignores cannot be wrong for mdi.
"""
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

IGNORED_HEADER = "X-MDI-Ignored-Fields"
CHAT_ROUTE, COMPLETIONS_ROUTE = "chat", "completions"  # validation.CHAT, validation.COMPLETIONS
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


def _string(value: Any) -> Optional[str]:
    return None if isinstance(value, str) else "expected a string"


def _bool(value: Any) -> Optional[str]:
    return None if isinstance(value, bool) else "expected true or false"


def _object(value: Any) -> Optional[str]:
    return None if isinstance(value, dict) else "expected an object"


def _metadata(value: Any) -> Optional[str]:
    """OpenAI's metadata: up to 16 string keys (64 characters) with string values (512)."""
    if not isinstance(value, dict):
        return "expected an object of strings"
    if len(value) > MAX_METADATA_KEYS:
        return "at most %d keys" % MAX_METADATA_KEYS
    for key, v in value.items():
        if len(key) > MAX_METADATA_KEY:
            return "keys are at most %d characters" % MAX_METADATA_KEY
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            return "key %s: expected a string of at most %d characters" % (json.dumps(key)[:40], MAX_METADATA_VALUE)
    return None


def _prediction(value: Any) -> Optional[str]:
    """{"type": "content", "content": text or a list of text parts}: predicted output."""
    content = value.get("content") if isinstance(value, dict) else None
    parts_ok = isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                 for p in content)
    if not isinstance(value, dict) or value.get("type") != "content" or not (isinstance(content, str) or parts_ok):
        return 'expected {"type": "content", "content": string or text parts}'
    return None


@dataclass(frozen=True)
class Ignored:
    name: str
    check: Callable[[Any], Optional[str]]  # None where the value is fine, else what was expected
    routes: Tuple[str, ...] = (CHAT_ROUTE,)
    why: str = ""  # what mdi does instead (the README's table says the same)


IGNORED = (
    Ignored("user", _string, (CHAT_ROUTE, COMPLETIONS_ROUTE), "an end-user id for abuse tracking"),
    Ignored("safety_identifier", _string, why="user's successor"),
    Ignored("store", _bool, why="nothing is stored"),
    Ignored("metadata", _metadata, why="only for stored completions"),
    Ignored("service_tier", _string, why="one tier"),
    Ignored("prompt_cache_key", _string, why="the prefix cache finds a shared prefix by its tokens, key or not"),
    Ignored("prompt_cache_retention", _string, why="the prefix cache keeps what its memory budget holds"),
    Ignored("prompt_cache_options", _object, why="no explicit cache breakpoints"),
    Ignored("moderation", _object, why="no moderation"),
    Ignored("prediction", _prediction, why="predicted outputs; speculation has its own field"),
    Ignored("reasoning_effort", _string, why="no reasoning budget"),
    Ignored("verbosity", _string, why="no verbosity control"),
    Ignored("web_search_options", _object, why="no web search"),
    Ignored("audio", _object, why="text only; modalities with audio is refused"),
)


# Keys of chat messages that are set aside and named ("messages[].audio"; `prompts` checks
# them): an earlier answer's audio, by its id as OpenAI's SDK returns the message, cannot be
# replayed to a text model. (Its `refusal` and `annotations` are accepted unnamed: the text
# they go with is all there is.)
MESSAGE_IGNORED = ("audio",)


def set_aside(body: Dict[str, Any], route: str) -> Tuple[List[str], Optional[Tuple[str, str]]]:
    """(the ignored fields `body` sets, sorted; (field, what was expected) for the first whose
    value is wrong, or None). JSON null counts as absent, as everywhere."""
    names: List[str] = []
    for field in IGNORED:
        value = body.get(field.name)
        if route not in field.routes or value is None:
            continue
        wrong = field.check(value)
        if wrong is not None:
            return names, (field.name, wrong)
        names.append(field.name)
    if route == CHAT_ROUTE:
        names += _set_in_messages(body.get("messages"))
    return sorted(names), None


def _set_in_messages(messages: Any) -> List[str]:
    """The MESSAGE_IGNORED keys some message sets (not null), as "messages[].key"."""
    if not isinstance(messages, list):
        return []
    return ["messages[].%s" % key for key in MESSAGE_IGNORED
            if any(isinstance(m, dict) and m.get(key) is not None for m in messages)]


def ignored_names(route: str) -> List[str]:
    return [f.name for f in IGNORED if route in f.routes]
