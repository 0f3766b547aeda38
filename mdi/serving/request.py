"""One generation request as the scheduler sees it, and the events it hands the HTTP thread
that waits on it: `TextEvent` pieces, then one `FinishEvent` or `ErrorEvent` (as llama.cpp's
server tasks and vLLM's engine core outputs do it: typed messages, not tuples)."""
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Union

from mdi.model.sampling import SamplingParams
from mdi.runconfig import SpeculationSpec
from mdi.serving.streaming import TextStream
from mdi.starter.sample import FinishReason, Sample


@dataclass(frozen=True)
class TextEvent:
    text: str  # the next piece of the answer (stop strings already cut)


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason  # stop | length | cancelled: the answer is complete


@dataclass(frozen=True)
class ErrorEvent:
    message: str  # the request failed (finish reason "error"); the client gets this message


RequestEvent = Union[TextEvent, FinishEvent, ErrorEvent]


class Request:
    """One generation request as the scheduler sees it. Built on an HTTP thread; after
    `submit` only the scheduler thread touches it, except `mark_cancelled()` and `next_event()`."""

    def __init__(self, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams,
                 seed: Optional[int] = None, stop: Sequence[str] = (), adapter: int = 0,
                 speculation: Optional[SpeculationSpec] = None, cache_prompt: bool = True) -> None:
        self.id = uuid.uuid4().hex[:24]
        self.speculation = speculation  # None: the server's generation.speculation
        self.cache_prompt = cache_prompt  # may start from what the prefix cache holds
        self.adapter = adapter  # the LoRA adapter's id (0: the base model)
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.max_tokens = int(max_tokens)
        self.params = params
        self.seed = seed
        self.stop = [s for s in stop if s]
        self.created = int(time.time())
        self.arrived_at = time.monotonic()
        self.first_token_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        # Set once (by `Scheduler._finish`): the client has its last event.
        self.finish_reason: Optional[FinishReason] = None
        self.completion_tokens = 0
        self.sample: Optional[Sample] = None  # once admitted
        self.text: Optional[TextStream] = None  # once admitted
        self.events: "queue.Queue[RequestEvent]" = queue.Queue()
        self._cancel = threading.Event()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def mark_cancelled(self) -> None:
        self._cancel.set()

    @property
    def usage(self) -> Dict[str, Any]:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.completion_tokens,
                "total_tokens": len(self.prompt_ids) + self.completion_tokens,
                # OpenAI's: prompt tokens served from the prefix cache, not computed again
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    @property
    def cached_tokens(self) -> int:
        sample = self.sample
        if sample is None:
            return 0
        return max(0, min(len(self.prompt_ids), sample.cached_tokens - sample.virtual))

    def next_event(self, timeout: float) -> Optional[RequestEvent]:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None
