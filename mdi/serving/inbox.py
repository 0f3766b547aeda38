"""What other threads and the scheduler thread exchange (`mdi.serving.scheduler`).

In: HTTP handler threads never touch the engine; they put typed messages into the scheduler's
`Inbox` (a request to run, a request to cancel, a function to run between two steps, a wake-up
at shutdown), and the scheduler thread takes them between steps, in order. One type per
message, so the scheduler dispatches on the type, and mypy sees a message's payload (an
untyped `(kind, payload)` tuple could carry a request where a call was meant).

Out: the ring's `RingState`, read by /health, /metrics, /v1/mdi/state and refusals.
"""
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

from mdi.serving.request import Request
from mdi.system.memory import IdleTrim
from mdi.system.str_enum import StrEnum


class RingState(StrEnum):
    """The scheduler's ring, as /health, /metrics and the dashboard's JSON show it: a StrEnum, so
    those see the very strings they always saw."""
    STARTING = "starting"  # the first ring is being opened
    UP = "up"  # serving
    DOWN = "down"  # the ring failed; being rebuilt
    STOPPED = "stopped"  # the ring never opened, or the server is shutting down


class SchedulerCall:
    """A function another thread hands the scheduler thread to run between two steps
    (`Scheduler.between_steps`): where no request is admitted meanwhile and the waiting and
    running requests are exactly known. It may be cancelled until it starts."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.lock = threading.Lock()
        self.started, self.done = threading.Event(), threading.Event()
        self.cancelled = False
        self.value: Any = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        with self.lock:
            if self.cancelled:
                return
            self.started.set()
        try:
            self.value = self.fn()
        except Exception as e:  # handed to the calling thread
            self.error = e
        finally:
            self.done.set()


@dataclass(frozen=True)
class Submit:
    """Queue `request` (already counted in the scheduler's queue length by `submit`)."""
    request: Request


@dataclass(frozen=True)
class Cancel:
    """The client of `request` went away (it is already marked cancelled)."""
    request: Request


@dataclass(frozen=True)
class Call:
    """Run `call` on the scheduler thread, between two steps."""
    call: SchedulerCall


@dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes an idle scheduler so that it sees it is stopping."""


Message = Union[Submit, Cancel, Call, Wake]


class Inbox:
    """The queue into the scheduler thread: only `Message`s go in."""

    def __init__(self) -> None:
        self._queue: "queue.Queue[Message]" = queue.Queue()
        self._idle = IdleTrim()  # the scheduler waits here when idle: its heap's free pages go back then

    def put(self, message: Message) -> None:
        self._queue.put(message)

    def drain(self, wait: Optional[float]) -> Iterator[Message]:
        """The messages waiting, oldest first, each taken only once the one before is handled
        (a generator), until none is left; the first waited for up to `wait` seconds (None:
        not at all), so an idle scheduler sleeps here rather than spinning."""
        try:
            message = self._queue.get(timeout=wait) if wait is not None else self._queue.get_nowait()
        except queue.Empty:
            if wait is None:  # a busy scheduler looks between its steps
                self._idle.worked()
            else:
                self._idle.idle()
            return
        self._idle.worked()
        while True:
            yield message
            try:
                message = self._queue.get_nowait()
            except queue.Empty:
                return
