"""How a node's refusal of an adapter or a mix reaches the API client.

A worker answers 413 when it cannot hold what was sent within its memory limit (TooLarge) and
409 when it is busy (NodeBusy); the starter refuses an adapter it has no memory for itself
(StarterTooLarge). Those are the client's to act on: a smaller mix, or a retry later. So they
reach it as 413 and 429, the message naming the node; anything else a node did is the ring's
failure: a 502.
"""
from dataclasses import dataclass
from typing import Optional

from mdi.serving.validation import ApiError
from mdi.starter.adapter_set import StarterTooLarge


@dataclass(frozen=True)
class Refusal:
    """What the client gets for one kind of node refusal."""
    status: int
    kind: str  # OpenAI's error type


TOO_LARGE = Refusal(413, "invalid_request_error")
BUSY = Refusal(429, "rate_limit_error")
FAILED = Refusal(502, "server_error")
_BY_NODE_STATUS = {413: TOO_LARGE, 409: BUSY}


def refusal_of(e: Exception) -> Refusal:
    """The answer for `e`: a NodeError (its `status`, the worker's) or StarterTooLarge."""
    if isinstance(e, StarterTooLarge):
        return TOO_LARGE
    status: Optional[int] = getattr(e, "status", None)
    return _BY_NODE_STATUS.get(status or 0, FAILED)


def node_api_error(e: Exception, param: Optional[str] = None) -> ApiError:
    """The ApiError for a node's refusal; the message (naming the node) is the node's own."""
    refusal = refusal_of(e)
    return ApiError(refusal.status, str(e), param if refusal is not FAILED else None, kind=refusal.kind)
