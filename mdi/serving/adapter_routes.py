"""POST /v1/mdi/adapters and DELETE /v1/mdi/adapters/<name>: LoRA adapters loaded and unloaded
while the ring serves, and which adapter (or mix) a request's `model` or llama.cpp's `lora`
names. Files load only from the model's folder and the configured adapters' (`served_files`)."""
import logging
import time
from typing import Any, Callable, Dict, List, Tuple

from mdi.runconfig import ADAPTER_NAME, BASE_ADAPTER, ConfigError
from mdi.serving.node_refusal import node_api_error
from mdi.serving.admission import SchedulerError
from mdi.serving.scheduler import ADAPTER_CLOSING, Scheduler
from mdi.serving.served_files import ServedFiles, where
from mdi.serving.validation import ApiError
from mdi.starter.adapter_set import MixTableFull, StarterTooLarge
from mdi.starter.engine_face import EngineFace

UNLOAD_WAIT_S = 60.0  # for the scheduler to finish the step in hand before an adapter is unloaded
MIX_WAIT_S, MIX_POLL_S = 60.0, 0.25  # a request's wait for a mix to be free when all are in use

log = logging.getLogger(__name__)


class AdapterControl:
    def __init__(self, sched: Scheduler, files: ServedFiles, model_id: str, served: bool,
                 reserved: Callable[[str], bool], written: Callable[[str], bool]) -> None:
        self.sched, self.files, self.model_id = sched, files, model_id
        # A server that never had adapters takes any model name for its model (OpenAI clients
        # send their own); once it has had some, a name it does not know is refused, also
        # after the last adapter was unloaded (a client must not get the base model silently).
        self.served = served
        self.reserved = reserved  # names a running training job is to be served as
        self.written = written  # real paths a running training job writes (its `out`, what holds or is in it)

    def loaded(self) -> List[Tuple[int, str]]:
        """(id, name) of the adapters requests may name (on the current engine). While a server
        that has adapters has no ring (starting, rebuilt), a 503: a list without them would tell
        a client they do not exist."""
        engine = self.sched.engine
        if engine is None and self.served:
            raise self._no_ring()
        return engine.loaded_adapters() if engine is not None else []

    def _no_ring(self) -> ApiError:
        return ApiError(503, "the ring is %s: its adapters are known once it is up" % self.sched.state,
                        kind="server_error")

    def adapter_of(self, fields: Dict[str, Any]) -> int:
        """The request's adapter id: llama.cpp's `lora: [{"id": i, "scale": s}, ...]` (i indexes
        the adapters of GET /v1/models; several, or a scale other than 1, run as a mix loaded
        on every node once), else `model` naming an adapter; the served model's own name (or
        any name, on a server that never had an adapter) is the base."""
        engine = self.sched.engine  # once: a rebuilt ring replaces it
        loaded = engine.loaded_adapters() if engine is not None else []  # of that engine: none without one
        if fields["lora"]:
            if engine is None and self.served:
                raise self._no_ring()
            entries = []
            for entry in fields["lora"]:
                index = entry["id"]
                if not 0 <= index < len(loaded):
                    raise ApiError(400, "lora id %d: %d adapters are loaded (ids 0 to %d)"
                                   % (index, len(loaded), len(loaded) - 1), "lora")
                entries.append((loaded[index][0], entry["scale"]))
            assert engine is not None  # every id indexed `loaded`, which is [] without an engine
            try:
                self._refuse_closing(entries)
                mix = self._mix(engine, entries)
                self._refuse_closing(entries)  # (a mix made as an unload began had run on, holding it up)
                return mix
            except StarterTooLarge as e:  # no memory for the mix on the starter: 413
                raise node_api_error(e, "lora")
            except ConfigError as e:
                raise ApiError(400, str(e), "lora")
            except SchedulerError as e:  # busy for too long to make room
                raise ApiError(e.status, str(e), kind="server_error" if e.status >= 500 else "invalid_request_error")
            except RuntimeError as e:  # a worker refused the mix (NodeError, naming it): 413 too large, 429 busy
                raise node_api_error(e, "lora")
        name = fields["model"]
        if name is None or name in (self.model_id, BASE_ADAPTER) or not (loaded or self.served):
            return 0
        if engine is None:  # (a server with adapters, its ring starting or rebuilt: not an unknown name)
            raise self._no_ring()
        for adapter, known in loaded:
            if known == name:
                return adapter
        raise ApiError(404, "unknown model %r: this server has %s" % (name[:80], ", ".join(
            [self.model_id] + [n for _, n in loaded])), "model", code="model_not_found")

    def answered_as(self, fields: Dict[str, Any], adapter: int) -> str:
        """The `model` an answer names: the adapter a request named by `model` (OpenAI echoes the
        model asked for, vLLM a LoRA's name), else the served model."""
        return fields["model"] if adapter and not fields["lora"] else self.model_id

    def _refuse_closing(self, entries: List[Tuple[int, float]]) -> None:
        if not frozenset(self.sched.closing).isdisjoint(a for a, _ in entries):
            raise ApiError(503, ADAPTER_CLOSING, "lora", kind="server_error")

    def _mix(self, engine: EngineFace, entries: List[Tuple[int, float]]) -> int:
        """The mix's adapter id. With every mix in use, this request waits (up to MIX_WAIT_S) for
        one to end rather than being refused: one client's mixes must not lock the others out."""
        deadline = time.monotonic() + MIX_WAIT_S
        while True:
            try:
                return engine.mix_adapters(entries, lambda held: self.sched.evict_idle(
                    held, lambda mix: self.sched.engine_up().drop_mix(mix), UNLOAD_WAIT_S))
            except MixTableFull as e:
                if time.monotonic() > deadline:
                    raise ApiError(429, "%s for the last %.0f s; try again" % (e, MIX_WAIT_S), "lora",
                                   kind="rate_limit_error") from None
            time.sleep(MIX_POLL_S)

    def load(self, body: Dict[str, Any]) -> Dict[str, Any]:
        name, path = body.get("name"), body.get("path")
        if set(body) - {"name", "path"} or not isinstance(name, str) or not isinstance(path, str):
            raise ApiError(400, 'expected {"name": string, "path": string}')
        if "\0" in path:  # os.path.realpath raises on it
            raise ApiError(400, "path: must not hold a NUL character", "path")
        if not ADAPTER_NAME.fullmatch(name) or name in (self.model_id, BASE_ADAPTER):
            raise ApiError(400, "name: letters, digits, '_', '.' or '-' (at most 64), not %r or 'base'"
                           % self.model_id, "name")
        if self.reserved(name):
            raise ApiError(409, "name: the training job running now is served as %r when done" % name, "name")
        engine = self.sched.engine
        if engine is None:
            raise ApiError(503, "the ring is %s" % self.sched.state, kind="server_error")
        real = self.files.under(path)
        if real is None:
            raise ApiError(400, "path: adapters load only from %s" % where(self.files.roots), "path")
        if self.written(real):  # served now, its files would be overwritten when the job ends
            raise ApiError(409, "path: the training job running now writes its adapter there", "path")
        try:
            adapter = engine.add_adapter(name, real)
        except ConfigError as e:  # a bad file: 400; no memory for it on the starter: 413
            raise node_api_error(e, "path") if isinstance(e, StarterTooLarge) else ApiError(400, str(e), "path")
        except RuntimeError as e:  # a worker refused it (NodeError, naming it): 413 too large, 429 busy
            raise node_api_error(e, "path")
        self.served = True
        self.files.add(name, real)
        log.info("mdi: serve: adapter %s loaded from %s (id %d)", name, real, adapter)
        return {"ok": True, "name": name, "id": adapter}

    def unload(self, name: str) -> Dict[str, Any]:
        engine = self.sched.engine
        ids = engine.adapter_and_mixes(name) if engine is not None else []  # the adapter, then its mixes
        if not ids:
            raise ApiError(404, "no adapter %r is loaded" % name[:80], code="model_not_found")
        try:
            # Requests naming it are refused from now on, those running finish, then it leaves
            # every node between two steps of the ring (Scheduler.unload_adapter).
            self.sched.unload_adapter(lambda: self.sched.engine_up().adapter_and_mixes(name),
                                      lambda: self.sched.engine_up().remove_adapter(name), UNLOAD_WAIT_S)
        except SchedulerError as e:  # busy for too long: it stays loaded
            raise ApiError(e.status, "adapter %r: %s" % (name, e), kind="server_error" if e.status >= 500
                           else "invalid_request_error")
        except ConfigError as e:  # unloaded meanwhile by another DELETE
            raise ApiError(404, str(e), code="model_not_found")
        except RuntimeError as e:  # a worker refused (NodeError, naming it): 429 busy, else 502
            raise node_api_error(e)
        return {"ok": True, "name": name}

    def made(self) -> None:
        self.served = True  # a trained adapter is served now: unknown model names are refused
