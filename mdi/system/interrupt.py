"""A deadline for Python code running in this thread, enforced from another thread; and the
exception a signal raises to stop a run (Interrupted).

Some work cannot check a clock itself: a chat template is the model file's code, and a Jinja
loop that writes nothing (`{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}` over two
long strings) runs for hours with no hook where mdi could look at the time. A timer raises
an exception in the working thread instead (CPython's PyThreadState_SetAsyncExc, delivered at
the next bytecode, so it stops pure Python code, not a C call already running).
"""
import ctypes
import threading
from contextlib import contextmanager
from typing import Iterator, Type


class Interrupted(BaseException):
    """Raised in the main thread by a signal handler (the CLI's, for SIGTERM; a server's as its
    ring opens): stop the run as Ctrl-C does. A BaseException, like KeyboardInterrupt, so no
    `except Exception` eats it."""

    def __init__(self, signum: int) -> None:
        super().__init__("signal %d" % signum)
        self.signum = signum


class DeadlinePassed(Exception):
    """Raised in the thread whose `thread_deadline` ran out."""


def _raise_in(thread_id: int, exc_type) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc_type)


@contextmanager
def thread_deadline(seconds: float, exc_type: Type[BaseException] = DeadlinePassed) -> Iterator[None]:
    """Run the block with `exc_type` raised in it once `seconds` have passed. The exception
    may also surface as the block ends (it ran out just then): callers catch it around the
    `with`, never inside it."""
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _raise_in(thread_id, ctypes.py_object(exc_type))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["fired"]:
                _raise_in(thread_id, None)  # not delivered yet: cleared, so it cannot strike later
