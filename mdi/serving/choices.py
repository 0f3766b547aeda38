"""The `n` choices of one request: n requests for the scheduler, one per sample, sharing the
prompt and seeded seed, seed + 1, ... (so choice i is the single request with seed + i), whose
events one HTTP thread reads from a single queue. They share nothing else: each prefills the
prompt itself (they are admitted together, so none finds the prompt in the prefix cache yet).
A completions request of several prompts has n choices for each, in prompt order (OpenAI's
index: prompt * n + choice), each prompt with its own token budget."""
import dataclasses
import queue
from typing import List, Optional, Sequence, Tuple

from mdi.serving.request import ChoiceQueue, Request, RequestEvent


class Choices:
    def __init__(self, first: Request, n: int, more_prompts: Sequence[Tuple[List[int], int]] = ()) -> None:
        """`more_prompts`: (token ids, max_tokens) of each further prompt."""
        self.n = n
        self.requests = [first] + [_copy(first, i) for i in range(1, n)]
        for ids, max_tokens in more_prompts:
            self.requests += [_copy(first, i, ids, max_tokens) for i in range(n)]
        self.events: "Optional[queue.Queue[Tuple[int, RequestEvent]]]" = None
        if len(self.requests) > 1:
            self.events = queue.Queue()
            for i, req in enumerate(self.requests):
                req.events = ChoiceQueue(self.events, i)
                req.group = first.id

    def __len__(self) -> int:
        return len(self.requests)

    def next_event(self, timeout: float) -> Optional[Tuple[int, RequestEvent]]:
        """(choice index, its next event), or None after `timeout` seconds."""
        if self.events is None:
            event = self.requests[0].next_event(timeout)
            return None if event is None else (0, event)
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


def _copy(req: Request, i: int, prompt_ids: Optional[List[int]] = None, max_tokens: Optional[int] = None) -> Request:
    """Choice i of `req`: the same prompt and options but the seed, seed + i (a random seed when
    none); or of another prompt, with its own token budget."""
    options = req.options.with_seed(None if req.seed is None else req.seed + i)
    if max_tokens is not None:
        options = dataclasses.replace(options, max_tokens=max_tokens)
    choice = Request(req.prompt_ids if prompt_ids is None else prompt_ids, options=options)
    if req.constraint is not None:
        choice.constraint = req.constraint.fresh()  # each choice's grammar state is its own
    choice.hidden_ids = req.hidden_ids
    return choice
