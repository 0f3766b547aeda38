"""The self-overwriting progress line on a terminal while a run goes on."""
import sys
import time


class Progress:
    """One self-overwriting line on a terminal while a batch run generates (on_token callback)."""

    EVERY = 0.25  # seconds between redraws

    def __init__(self, n_samples: int, n_tokens: int) -> None:
        self.total = n_samples * n_tokens
        self.tokens = 0
        self.t0 = self.shown = time.monotonic()

    def __call__(self, sample, token: int) -> None:
        self.tokens += 1
        now = time.monotonic()
        if now - self.shown >= self.EVERY:
            self.shown = now
            rate = self.tokens / max(now - self.t0, 1e-9)
            sys.stderr.write("\rmdi: %d/%d tokens, %.1f tokens/s " % (self.tokens, self.total, rate))
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown > self.t0:  # something was drawn: leave the line clean for what follows
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


class PerplexityProgress(Progress):
    """The progress line of a --perplexity run (its on_window callback)."""

    def __init__(self) -> None:
        super().__init__(0, 0)

    def __call__(self, done: int, total: int, ppl: float, tokens_per_s: float) -> None:  # type: ignore[override]
        now = time.monotonic()
        if now - self.shown >= self.EVERY or done == total:
            self.shown = now
            sys.stderr.write("\rmdi: window %d/%d, perplexity %.4f, %.1f tokens/s " % (done, total, ppl, tokens_per_s))
            sys.stderr.flush()
