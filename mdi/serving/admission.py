"""Who enters the ring: the refusals of a call (`SchedulerError` and its kinds, each with its
HTTP status), and which waiting request a free KV cache slot goes to: the one whose HTTP call
(its group: the choices and prompts of one call, `Choices`) holds the fewest slots now, the
earliest among equals. A call of 200 prompts, or of n = 16, then fills the slots only while
nobody else waits: a short request arriving behind it starts at the next free slot (first
come, first served by sample had kept a 4-token request waiting 192 s behind such a call)."""
import collections
from typing import Deque, Iterable

from mdi.serving.request import Request


class SchedulerError(RuntimeError):
    """A request was refused; `status` is the HTTP status to answer with."""
    status = 503


class QueueFull(SchedulerError):
    status = 429


class TooManySamples(SchedulerError):
    status = 400  # the queue could never hold them: retrying (as clients do a 429) cannot help


class Unavailable(SchedulerError):
    status = 503


class AdapterBusy(SchedulerError):
    status = 409


def next_waiting(waiting: Deque[Request], running: Iterable[Request]) -> Request:
    """Take the next request to admit out of `waiting` (not empty)."""
    held = collections.Counter(req.group for req in running)
    best = min(range(len(waiting)), key=lambda i: (held[waiting[i].group], i))
    req = waiting[best]
    del waiting[best]
    return req
