"""The run's LoRA adapters on the starter's side: loaded from the config's `adapters: {name:
path}`, numbered 1..K in that order (0 is the base model), installed on the starter's own
blocks and sent to each worker for its layers only (POST /adapters/<id>)."""
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

from mdi.model.config import ModelConfig
from mdi.ring.adapter_request import adapter_body
from mdi.runconfig import BASE_ADAPTER, ConfigError

if TYPE_CHECKING:  # torch's chunk; a ggml starter never imports torch
    from mdi.model.transformer import ModelChunk

log = logging.getLogger(__name__)

def read_adapter(name: str, path: str, config: ModelConfig, key: Optional[str] = None) -> Any:
    """A PEFT LoRA directory or a LoRA GGUF as an mdi.model.adapters.lora.Adapter (ConfigError
    naming it, after the config `key` it came from, if any)."""
    from mdi.model.adapters.adapter_files import load_any
    try:
        return load_any(path, config, name)
    except (OSError, ValueError) as e:
        raise ConfigError("%s%s" % ("%s: " % key if key else "", e))


class AdapterSet:
    """Adapters by id: ids 1..K in the config's order, then one more per adapter loaded at run
    time; an unloaded adapter leaves its id unused (a sample never meets another's). An adapter
    added while the ring runs stays pending (unknown to requests) until every node holds it.
    Every node knows every LoRA id, with no matrices where the adapter leaves its layers alone:
    a frame naming an id a node does not know is refused there."""

    def __init__(self, paths: Dict[str, str], config: ModelConfig) -> None:
        self.config = config
        self.names: List[Optional[str]] = []  # id i + 1 is names[i]; None: unloaded
        self.adapters: List[Any] = []  # mdi.model.adapters.lora.Adapter or SoftPrompt, in id order
        self.pending: Set[int] = set()
        self.mixes: Dict[Tuple[Tuple[int, float], ...], int] = {}  # ((id, scale), ...) -> its mix's id
        self.mix_used: Dict[int, float] = {}  # a mix's id -> when a request was last given it
        self.lock = threading.Lock()  # adds and removes from HTTP threads
        for name, path in paths.items():
            self.add(name, read_adapter(name, path, config, "adapters." + name))

    def __bool__(self) -> bool:
        return any(a is not None for a in self.adapters)

    def add(self, name: str, adapter: Any, pending: bool = False) -> int:
        with self.lock:
            if name == BASE_ADAPTER or name in self.names:
                raise ConfigError("adapter %r is already loaded" % name)
            self.names.append(name)
            self.adapters.append(adapter)
            adapter_id = len(self.names)
            if pending:
                self.pending.add(adapter_id)
            return adapter_id

    def ready(self, adapter: int) -> None:
        self.pending.discard(adapter)

    def remove(self, name: str) -> int:
        with self.lock:
            adapter = self.id_of(name, pending_too=True)
            if adapter == 0:
                raise ConfigError("the base model cannot be unloaded")
            self.names[adapter - 1], self.adapters[adapter - 1] = None, None
            self.pending.discard(adapter)
            for key, mix in list(self.mixes.items()):
                if mix == adapter:
                    del self.mixes[key]
            self.mix_used.pop(adapter, None)
            return adapter

    def loaded(self) -> List[Tuple[int, str]]:
        """(id, name) of every adapter requests may name now, in id order (mixes are not named)."""
        mixes = set(self.mixes.values())
        return [(i + 1, n) for i, n in enumerate(self.names)
                if n is not None and i + 1 not in self.pending and i + 1 not in mixes]

    def mixes_with(self, adapter: int) -> List[Tuple[int, str]]:
        """(id, name) of the held mixes that `adapter` is part of."""
        out: List[Tuple[int, str]] = []
        for key, mix in self.mixes.items():
            if any(a == adapter for a, _ in key):
                name = self.names[mix - 1]
                assert name is not None  # a held mix has its name: remove() drops both together
                out.append((mix, name))
        return out

    def has(self, adapter: int) -> bool:
        return adapter == 0 or (0 < adapter <= len(self.names) and self.names[adapter - 1] is not None
                                and adapter not in self.pending)

    def id_of(self, name: Optional[str], pending_too: bool = False) -> int:
        """The id a sample runs with: 0 for the base (None or "base"), else 1..K."""
        if name is None or name == BASE_ADAPTER:
            return 0
        if name in self.names and (pending_too or self.names.index(name) + 1 not in self.pending):
            return self.names.index(name) + 1
        known = [BASE_ADAPTER] + [n for _, n in self.loaded()]
        raise ConfigError("unknown adapter %r (known: %s)" % (name, ", ".join(known)))

    def soft_prompt(self, adapter: int) -> Optional[Any]:
        """The virtual tokens' embeddings [n, n_embd] of a prompt-tuning adapter, else None."""
        a = self.adapters[adapter - 1] if adapter else None
        return a.embeddings if a is not None and a.kind == "prompt" else None

    def one_for_layers(self, adapter: int, first: int, last: int) -> Dict[str, Any]:
        return self.adapters[adapter - 1].for_layers(first, last)

    def for_layers(self, first: int, last: int) -> List[Tuple[int, Dict[str, Any]]]:
        """(id, {layer: (A, B)}) of every LoRA held (pending ones too), for blocks [first, last):
        empty where it leaves those blocks alone (the node must still know the id)."""
        return [(i + 1, a.for_layers(first, last)) for i, a in enumerate(self.adapters)
                if a is not None and a.kind != "prompt"]

    def prepare(self, sample: Any, adapter: int) -> None:
        """Give `sample` its adapter; a prompt-tuning one puts its virtual tokens (placeholder
        ids whose embeddings the starter replaces, mdi.starter.pipeline) before the prompt."""
        if not self.has(adapter):
            raise ConfigError("adapter %d is not loaded (it was unloaded, or is still being loaded)" % adapter)
        soft = self.soft_prompt(adapter)
        if soft is None:
            sample.adapter = adapter
            return
        # No layer changes: the sample travels as the base (id 0) once its virtual tokens are embedded.
        sample.soft_prompt, sample.soft_adapter = soft, adapter
        sample.prompt_ids = [0] * soft.shape[0] + list(sample.prompt_ids)

    def install(self, chunk: "ModelChunk") -> None:
        for adapter, weights in self.for_layers(chunk.first, chunk.last):
            chunk.set_adapter(adapter, weights)

    def bodies(self, first: int, last: int) -> List[Tuple[int, bytes]]:
        """What POST /adapters/<id> sends a worker holding blocks [first, last)."""
        return [(adapter, adapter_body(weights)) for adapter, weights in self.for_layers(first, last)]

    def mix(self, entries: Sequence[Tuple[int, float]]) -> Tuple[Tuple[Tuple[int, float], ...], Optional[int], Any]:
        """What a request's (adapter id, scale) list runs with: (key, id, None) when it is the
        base (every scale 0), one adapter at scale 1 or a mix already held; else (key, None,
        the mix to load under the name mix_name(key)). ConfigError for unknown ids or a
        prompt-tuning adapter scaled or mixed."""
        from mdi.model.adapters.lora import AdapterError, mix_adapters
        key = tuple(sorted((a, float(s)) for a, s in entries if s != 0))
        for adapter, _ in key:
            if adapter == 0 or not self.has(adapter) or adapter in self.mixes.values():
                raise ConfigError("adapter %d is not loaded" % adapter)
        if not key:
            return key, 0, None
        if len(key) == 1 and key[0][1] == 1.0:
            return key, key[0][0], None
        held = self.mixes.get(key)
        if held is not None:
            self.mix_used[held] = time.monotonic()
            return key, held, None
        try:
            return key, None, mix_adapters([(self.adapters[a - 1], s) for a, s in key], mix_name(key))
        except AdapterError as e:
            raise ConfigError(str(e))

    def mixes_by_age(self) -> List[int]:
        """The held mixes' ids, the one a request was given longest ago first."""
        return sorted(self.mixes.values(), key=lambda m: self.mix_used.get(m, 0.0))

    def layer_bytes(self) -> List[int]:
        """Bytes of the LoRA matrices held (pending ones and mixes too) per layer of the model:
        what each node holds of them besides its weights and KV cache."""
        per_layer = [0] * self.config.n_layer
        for adapter in self.adapters:
            if adapter is not None and adapter.kind != "prompt":
                for j in range(self.config.n_layer):
                    per_layer[j] += adapter.nbytes(adapter.for_layers(j, j + 1))
        return per_layer

    def held_bytes(self, first: int, last: int) -> int:
        """What the LoRA matrices held take on blocks [first, last) (the starter's)."""
        return sum(self.layer_bytes()[first:last])

    def metrics(self) -> Dict[str, Any]:
        return {name: {"id": i, "rank": self.adapters[i - 1].rank, "bytes": self.adapters[i - 1].nbytes()}
                for i, name in self.loaded()}


MAX_MIXES = 16  # adapter mixes held at once (each is a LoRA of the summed rank on every node); past
# it, the one given out longest ago that no request uses makes room (Engine.mix_adapters)


class MixTableFull(ConfigError):
    """Every one of the MAX_MIXES mixes is in use by a request: a new one must wait for one to end."""


class StarterTooLarge(ConfigError):
    """An adapter (or mix) the starter has no memory for: --serve answers 413, as for a worker's."""


def mix_name(key: Sequence[Tuple[int, float]]) -> str:
    """A mix's name: never a valid adapter name (':' is not allowed there)."""
    return "mix:" + "+".join("%d*%g" % (a, s) for a, s in key)


def adapter_ids(adapters: Optional[AdapterSet], given: Sequence[str], n_samples: int) -> List[int]:
    """Each sample's adapter id from `mdi-start --adapter NAME`, one per prompt in order;
    samples past the last one given run on the base model."""
    if len(given) > n_samples:
        raise ConfigError("%d --adapter for %d samples: give at most one per --prompt" % (len(given), n_samples))
    if not adapters:
        named = [g for g in given if g != BASE_ADAPTER]
        if named:
            raise ConfigError("--adapter %s: the config lists no adapters (adapters: {name: path})" % named[0])
        return [0] * n_samples
    return [adapters.id_of(g) for g in given] + [0] * (n_samples - len(given))


def virtual_tokens(adapters: Optional[AdapterSet], adapter: int) -> int:
    soft = adapters.soft_prompt(adapter) if adapters else None
    return 0 if soft is None else int(soft.shape[0])


def adapter_layer_bytes(cfg_adapters: Dict[str, str], config: ModelConfig) -> List[int]:
    """Bytes of the configured adapters' matrices per layer: what each node holds besides its
    weights and KV cache (every node's budget counts it, mdi.starter.planning.node_budget)."""
    return AdapterSet(cfg_adapters, config).layer_bytes() if cfg_adapters else [0] * config.n_layer
