"""One generation request as the scheduler sees it, and the events it hands the HTTP thread
that waits on it: `TextEvent` pieces, then one `FinishEvent` or `ErrorEvent` (as llama.cpp's
server tasks and vLLM's engine core outputs do it: typed messages, not tuples)."""
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, FrozenSet, List, Optional, Sequence, Tuple, Union

from mdi.model.constraints.grammar_spec import GrammarSpec
from mdi.model.sampling import SamplingParams
from mdi.runconfig import SpeculationSpec
from mdi.serving.streaming import TextStream, TokenLogprob
from mdi.starter.generation_options import GenerationOptions
from mdi.starter.sample import FinishReason, Sample


@dataclass(frozen=True)
class TextEvent:
    text: str  # the next piece of the answer (stop strings already cut)
    logprobs: Tuple[TokenLogprob, ...] = ()  # of the tokens this piece shows (when asked for)


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason  # stop | length | cancelled: the answer is complete


@dataclass(frozen=True)
class ErrorEvent:
    message: str  # the request failed (finish reason "error"); the client gets this message


RequestEvent = Union[TextEvent, FinishEvent, ErrorEvent]


class ChoiceQueue:
    """The event queue of one choice of a request with several (n > 1): its events go to the
    queue the choices share, tagged with the choice's index, so one HTTP thread waits on all."""

    def __init__(self, shared: "queue.Queue[Tuple[int, RequestEvent]]", index: int) -> None:
        self.shared, self.index = shared, index

    def put(self, event: RequestEvent) -> None:
        self.shared.put((self.index, event))


class Request:
    """One generation request as the scheduler sees it. Built on an HTTP thread; after
    `submit` only the scheduler thread touches it, except `mark_cancelled()` and `next_event()`."""

    def __init__(self, prompt_ids: Sequence[int], max_tokens: Optional[int] = None,
                 params: Optional[SamplingParams] = None, seed: Optional[int] = None, stop: Sequence[str] = (),
                 adapter: int = 0, speculation: Optional[SpeculationSpec] = None,
                 top_logprobs: Optional[int] = None, cache_prompt: bool = True,
                 grammar: Optional[GrammarSpec] = None, options: Optional[GenerationOptions] = None) -> None:
        """`options`: its generation options, held as given (the scheduler hands the very value to
        its sample). The separate arguments are the older way to say the same: they build it."""
        if options is None:
            if max_tokens is None or params is None:
                raise TypeError("Request needs options, or max_tokens and params")
            options = GenerationOptions(max_tokens, params, seed, tuple(stop), adapter, speculation, top_logprobs,
                                        cache_prompt, grammar)
        elif (max_tokens, params, seed, tuple(stop), adapter, speculation, top_logprobs, cache_prompt,
              grammar) != (None, None, None, (), 0, None, None, True, None):
            raise TypeError("Request takes options or the separate option arguments, not both")
        self.id = uuid.uuid4().hex[:24]
        self.group = self.id  # the HTTP call it is a choice of (Choices): slots are shared out by call
        self.options = options
        self.constraint: Any = None  # options.grammar compiled (an mdi.model.constraints.constraint.Constraint)
        self.hidden_ids: FrozenSet[int] = frozenset()  # tokens its text leaves out (control_tokens)
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.created = int(time.time())
        self.arrived_at = time.monotonic()
        self.first_token_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        # Set once (by `Scheduler._finish`): the client has its last event.
        self.finish_reason: Optional[FinishReason] = None
        self.completion_tokens = 0
        self.sample: Optional[Sample] = None  # once admitted
        self.text: Optional[TextStream] = None  # once admitted
        self.events: Any = queue.Queue()  # of RequestEvents; a ChoiceQueue for one of several choices
        self._cancel = threading.Event()

    # The options under the names requests always had; read-only, since the value is shared
    # with the sample (a different option is a different value: dataclasses.replace).
    @property
    def max_tokens(self) -> int:
        return self.options.max_tokens

    @property
    def params(self) -> SamplingParams:
        return self.options.params

    @property
    def seed(self) -> Optional[int]:
        return self.options.seed

    @property
    def stop(self) -> List[str]:
        return list(self.options.stop)  # a list, as it always was

    @property
    def adapter(self) -> int:
        return self.options.adapter

    @property
    def speculation(self) -> Optional[SpeculationSpec]:
        return self.options.speculation

    @property
    def top_logprobs(self) -> Optional[int]:
        return self.options.top_logprobs

    @property
    def cache_prompt(self) -> bool:
        return self.options.cache_prompt

    @property
    def grammar(self) -> Optional[GrammarSpec]:
        return self.options.grammar

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def mark_cancelled(self) -> None:
        self._cancel.set()

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens its sample started after: what the prefix cache held of them."""
        sample = self.sample
        if sample is None:
            return 0
        return max(0, min(len(self.prompt_ids), sample.cached_tokens - sample.virtual))

    def next_event(self, timeout: float) -> Optional[RequestEvent]:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None
