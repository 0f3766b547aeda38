"""Threads with a deep stack, for native code that recurses as deep as its input.

llguidance builds a grammar recursively, one level per rule it follows: a request's GBNF
grammar of 3,000 chained rules (93 KB, under the 128 KB a grammar may have) overflowed a
thread's default 8 MB stack and killed `mdi-start --serve` with SIGSEGV, every client and the
ring with it. On a deeper stack the same grammar is refused in one line. The stack is virtual
memory: only the pages a call touches become resident.
"""
import threading
from typing import Any, Callable, Dict, TypeVar

DEEP_STACK_BYTES = 256 << 20  # 4,100 such rules (the most 128 KB holds) needed under 32 MB

T = TypeVar("T")
_start_lock = threading.Lock()  # threading.stack_size is the whole process's setting


def start_deep_stack_thread(target: Callable[[], Any], name: str) -> threading.Thread:
    """A daemon thread running `target` on a DEEP_STACK_BYTES stack, started."""
    with _start_lock:
        before = threading.stack_size(DEEP_STACK_BYTES)
        try:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()  # the size is taken when the thread starts
        finally:
            threading.stack_size(before)
    return thread


def on_deep_stack(call: Callable[[], T]) -> T:
    """`call()`'s result (or its exception), computed on a thread of its own with a deep stack."""
    outcome: Dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    start_deep_stack_thread(run, "mdi-deep-stack").join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
