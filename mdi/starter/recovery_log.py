"""A run's recoveries as the engine records them: the metrics' list (`Recovery`) and each one
as a typed event handed to every listener once (serving's dashboard, training's snapshots)."""
import logging
import threading
import time
from typing import Callable, List, Sequence

from mdi.runconfig import NodeSpec
from mdi.starter.engine_face import RecoveryEvent
from mdi.starter.node_report import Recovery

log = logging.getLogger(__name__)


class RecoveryLog:
    def __init__(self) -> None:
        self.recoveries: List[Recovery] = []  # the run's record (batch runs, perplexity)
        self._events: List[RecoveryEvent] = []
        self._listeners: List[Callable[[RecoveryEvent], None]] = []
        self._events_lock = threading.Lock()

    def add_recovery(self, cause: BaseException, how: str, started: float, at_s: float, nodes: Sequence[NodeSpec],
                     ranges: Sequence[Sequence[int]], recovered: bool = False) -> RecoveryEvent:
        """Record one attempt begun at perf_counter `started`, `at_s` into the run (`how`: what was
        done, or "failed: why"), with the ring after it; one that `recovered` is logged."""
        seconds = time.perf_counter() - started
        if recovered:
            log.warning("mdi: recovered in %.2f s: %s", seconds, how)
        rec = Recovery(str(cause), how, round(at_s, 6), round(seconds, 6))
        self.recoveries.append(rec)
        event = RecoveryEvent(rec.cause, rec.action, rec.at_s, rec.seconds, getattr(cause, "node", None),
                              tuple(nodes), tuple((r[0], r[1]) for r in ranges))
        with self._events_lock:
            self._events.append(event)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(event)
        return event

    def on_recovery(self, listener: Callable[[RecoveryEvent], None]) -> None:
        """Hand `listener` every recovery of this engine as a RecoveryEvent, each once: those
        before this call at once, later ones as they happen (on the thread that steps)."""
        with self._events_lock:
            past = list(self._events)
            self._listeners.append(listener)
        for event in past:
            listener(event)
