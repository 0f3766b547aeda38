"""Perplexity of a text file (`mdi-start --perplexity FILE`), the usual measure of what a
quantization costs, standalone or over the ring.

The file is tokenized as plain text (BOS first when the tokenizer adds one, as llama.cpp's
`llama-perplexity` does) and cut into non-overlapping windows of `ctx` tokens. Each window is
run from position 0 in "score" passes of at most 512 rows, as llama-perplexity's ubatches cut it
(so a model's sliding-window layers keep their rings as llama.cpp's SWA cache does), whose every
position comes back round the ring; the starter's head gives float32 log-probabilities and only
the second half of a window's tokens is scored, exactly the tokens llama-perplexity scores
(positions ctx/2 + 1 .. ctx - 1, each predicted from the positions before it, in every window),
so a scored token has more than ctx/2 tokens of context and the two tools' figures compare on
the same GGUF. One window per KV cache slot is in flight, one slot per node, so every node works
on a different window at every step; a window that starts at position 0 overwrites its slot's
cache. Perplexity is exp(mean NLL) over every scored token.
"""
import collections
import dataclasses
import logging
import math
import os
import re
import signal
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from mdi.model.backend import AUTO
from mdi.model.ggml.kernel_rows import UBATCH
from mdi.model.sampling import SamplingParams, host_array
from mdi.model.source import ModelSource
from mdi.ring.transport import RingTimeout
from mdi.ring.wire import Frame, FrameKind
from mdi.runconfig import ConfigError, RunConfig
from mdi.starter.batch import Interrupted, RunFailed
from mdi.starter.control import NodeError
from mdi.starter.planning.run_plan import plan_run
from mdi.starter.planning.run_shape import RunShape
from mdi.starter.engine import Engine
from mdi.starter.node_report import NodeReport, ring_reports, starter_report
from mdi.starter.pass_compute import inference_mode, takes_host_arrays

log = logging.getLogger(__name__)

DEFAULT_CTX = 512  # llama-perplexity's default context; capped at the model's block size
MIN_CTX = 4
HEAD_ROWS = 256  # positions per head call at most, and at most HEAD_BYTES of float32 logits
HEAD_BYTES = 64 << 20  # (Gemma 3's 262k-token vocabulary: 64 rows, where 256 held 268 MB)
EXP_ROWS = 16  # rows whose exp(logits - max) is held at once while their log-sum-exp is taken


def scored_range(window: int, ctx: int) -> Tuple[int, int]:
    """The positions [a, ctx) of window `window` whose tokens are scored, each predicted from
    the positions before it: llama-perplexity's, the tokens after the logits at ctx / 2 (its
    `first`) up to the window's end, in every window alike."""
    return ctx // 2 + 1, ctx


@dataclass
class PerplexityResult:
    path: str
    ctx: int
    n_text_tokens: int  # tokens in the file (BOS included)
    window_nll: List[float]  # per window scored: the sum of its tokens' NLL (nats), window order
    window_scored: List[int]  # per window scored: how many tokens it scored
    elapsed: float  # seconds from the first window sent to the last one scored
    nodes: List[NodeReport]  # the ring's, starter first
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def n_windows(self) -> int:
        return len(self.window_nll)

    @property
    def n_tokens(self) -> int:
        """Tokens run through the model (every position of every window)."""
        return self.n_windows * self.ctx

    @property
    def n_scored(self) -> int:
        return sum(self.window_scored)

    @property
    def nll_mean(self) -> Optional[float]:
        return math.fsum(self.window_nll) / self.n_scored if self.n_scored else None

    @property
    def perplexity(self) -> Optional[float]:
        nll = self.nll_mean
        return math.exp(nll) if nll is not None else None

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def metrics(self) -> Dict[str, Any]:
        record = {"perplexity": self.perplexity, "nll_mean": self.nll_mean, "file": self.path,
                  "ctx": self.ctx, "n_windows": self.n_windows, "n_tokens": self.n_tokens,
                  "n_scored": self.n_scored, "n_text_tokens": self.n_text_tokens,
                  "window_nll_mean": [n / c for n, c in zip(self.window_nll, self.window_scored)],
                  "seconds": self.elapsed, "tokens_per_s": self.tokens_per_s,
                  "n_nodes": len(self.nodes), "nodes": [n.to_json() for n in self.nodes]}
        record.update(self.extra)
        return record


class PerplexityFailed(RunFailed):
    """The scoring stopped early; `result` is the PerplexityResult of the windows scored."""


PIECE_CHARS = 1 << 18  # characters read and tokenized at a time (8 MB of text: 38 MB peak, 1.4 GB whole)
JUNCTION_CHARS = 256  # each side of a cut, encoded together and apart to prove the cut exact


def read_tokens(source: ModelSource, path: str) -> np.ndarray:
    """The file's tokens as plain text (no chat template; a control token's spelling in it is
    text, as llama-perplexity reads it: Tokenizer.encode_text); BOS first if the tokenizer adds one.

    Read and tokenized a piece at a time, the ids kept as int32: tokenizing a whole file at
    once took ~170 MB of RAM per MB of text (a 50 MB file aborted under a 4 GB limit), the
    tokenizer's working memory and a Python int per token. A piece ends where no whitespace run
    is split (CUT_AT), and only where encoding the text around that cut together gives the ids
    of its two sides apart: the ids are those of the whole text. A tokenizer for which no such
    cut is exact (SentencePiece adds a word prefix to every text it is given) takes the rest of
    the file as one piece, as before."""
    tok = source.tokenizer
    if tok is None:
        raise ConfigError("%s: no tokenizer found for this model" % source.path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # /dev/zero, a pipe: no end to read to
            raise ConfigError("--perplexity %s: cannot read it: not a regular file" % path)
        parts = [np.array([tok.bos_id] if tok.add_bos else [], dtype=np.int32)]
        visible = False
        with open(path, encoding="utf-8", newline="") as f:  # the text as it is: "\r\n" stays
            for piece in _pieces(f, tok):
                visible = visible or not piece.isspace()
                parts.append(np.array(tok.encode_text(piece), dtype=np.int32))
    except FileNotFoundError:
        raise ConfigError("--perplexity %s: no such file" % path)
    except UnicodeDecodeError as e:
        raise ConfigError("--perplexity %s: not UTF-8 text (%s)" % (path, e.reason))
    except OSError as e:
        raise ConfigError("--perplexity %s: cannot read it: %s" % (path, e.strerror or e))
    if not visible:
        raise ConfigError("--perplexity %s: the file is empty" % path)
    return np.concatenate(parts)


def _pieces(f: Any, tok: Any) -> Iterator[str]:
    """The text of `f` in pieces of about PIECE_CHARS, each ending at an exact cut (read_tokens)."""
    rest, whole = "", False
    while True:
        block = f.read(PIECE_CHARS)
        if not block:
            break
        text = rest + block
        cuts = [] if whole else _last_cuts(text)
        cut = next((c for c in cuts if _cut_is_exact(tok, text, c)), None)
        if cut is None and cuts:
            whole = True  # no cut exact: this tokenizer's ids depend on where a text starts
        if cut is None:
            rest = text
            continue
        yield text[:cut]
        rest = text[cut:]
    if rest:
        yield rest


# A cut goes where a whitespace run is not split: after a line break before a visible character,
# or before one space between two visible characters (BPE joins a space to the word after it).
# Blank-line paragraphs, wiki.test.raw's " \n \n" lines and a one-line file had no single line
# break between visible characters, and were tokenized whole (about 150 MB of RAM a MB: h68).
CUT_AT = re.compile(r"(?<=\n)(?=\S)|(?<=\S)(?= \S)")
CUT_TRIES = 8  # the last candidates tried before a tokenizer is taken for one no cut is exact for


def _last_cuts(text: str) -> List[int]:
    """The last CUT_TRIES candidate cuts of `text`, the last first ([]: none)."""
    found = collections.deque((m.start() for m in CUT_AT.finditer(text) if m.start() > 0), maxlen=CUT_TRIES)
    return list(reversed(found))


def _cut_is_exact(tok: Any, text: str, cut: int) -> bool:
    before, after = text[max(0, cut - JUNCTION_CHARS):cut], text[cut:cut + JUNCTION_CHARS]
    return tok.encode_text(before + after) == tok.encode_text(before) + tok.encode_text(after)


def resolve_ctx(source: ModelSource, ctx: Optional[int]) -> int:
    block = source.config.block_size
    if ctx is None:
        return min(block, DEFAULT_CTX)
    if not MIN_CTX <= ctx <= block:
        raise ConfigError("--ppl-ctx %d: expected %d to the model's context of %d tokens" % (ctx, MIN_CTX, block))
    return ctx


def plan_windows(n_tokens: int, ctx: int, max_windows: Optional[int], path: str) -> int:
    """How many windows to score; like llama-perplexity, at least two windows' worth of text."""
    if n_tokens < 2 * ctx:
        raise ConfigError("--perplexity %s: %d tokens, too short for a context of %d (at least %d tokens; "
                          "lower --ppl-ctx)" % (path, n_tokens, ctx, 2 * ctx))
    n = n_tokens // ctx
    return min(n, max_windows) if max_windows is not None else n


def scoring_config(cfg: RunConfig) -> RunConfig:
    """`cfg` as perplexity runs it: runtime.prefill_chunk at most a ubatch, whose passes the
    windows go in (a larger one would have the nodes keep every position of a sliding-window
    layer, not llama.cpp's rings); runtime.prefill_weights auto multiplies the weights as stored.
    Perplexity is the figure set beside llama-perplexity's on the same GGUF, and a window's
    hundreds of rows would otherwise take auto's dequantized product, whose bits are not
    llama.cpp's (SmolLM2 Q4_1: 43.97 against 44.18). `dequantized`, asked for by name, still is."""
    if cfg.runtime.prefill_chunk > UBATCH:
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, prefill_chunk=UBATCH))
    if cfg.runtime.prefill_weights != AUTO:
        return cfg
    if any(cfg.backend_of(node) != "torch" for node in cfg.nodes):  # (the setting is ggml's)
        log.info("mdi: perplexity multiplies the weights as stored, as llama-perplexity does "
                 "(runtime.prefill_weights: dequantized scores faster where measured so)")
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, prefill_weights="quantized"))


def run(cfg: RunConfig, path: str, ctx: Optional[int] = None, max_windows: Optional[int] = None,
        on_window: Optional[Callable[[int, int, float, float], None]] = None) -> PerplexityResult:
    """Score `path`. `on_window(windows done, windows, perplexity so far, tokens/s)` is called
    after each window is scored (a progress line)."""
    if max_windows is not None and max_windows < 1:
        raise ConfigError("--ppl-max-windows must be at least 1")
    source = ModelSource(cfg.model.path)
    ids = read_tokens(source, path)
    ctx = resolve_ctx(source, ctx)
    n_windows = plan_windows(len(ids), ctx, max_windows, path)
    cfg = scoring_config(cfg)
    n_slots = min(len(cfg.nodes), n_windows)
    log.info("mdi: perplexity of %s: %d tokens, %d windows of %d, %d in flight",
             path, len(ids), n_windows, ctx, n_slots)
    greedy = SamplingParams(temperature=0.0)
    engine = Engine(plan_run(cfg, source, RunShape(n_slots, ctx), greedy), source, greedy)  # layers: auto measures
    try:
        engine.open()
    except (KeyboardInterrupt, Interrupted):
        engine.abort()  # workers configured so far drop the run now
        raise
    scorer = _Scorer(engine, ids, ctx, n_windows, path, on_window)
    try:
        scorer.run()
        elapsed = time.perf_counter() - scorer.t0
        workers = engine.close()
    except (RuntimeError, KeyboardInterrupt, Interrupted) as e:
        engine.abort()  # every worker drops the run now, not after its heartbeat timeout
        partial = scorer.result(time.perf_counter() - scorer.t0, [])
        signum = e.signum if isinstance(e, Interrupted) else (signal.SIGINT if isinstance(e, KeyboardInterrupt) else None)
        partial.extra["error"] = ("interrupted by %s" % signal.Signals(signum).name if signum is not None
                                  else str(e) or type(e).__name__)
        raise PerplexityFailed(partial.extra["error"], partial, signum)
    return scorer.result(elapsed, workers)


class _Scorer:
    """Keeps one window per cache slot travelling the ring and scores each as it returns."""

    def __init__(self, engine: Engine, ids: np.ndarray, ctx: int, n_windows: int, path: str,
                 on_window: Optional[Callable[[int, int, float, float], None]]) -> None:
        self.engine, self.ids, self.ctx, self.n_windows, self.path = engine, ids, ctx, n_windows, path
        self.on_window = on_window
        self.nll: Dict[int, Tuple[float, int]] = {}  # window -> (NLL sum, tokens scored)
        self.in_flight: Dict[int, int] = {}  # cache slot -> window
        self.partial: Dict[int, Tuple[float, int]] = {}  # cache slot -> (NLL sum, rows back) of its window so far
        self.next_window = 0
        self.compute_seconds = 0.0  # the starter's own work: its layers and the head
        self.t0 = time.perf_counter()

    @property
    def chunk(self):
        return self.engine.chunk  # replaced when a recovery moves the starter's layers

    def run(self) -> None:
        self.t0 = time.perf_counter()
        with inference_mode(self.chunk):
            for slot in range(self.engine.n_slots):
                self._send_next(slot)
            while self.in_flight:
                try:
                    frame = self._next_frame()
                except (NodeError, RingTimeout) as e:
                    self._recover(e)
                    continue
                self._score(frame)

    def _window_ids(self, window: int) -> np.ndarray:
        """The window's tokens; a tokenizer that adds BOS has every window begin with it, as
        llama-perplexity puts it in place of each chunk's first token (never a scored one): a
        model trained with BOS first reads a window without it as text out of context
        (Gemma 3: 1.7x the perplexity)."""
        a = window * self.ctx
        ids = self.ids[a:a + self.ctx].copy()
        tok = self.engine.source.tokenizer
        if tok is not None and tok.add_bos:
            ids[0] = tok.bos_id
        return ids

    def _send(self, slot: int, window: int) -> None:
        """The window's passes, all sent at once: every node computes a slot's frames in turn."""
        ids: Any = self._window_ids(window)
        if not takes_host_arrays(self.chunk):
            import torch
            ids = torch.from_numpy(ids).to(device=self.chunk.device, dtype=torch.long)
        pipeline = self.engine.live_pipeline
        self.in_flight[slot], self.partial[slot] = window, (0.0, 0)
        for start in range(0, self.ctx, UBATCH):
            t0 = time.perf_counter()
            end = min(self.ctx, start + UBATCH)
            x = self.chunk.forward_blocks(self.chunk.embed(ids[start:end], start), slot, start)
            self.compute_seconds += time.perf_counter() - t0
            pipeline.transport.send(Frame(FrameKind.SCORE, pipeline.run_id, [slot], [start], [end - start], x))

    def _send_next(self, slot: int) -> None:
        if self.next_window < self.n_windows:
            self.next_window += 1
            self._send(slot, self.next_window - 1)

    def _next_frame(self) -> Frame:
        """The next frame back, waiting in short slices and asking the watchdog in between, so
        a dead node is reported by name instead of after the whole ring timeout."""
        timeout = self.engine.cfg.runtime.ring_timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.engine.live_pipeline.transport.recv(max(0.0, min(0.2, deadline - time.monotonic())))
            except RingTimeout:
                self.engine._check()
                if time.monotonic() >= deadline:
                    raise self.engine.named_failure(
                        RingTimeout("no activations came back round the ring for %.0f s" % timeout))

    def _score(self, frame: Frame) -> None:
        if frame.kind != FrameKind.SCORE or frame.tensor is None:
            return  # a stray stop/reset: nothing to score
        hidden = frame.tensor
        if not takes_host_arrays(self.chunk):
            from mdi.system.transfers import to_device
            hidden = to_device(hidden, self.chunk.device, self.chunk.activation_dtype)
        row = 0
        for slot, start, count in zip(frame.samples, frame.start, frame.count):
            rows, row = hidden[row:row + count], row + count
            window = self.in_flight.get(slot)
            if window is None:
                continue  # not in flight (validated frames only name our slots)
            t0 = time.perf_counter()
            total, back = self.partial[slot]
            self.partial[slot] = (total + self._rows_nll(window, rows, start), back + count)
            self.compute_seconds += time.perf_counter() - t0
            if back + count < self.ctx:
                continue  # more of the window's passes to come
            a, b = scored_range(window, self.ctx)
            self.nll[window] = (self.partial.pop(slot)[0], b - a)
            del self.in_flight[slot]
            self._send_next(slot)
            if self.on_window is not None:
                done = len(self.nll)
                nll = math.fsum(n for n, _ in self.nll.values()) / sum(c for _, c in self.nll.values())
                elapsed = time.perf_counter() - self.t0
                self.on_window(done, self.n_windows, math.exp(nll), done * self.ctx / max(elapsed, 1e-9))

    def _rows_nll(self, window: int, hidden: Any, start: int) -> float:
        """The NLL summed over the scored tokens that the window's positions from `start` (the
        rows of `hidden`) predict: position i's logits predict the token at i + 1. Each NLL is
        log-sum-exp(logits) - the target's logit, the exponentials summed in float64."""
        a, b = scored_range(window, self.ctx)
        targets = self._window_ids(window)
        total = 0.0
        step = max(1, min(HEAD_ROWS, HEAD_BYTES // (4 * self.engine.source.config.vocab_size)))
        for i in range(max(a - 1, start), min(b - 1, start + len(hidden)), step):
            j = min(i + step, b - 1, start + len(hidden))
            # a torch chunk's logits (a GPU's too) on the host
            logits = host_array(self.chunk.head(hidden[i - start:j - start]))
            for k in range(0, j - i, EXP_ROWS):
                rows = logits[k:k + EXP_ROWS]
                peak = rows.max(axis=1)
                sums = np.add.reduce(np.exp(rows - peak[:, None]), axis=1, dtype=np.float64)
                picked = rows[np.arange(rows.shape[0]), targets[i + 1 + k:i + 1 + k + rows.shape[0]]]
                total += float(np.sum(peak.astype(np.float64) + np.log(sums) - picked.astype(np.float64)))
        return total

    def _recover(self, cause: BaseException) -> None:
        """A node failed: the engine re-plans the ring (or re-raises when it may not) and every
        window in flight is sent again from position 0 on the new ring."""
        self.engine._recover(cause)
        lost = sorted(self.in_flight.items())
        self.in_flight, self.partial = {}, {}
        for slot, window in lost:
            self._send(slot, window)

    def result(self, elapsed: float, workers: List[NodeReport]) -> PerplexityResult:
        done = sorted(self.nll)
        engine = self.engine
        # Every node of the ring is listed; a run that failed has no counters from the workers.
        nodes = ring_reports(engine, starter_report(engine, self.compute_seconds), workers)
        extra = {"recoveries": [r.to_json() for r in engine.recoveries]} if engine.recoveries else {}
        return PerplexityResult(self.path, self.ctx, len(self.ids),
                                [self.nll[w][0] for w in done], [self.nll[w][1] for w in done],
                                elapsed, nodes, extra)
