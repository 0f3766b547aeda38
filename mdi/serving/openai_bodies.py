"""The OpenAI-shaped bodies that answer one generation request: a whole completion (chat or
text), or its stream's chunks, the last with the finish reason, and the usage."""
from typing import Any, Dict, Optional

from mdi.serving.request import Request
from mdi.starter.sample import FinishReason


class Reply:
    """The OpenAI bodies answering one request: a whole completion or its stream's chunks."""

    def __init__(self, req: Request, model_id: str, chat: bool) -> None:
        self.req, self.model_id, self.chat = req, model_id, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + req.id

    def _body(self, kind: str, choices: Any) -> Dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.req.created, "model": self.model_id,
                "choices": choices}

    def whole(self, text: str, reason: FinishReason) -> Dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body = self._body("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = self.req.usage
        return body

    def chunk(self, text: Optional[str], reason: Optional[FinishReason] = None, first: bool = False) -> Dict[str, Any]:
        if self.chat:
            delta: Dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return self._body("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def last_chunk(self, reason: FinishReason, include_usage: bool) -> Dict[str, Any]:
        body = self.chunk(None if self.chat else "", reason)
        body["usage"] = None if include_usage else self.req.usage  # else it comes in a chunk of its own
        return body

    def usage_chunk(self) -> Dict[str, Any]:
        body = self._body("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.req.usage
        return body
