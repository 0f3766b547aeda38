"""A function another thread hands the scheduler thread to run between two steps
(`Scheduler.between_steps`): where no request is admitted meanwhile and the waiting and
running requests are exactly known. It may be cancelled until it starts."""
import threading
from typing import Any, Callable, Optional


class SchedulerCall:
    """A function another thread has the scheduler thread run (Scheduler.between_steps)."""

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
