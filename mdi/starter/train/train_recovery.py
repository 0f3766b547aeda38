"""mdi-train through a lost worker (issue 38): the same recovery as inference, and the
interrupted step done again from the start, so the run ends as if nothing had happened.

A worker's LoRA pairs and AdamW moments live only on it, so the starter keeps a snapshot of
every node's trainable state as of a completed step: after every `every` steps (and whenever
a checkpoint collects it anyway) it reads them back (GET /train, the checkpoint's path) and
keeps its own share as copies. The workers' reads overlap the next step: a step's forwards
and backwards change no parameter and no moment (gradients go to .grad), so the read is
settled (joined) just before that step's "step" frame goes round, and the snapshot is the
state of the step before; a read that fails (its node died) leaves the snapshot before it.

When a node fails, the engine re-plans the ring exactly as for inference
(mdi.starter.planning.recovery: a spare takes the dead node's layers, or its neighbours absorb them)
and opens a new run on every node, which drops every node's training state; so every node, the survivors too, gets its new layer range's pairs and moments from the
snapshot (POST /train), the starter included, and the steps since the snapshot run again.
A step's windows are a function of its index (mdi.starter.train.train_data.step_index) and every
node's arithmetic per layer is the same whatever the split, so the redone steps give the
same losses and the same adapter as an uninterrupted run. A --method prompt run's trainable
state is the starter's prompt and its AdamW moments: the snapshot copies them, and a recovery
puts them back with the ring.

Why a snapshot every step by default and not only the lost node's state: any node may die,
and a node that dies mid-step may already have stepped (the step frame goes round), so the
survivors' states are not one step's either; restoring everyone from one snapshot is the
one consistent point. Its cost is one GET /train per worker per step (3 float32 copies of
the LoRA: pairs and two moments; 27.9 MB for SmolLM2 rank 8 on all modules), mostly hidden
behind the next step's compute (README, scripts/bench_train_recovery.py); `every` K > 1
trades it for up to K - 1 steps redone. The starter holds one more copy of that state.
"""
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from mdi.model.adapters.stage_train import OptimizerState
from mdi.ring.transport import RingTimeout
from mdi.starter.control import NodeError

log = logging.getLogger(__name__)

Pairs = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Snapshot:
    """Every node's trainable state once `steps_done` steps (and their evals) were complete."""
    steps_done: int
    pairs: Pairs  # every layer's, by mdi.model.adapters.lora_train keys
    state: Optional[OptimizerState]  # None before the first step of a fresh run
    # --method prompt: the starter's prompt and its AdamW state (the workers train nothing)
    prompt: Optional[Tuple[torch.Tensor, OptimizerState]] = None


def _copy(pairs: Pairs, state: Optional[OptimizerState]) -> Tuple[Pairs, Optional[OptimizerState]]:
    # the starter's own pairs are its live parameters (StageTrainer.pairs detaches, no copy):
    # the next optimizer step would change a snapshot that shared them
    pairs = {k: (a.detach().clone(), b.detach().clone()) for k, (a, b) in pairs.items()}
    if state is not None:
        state = OptimizerState(state.steps, {k: (m.clone(), v.clone()) for k, (m, v) in state.moments.items()})
    return pairs, state


def merge_states(parts: List[Tuple[Pairs, Optional[OptimizerState]]]) -> Tuple[Pairs, OptimizerState]:
    """Nodes' pairs and AdamW states as one (the starter's first: it always has a state)."""
    pairs: Pairs = {}
    state = OptimizerState(0, {})
    for theirs, their_state in parts:
        pairs.update(theirs)
        if their_state is not None:
            state.moments.update(their_state.moments)
            state.steps = their_state.steps
    return pairs, state


class _Read:
    """The workers' states read on a thread while the next step runs (GET /train each)."""

    def __init__(self, trainer: Any, steps_done: int, own: Tuple[Pairs, Optional[OptimizerState]],
                 prompt: Optional[Tuple[torch.Tensor, OptimizerState]]) -> None:
        self.steps_done, self.own, self.prompt = steps_done, own, prompt
        self.parts: Optional[List[Tuple[Pairs, Optional[OptimizerState]]]] = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(trainer,), name="mdi-train-snapshot", daemon=True)
        self.thread.start()

    def _run(self, trainer: Any) -> None:
        try:
            self.parts = trainer.worker_states()
        except BaseException as e:  # a dead node's NodeError above all: settle() raises it on the main thread
            self.error = e


class TrainRecovery:
    """The snapshots of one training run and its recoveries. `trainer` is the run's
    mdi.starter.train.ring_trainer.RingTrainer (collect, install, engine)."""

    def __init__(self, trainer: Any, every: int, pairs: Pairs, state: Optional[OptimizerState],
                 steps_done: int) -> None:
        if every < 1:
            raise ValueError("snapshots every %d steps: expected at least 1" % every)
        self.trainer, self.every = trainer, every
        engine = trainer.engine
        # without workers nothing can be lost; with recovery off (no spares, no
        # runtime.recovery_attempts) a lost worker ends the run, naming it, and snapshots would be waste
        self.enabled = engine.ring is not None and engine.cfg.recovery_attempts > 0
        self.snapshot = Snapshot(steps_done, *_copy(pairs, state), self._prompt()) if self.enabled else None
        self.reading: Optional[_Read] = None  # the next snapshot's workers' part, on its way
        self.recoveries: List[Dict[str, Any]] = []
        self.n_snapshots = 0
        self.snapshot_seconds = 0.0
        self.snapshot_bytes = 0

    def completed(self, steps_done: int, collected: Optional[Tuple[Pairs, OptimizerState]] = None) -> None:
        """`steps_done` steps, their evals and checkpoint are complete; `collected`: every node's
        state as a checkpoint just read it (taken as the snapshot at no further cost), else the
        workers' states are read on a thread (settled by `settle`)."""
        if not self.enabled or (collected is None and steps_done % self.every):
            return
        t0 = time.perf_counter()
        self.settle()  # one read at a time (a step without a "step" frame never settled the last)
        prompt = self._prompt()
        if collected is not None and prompt is None:  # (a prompt run's collected state is the prompt's)
            self._keep(steps_done, *collected)
        else:
            stage = self.trainer.stage  # the starter's own share now, before its next optimizer step
            self.reading = _Read(self.trainer, steps_done, _copy(stage.pairs(), stage.optimizer_state()), prompt)
        self.snapshot_seconds += time.perf_counter() - t0

    def settle(self) -> None:
        """Wait for the workers' states being read (before any node steps again) and keep them
        as the snapshot; a failed read raises its error here (a recovery follows)."""
        reading, self.reading = self.reading, None
        if reading is None:
            return
        t0 = time.perf_counter()
        timeout = self.trainer.engine.cfg.runtime.ring_timeout
        reading.thread.join(timeout)
        self.snapshot_seconds += time.perf_counter() - t0  # the part the next step did not hide
        if reading.thread.is_alive():
            raise RingTimeout("the workers' LoRA state after step %d did not come back within %.0f s (GET /train)"
                              % (reading.steps_done, timeout))
        if reading.error is not None:
            raise reading.error
        assert reading.parts is not None
        self._keep(reading.steps_done, *merge_states([reading.own] + reading.parts), prompt=reading.prompt)

    def _prompt(self) -> Optional[Tuple[torch.Tensor, OptimizerState]]:
        """A copy of --method prompt's prompt and AdamW state as they are now."""
        prompt = self.trainer.prompt
        return (prompt.embeddings(), prompt.optimizer_state()) if prompt is not None else None

    def _keep(self, steps_done: int, pairs: Pairs, state: OptimizerState,
              prompt: Optional[Tuple[torch.Tensor, OptimizerState]] = None) -> None:
        self.snapshot = Snapshot(steps_done, *_copy(pairs, state), prompt)
        self.n_snapshots += 1
        tensors = [t for ab in pairs.values() for t in ab] + [t for mv in state.moments.values() for t in mv]
        self.snapshot_bytes = sum(t.numel() * t.element_size() for t in tensors)

    def recover(self, cause: BaseException, step: int) -> int:
        """A node failed during step `step` (0-based): re-plan the ring as inference does (or
        re-raise `cause` when recovery is off or its attempts are spent), give every node its
        layers' state from the snapshot, and return the step to go on from."""
        engine = self.trainer.engine
        if self.snapshot is None:
            raise cause
        try:
            self.settle()  # a read that completed is a snapshot as good as any
        except Exception as e:  # its node is gone too: the snapshot before it stands
            log.info("mdi-train: a snapshot being read is lost with the node (%s); the one after step %d stands",
                     e, self.snapshot.steps_done)
        snap = self.snapshot
        events = []  # this recovery's attempts (mdi.starter.engine_face.RecoveryEvent)
        while True:
            events += engine._recover(cause)  # the ring re-planned and reopened, or `cause` raised (attempts spent)
            try:
                self.trainer.install(snap.pairs, snap.state)
                break
            except (NodeError, RingTimeout) as e:  # another node lost meanwhile: recover again
                cause = e
        if snap.prompt is not None:
            self.trainer.prompt.restore(*snap.prompt)  # its steps since the snapshot run again too
        for event in events:
            self.recoveries.append(dict(event.to_json(), step=step, resumed_at_step=snap.steps_done))
        how = events[-1].action
        log.warning("mdi-train: lost a node during step %d (%s); %s; redoing from step %d",
                    step + 1, cause, how, snap.steps_done + 1)
        return snap.steps_done

    def metrics(self) -> Dict[str, Any]:
        """--metrics-out's record of this: the recoveries and what the snapshots cost."""
        out: Dict[str, Any] = {}
        if self.recoveries:
            out["recoveries"] = self.recoveries
        if self.enabled:
            out["snapshots"] = {"every": self.every, "count": self.n_snapshots,
                                "seconds": round(self.snapshot_seconds, 6), "bytes": self.snapshot_bytes}
        return out
