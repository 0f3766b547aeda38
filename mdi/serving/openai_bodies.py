"""The OpenAI-shaped bodies that answer one generation request: a whole completion (chat or
text, one choice per sample of `n`), or its stream's chunks (one choice each, by index), the
last of each choice with its finish reason, and the usage."""
from typing import Any, Dict, List, Optional, Sequence

from mdi.serving.logprob_bodies import TokenTexts, chat_logprobs, completion_logprobs
from mdi.serving.request import Request
from mdi.serving.streaming import TokenLogprob
from mdi.serving.tool_calls import ToolReplies
from mdi.starter.sample import FinishReason


class Reply:
    """The OpenAI bodies answering one request (its `n` choices: `reqs`, choice i is reqs[i])."""

    def __init__(self, reqs: Sequence[Request], model_id: str, chat: bool, texts: TokenTexts,
                 tools: Optional[ToolReplies] = None, n: int = 0, continuous_usage: bool = False,
                 include_usage: bool = False) -> None:
        self.reqs, self.model_id, self.chat, self.texts = list(reqs), model_id, chat, texts
        self.n = n or len(self.reqs)  # choices per prompt (several prompts: completions)
        self.tools = tools  # chat with tools: the answers' calls are parsed out of their text
        self.req = self.reqs[0]
        self.id = ("chatcmpl-" if chat else "cmpl-") + self.req.id
        self.with_logprobs = self.req.top_logprobs is not None
        # stream_options.include_usage: the usage in a chunk of its own after every choice's
        # last, and `"usage": null` in every other chunk, as OpenAI's (strict clients read it);
        # vLLM's continuous_usage_stats: every chunk carries the usage so far
        self.include_usage, self.continuous_usage = include_usage, continuous_usage

    @property
    def usage(self) -> Dict[str, Any]:
        """Each prompt once (its choices share it), every choice's completion tokens, and (as
        OpenAI reports it) the prompt tokens each prompt's first choice took from the prefix cache."""
        firsts = self.reqs[::self.n]
        prompt, completion = sum(len(r.prompt_ids) for r in firsts), sum(r.completion_tokens for r in self.reqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}

    def _body(self, kind: str, choices: Any) -> Dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.req.created, "model": self.model_id,
                "choices": choices}

    def _logprobs(self, entries: Optional[Sequence[TokenLogprob]]) -> Optional[Dict[str, Any]]:
        if not self.with_logprobs or entries is None:
            return None
        return chat_logprobs(entries, self.texts) if self.chat else completion_logprobs(entries, self.texts)

    def whole(self, texts: Sequence[str], reasons: Sequence[FinishReason],
              logprobs: Sequence[List[TokenLogprob]]) -> Dict[str, Any]:
        choices = []
        for index, (text, reason, entries) in enumerate(zip(texts, reasons, logprobs)):
            if self.chat and self.tools is not None:
                message = self.tools.message(text)
                called = message.get("tool_calls") or message.get("function_call")
                choices.append({"index": index, "message": message, "logprobs": self._logprobs(entries),
                                "finish_reason": self.tools.finish_reason if called and reason in (
                                    FinishReason.STOP, FinishReason.LENGTH) else reason})
            elif self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": self._logprobs(entries), "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": self._logprobs(entries),
                                "finish_reason": reason})
        body = self._body("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = self.usage
        return body

    def chunk(self, text: Optional[str], reason: Optional[str] = None, first: bool = False,
              index: int = 0, logprobs: Optional[Sequence[TokenLogprob]] = None) -> Dict[str, Any]:
        if self.chat:
            delta: Dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(logprobs), "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": self._logprobs(logprobs),
                      "finish_reason": reason}
        body = self._body("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.continuous_usage:
            body["usage"] = self.usage
        elif self.include_usage:
            body["usage"] = None
        return body

    def chunks(self, text: str, index: int, logprobs: Sequence[TokenLogprob]) -> List[Dict[str, Any]]:
        """The chunks for this much more of choice `index`: one, or with tools the deltas of
        its content and calls (none while text that may start a call is held back)."""
        if self.tools is None:
            return [self.chunk(text, index=index, logprobs=logprobs)]
        bodies: List[Dict[str, Any]] = []
        for delta in self.tools.deltas(index, text) or ([{}] if logprobs and self.with_logprobs else []):
            body = self.chunk(None, index=index, logprobs=logprobs if not bodies else None)
            body["choices"][0]["delta"] = delta
            bodies.append(body)
        return bodies

    def last_chunks(self, reason: FinishReason, index: int = 0) -> List[Dict[str, Any]]:
        """A choice's last chunks: with tools, what was held back, then the finish reason
        ("tool_calls", or legacy "function_call", where it called one)."""
        if self.tools is None:
            return [self.last_chunk(reason, index)]
        bodies: List[Dict[str, Any]] = []
        for delta in self.tools.deltas(index, None):
            body = self.chunk(None, index=index)
            body["choices"][0]["delta"] = delta
            bodies.append(body)
        called = self.tools.called(index) and reason in (FinishReason.STOP, FinishReason.LENGTH)
        return bodies + [self.last_chunk(self.tools.finish_reason if called else reason, index)]

    def last_chunk(self, reason: str, index: int = 0) -> Dict[str, Any]:
        return self.chunk(None if self.chat else "", reason, index=index)

    def usage_chunk(self) -> Dict[str, Any]:
        body = self._body("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage
        return body
