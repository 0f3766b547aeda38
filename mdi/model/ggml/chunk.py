"""A chunk of a model computing with ggml: blocks [first, last) and optionally the embedding and
the head, with its KV cache, answering the same calls as the torch chunk (mdi.model.transformer)
so that the ring, the pipeline and the worker do not know which one they drive.

Activations come in and go out as float32 rows [rows, n_embd] (numpy, or torch tensors on the
CPU, given back as the same kind), a pass's samples as a RowBatch (slots, starts, counts, and
each sample's adapter: LoRA pairs added as graph ops, mdi.model.ggml.adapters).
"""
import contextlib
import logging
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from mdi.model.config import ModelConfig
from mdi.model.ggml import lib
from mdi.model.ggml.adapters import GgmlAdapters, HeldAdapter, gguf_pairs
from mdi.model.ggml.dequant_rows import dequantizable, rule_for, rule_text
from mdi.model.ggml.built import Built
from mdi.model.ggml.graph import GraphBuilder, ModelTraits, PassShape, SampleShape, attend_bucket, head_name
from mdi.model.ggml.graph_cache import IDLE_LOOKUPS, GraphCache  # noqa: F401 (IDLE_LOOKUPS: named here too)
from mdi.model.ggml.graph_inputs import row_positions, write_inputs
from mdi.model.ggml.kv_cache import GgmlKVCache, layer_lengths
from mdi.model.ggml.min_rows import fewest_rows
from mdi.model.ggml.row_split import split_sizes
from mdi.model.ggml.tensors import ENDS_IN, check_tensors, node_tensors
from mdi.model.ggml.weights import GgufWeights
from mdi.model.pass_rows import PassRows

log = logging.getLogger(__name__)


def _to_numpy(x: Any) -> Tuple[np.ndarray, bool]:
    """(float32 C-contiguous array, whether `x` was a torch tensor)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x, dtype=np.float32), False
    return np.ascontiguousarray(_host_view(x), dtype=np.float32), True


def _host_view(t: Any) -> np.ndarray:
    """A torch tensor as numpy. One call for a host tensor outside autograd (a decode step's
    rows and ids): each torch call costs tens of microseconds when it runs right after a
    graph has streamed the weights through the caches."""
    try:
        return t.numpy()
    except (RuntimeError, TypeError):  # on a GPU, needing grad, or a dtype numpy lacks (bfloat16)
        t = t.detach().cpu()
        return t.numpy() if t.dtype != sys.modules["torch"].bfloat16 else t.float().numpy()


def _back(y: np.ndarray, torch_in: bool) -> Any:
    if not torch_in:
        return y
    return sys.modules["torch"].from_numpy(y)


class GgmlChunk:
    backend = "ggml"
    compute_dtype = None  # activations are float32, whatever the weights' types

    def __init__(self, config: ModelConfig, first: int, last: int, with_embedding: bool, with_head: bool,
                 weights: GgufWeights, rope_mode: int, threads: int = 1, kv_type: str = "f16",
                 repack: bool = True, device: str = "cpu") -> None:
        if not 0 <= first <= last <= config.n_layer:
            raise ValueError("layer range [%d, %d) outside the model's %d layers" % (first, last, config.n_layer))
        self.config, self.first, self.last = config, first, last
        self.with_embedding, self.with_head = with_embedding, with_head
        self.kv_type = kv_type
        self.traits = ModelTraits.of(config, rope_mode)
        names, matmul = self._tensor_names(weights)
        # the CPU, or a GPU (runtime.device cuda): every tensor in its buffers (lib.ComputeBackend)
        self.compute_backend = lib.ComputeBackend(device, threads)
        on = self.compute_backend
        t0 = time.perf_counter()
        self.weights = weights
        self.tensors = weights.load(names, matmul if repack and on.maps_weights else (),
                                    None if on.maps_weights else on.buffer_type)
        self.load_seconds = time.perf_counter() - t0
        self.builder = GraphBuilder(self.traits, range(first, last), self.tensors, on.buffer_type, on.on_cpu)
        # passes shorter than this are padded, so a row rounds as in a pass of any size (min_rows)
        packed = set(weights.repacked)
        head = head_name(self.tensors)
        self.min_rows = fewest_rows(self.compute_backend, self.tensors, [n for n in matmul if n not in packed])
        self.min_head_rows = fewest_rows(self.compute_backend, self.tensors, [head]) if with_head else 1
        # passes of a few rows multiply these row by row where that is measured cheaper (row_split);
        # only matrices whose rows round alike in passes of any size, so no result changes
        def alike(names: List[str]) -> List[str]:
            return [n for n in names if n not in packed and fewest_rows(self.compute_backend, self.tensors, [n]) == 1]

        blocks = alike([n for n in matmul if n != head])  # in layer order, as a pass reads them
        # (row by row is a way round the CPU's tiled kernel: a GPU multiplies a pass as one product)
        self._split_groups = [blocks, alike([head]) if with_head else []] if on.on_cpu else []
        self.builder.split = split_sizes(self.compute_backend, self.tensors, self._split_groups)
        # what runtime.prefill_weights may dequantize: block matrices stored quantized, not repacked
        self._dequantizable = [n for n in matmul if n != head and n not in packed and dequantizable(self.tensors[n])]
        self.prefill_weights = "quantized"
        self.cache: Optional[GgmlKVCache] = None
        self._graphs = GraphCache()
        # LoRA adapters (mdi.model.ggml.adapters); the frame decoder checks ids against lora.adapters
        self.lora = GgmlAdapters()
        # a pass and an adapter loaded or dropped while serving take turns (a graph reads its pairs)
        self._lock = threading.RLock()

    # --- loading -------------------------------------------------------------------------
    def _tensor_names(self, weights: GgufWeights) -> Tuple[List[str], List[str]]:
        """The tensors this chunk computes with (checked against the config: names, dims,
        types) and those multiplied as matrices (candidates for ggml's repacked layout)."""
        want = node_tensors(self.config, self.first, self.last, self.with_embedding, self.with_head,
                            rope_freqs=weights.has("rope_freqs.weight"))
        have = {n: (weights.type_name(n), weights.dims(n)) for n in weights.infos}
        check_tensors(weights.path, want, have, (self.first, self.last), self.config.n_layer)
        matmul = [n for n, dims in want.items() if len(dims) == 2 and n not in ENDS_IN]
        return list(want), matmul

    @property
    def n_layers(self) -> int:
        return self.last - self.first

    @property
    def threads(self) -> int:
        return self.compute_backend.threads

    def set_threads(self, threads: int) -> None:
        with self._lock:
            before = self.compute_backend.threads
            self.compute_backend.set_threads(threads)
            if self.compute_backend.threads != before:  # which way a pass's rows multiply faster is the threads' too
                self.builder.split = split_sizes(self.compute_backend, self.tensors, self._split_groups)
                self._drop_graphs(lambda key: key[0] in ("blocks", "head"))
                self.set_prefill_weights(self.prefill_weights)  # measured again for these threads

    def set_prefill_weights(self, mode: str) -> None:
        """runtime.prefill_weights as this node takes it: "quantized", or "dequantized" / "auto"
        where measured faster (dequant_rows.rule_for)."""
        with self._lock:
            rule = rule_for(mode, self.compute_backend, self.tensors, self._dequantizable)
            if rule != self.builder.dequant:
                self._drop_graphs(lambda key: key[0] == "blocks")  # before their scratch goes
                self.builder.set_dequant(rule, self._dequantizable)
            self.prefill_weights = mode

    @property
    def prefill_rule(self) -> str:
        """What runtime.prefill_weights does here, in words (its backend line: with_prefill_rule)."""
        return rule_text(self.builder.dequant, self.prefill_weights, bool(self._dequantizable))

    @property
    def dequantized_from(self) -> Optional[int]:
        """The fewest rows a sample brings to a pass to multiply them dequantized (None: never)."""
        return self.builder.dequant.min_rows if self.builder.dequant is not None else None

    def with_prefill_rule(self, line: str) -> str:
        """A node's backend line, and what runtime.prefill_weights does on it where asked for dequantized."""
        return line if self.prefill_weights == "quantized" else "%s; prefill weights %s" % (line, self.prefill_rule)

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes

    # Where activations live and their dtype, in torch's terms where the process has torch
    # loaded (the pipeline and the worker move frames with it), else as names.
    @property
    def device(self) -> Any:
        torch = sys.modules.get("torch")
        return torch.device("cpu") if torch is not None else "cpu"

    @property
    def activation_dtype(self) -> Any:
        torch = sys.modules.get("torch")
        return torch.float32 if torch is not None else "float32"

    def set_adapter(self, adapter: int, weights: Dict[str, Any]) -> None:
        """Hold adapter `adapter` (> 0): (A [r, in], B [out, r]) per mdi linear layer name of this
        chunk's blocks (torch tensors or numpy), the scale folded into B, as the torch chunk
        takes them; float16 (adapters.PAIR_TYPE) in a ggml buffer of its own. Layers it does not
        name run as the base."""
        if adapter <= 0:
            raise ValueError("adapter ids start at 1 (0 is the base model)")
        permuted = self.traits.family.positions == "rope" and self.traits.rope_mode == lib.ROPE_NORMAL
        pairs = gguf_pairs(self.config, self.first, self.last, self.tensors, permuted, adapter, weights)
        held = HeldAdapter(pairs, self.compute_backend)
        with self._lock:
            self._drop_locked(adapter)
            self.lora.adapters[adapter] = held

    def drop_adapter(self, adapter: int) -> None:
        with self._lock:
            self._drop_locked(adapter)

    def clear_adapters(self) -> None:
        with self._lock:
            for adapter in list(self.lora.adapters):
                self._drop_locked(adapter)

    def _drop_locked(self, adapter: int) -> None:
        held = self.lora.adapters.pop(adapter, None)
        if held is not None:
            self._drop_graphs(lambda key: key[0] == "blocks" and key[2] is not None and adapter in key[2].adapter_ids)
            held.free()

    @property
    def adapter_bytes(self) -> int:
        return self.lora.nbytes

    # --- cache -----------------------------------------------------------------------------
    def allocate_cache(self, n_slots: int, max_len: int, prefill_chunk: Optional[int] = None) -> GgmlKVCache:
        """`prefill_chunk`: a run's (its sliding-window layers may keep rings: layer_lengths); None: none."""
        if max_len > self.config.block_size:
            raise ValueError("cache length %d exceeds the model context %d" % (max_len, self.config.block_size))
        self.free_cache()
        c, lengths = self.config, layer_lengths(self.config, self.first, self.last, max_len, prefill_chunk)
        self.cache = GgmlKVCache(n_slots, max_len, c.kv_heads, c.head_dim, lengths, self.kv_type,
                                 self.compute_backend.buffer_type)
        return self.cache

    def free_cache(self) -> None:
        with self._lock:
            self._free_cache_locked()

    def _free_cache_locked(self) -> None:
        self._drop_graphs(lambda key: key[0] == "blocks")  # their views point into the cache
        if self.cache is not None:
            self.cache.free()
        self.cache = None

    # --- graphs ------------------------------------------------------------------------------
    def _graph(self, key: Any, build: Any) -> Built:
        with self._lock:  # an adapter loaded or dropped on another thread drops graphs
            return self._graph_locked(key, build)

    def _graph_locked(self, key: Any, build: Any) -> Built:
        return self._graphs.lookup(key, build, self.compute_backend.check_supported)

    def _drop_graphs(self, which: Any) -> None:
        self._graphs.drop(which)

    @contextlib.contextmanager
    def scratch_graphs(self) -> Any:
        """Graphs built inside are dropped on leaving: a measurement's pass shapes, which serving
        may never meet again (timing 1-9 row verifications kept 28 MB of Gemma 3's head graphs)."""
        with self._lock:
            before = set(self._graphs)
        try:
            yield
        finally:
            with self._lock:
                self._drop_graphs(lambda key: key not in before)

    # --- compute -------------------------------------------------------------------------------
    def forward_rows(self, x: Any, batch: Any) -> Any:
        """This chunk's blocks once over the stacked rows x [batch.rows, n_embd] of the samples
        of `batch` (a RowBatch: slots, starts, counts; `adapters`: each sample's adapter id, 0
        for the base), each against its own cache slot."""
        if self.n_layers == 0:
            return x
        with self._lock:
            return self._forward_locked(batch, x=x)

    def embed_forward_rows(self, ids: Any, batch: Any, virtual: Optional[Tuple[Any, Any]] = None) -> Any:
        """forward_rows(embed_rows(ids, batch's positions, virtual), batch): a starter's pass,
        embedded in the blocks' own graph where nothing replaces a row (no soft prompt)."""
        if virtual is not None or self.n_layers == 0 or not self.with_embedding:
            positions = np.concatenate(row_positions(batch.starts, batch.counts))
            return self.forward_rows(self.embed_rows(ids, positions, virtual), batch)
        with self._lock:
            return self._forward_locked(batch, ids=ids)

    def embed_forward_logits(self, ids: Any, batch: Any, lend: bool = False) -> Any:
        """The logits [samples, vocab] of each sample's last row after the embedding, the blocks
        and the head over token `ids` (stacked as `batch` says), all in one graph: a one-node
        ring's decode step (this chunk the whole model) then computes once a token, and its
        Python, which runs cold after each graph has streamed the weights through the caches,
        runs once instead of twice. Each row's bits are those of embed_forward_rows then head.
        `lend`: the logits are read in place, as `head`'s."""
        if not (self.with_embedding and self.with_head and self.n_layers):
            raise ValueError("layers [%d, %d) hold no embedding, blocks and head to compute logits in one graph"
                             % (self.first, self.last))
        with self._lock:
            return self._forward_locked(batch, ids=ids, logits=True, lend=lend)

    def _forward_locked(self, batch: Any, x: Any = None, ids: Any = None, logits: bool = False,
                        lend: bool = False) -> Any:
        """The blocks over `batch`'s rows: activations `x`, or token `ids` embedded in the graph;
        `logits`: the head over each sample's last row too, whose logits are the output."""
        cache = self.cache
        if cache is None:
            raise RuntimeError("no KV cache allocated")
        slots, starts, counts = list(batch.slots), list(batch.starts), list(batch.counts)
        rows = sum(counts)
        adapters = getattr(batch, "adapters", None)
        if adapters:
            missing = sorted({a for a in adapters if a and a not in self.lora.adapters})
            if missing:
                raise ValueError("adapter %d is not loaded on layers [%d, %d)" % (missing[0], self.first, self.last))
        if len(set(slots)) != len(slots):
            raise ValueError("a sample slot appears twice in one batch")
        for slot, start, count in zip(slots, starts, counts):
            if not 0 <= slot < cache.n_slots:
                raise ValueError("sample slot %d outside the %d allocated" % (slot, cache.n_slots))
            if start < 0 or count < 1 or start + count > cache.max_len:
                raise ValueError("positions [%d, %d) exceed the cache length %d" % (start, start + count, cache.max_len))
        embedded = ids is not None
        if embedded:
            a, torch_in = self._token_ids(ids)
            if a.shape != (rows,):
                raise ValueError("%d token ids for %d rows" % (a.shape[0], rows))
        else:
            a, torch_in = _to_numpy(x)
            if a.shape != (rows, self.config.n_embd):
                raise ValueError("%d rows of activations for %d tokens" % (a.shape[0], rows))
        shape = PassShape(tuple(SampleShape(slot, count, attend_bucket(start + count, cache.max_len))
                                for slot, start, count in zip(slots, starts, counts)))
        pad = self.min_rows - rows
        if pad > 0:  # the last row again, at its own position (write_inputs): it computes the same bits
            last = shape.samples[-1]
            shape = PassShape(shape.samples[:-1] + (SampleShape(last.slot, last.rows + pad, last.attend),))
        plan = self.lora.plan(adapters, [s.rows for s in shape.samples])
        lora = plan.shape if plan is not None else None
        head_rows = max(len(counts), self.min_head_rows) if logits else 0
        g = self._graph(("blocks", shape, lora, embedded, head_rows),
                        lambda: self.builder.blocks(shape, cache, lora, self.lora.adapters, embedded, head_rows))
        write_inputs(g, shape, cache, self.traits, starts, counts, a, embedded, head_rows)
        if plan is not None and g.lora is not None:
            for tensor, values in g.lora.fill(plan):
                lib.set_data(tensor, values)
        self.compute_backend.compute(g.graph)
        return _back(self._graphs.output(g, len(counts) if head_rows else rows, lend), torch_in)

    def _token_ids(self, ids: Any) -> Tuple[np.ndarray, bool]:
        """(int32 ids, whether they came as a torch tensor), checked against the vocabulary."""
        torch_in = not isinstance(ids, np.ndarray)
        a = np.ascontiguousarray(_host_view(ids) if torch_in else ids, dtype=np.int32).reshape(-1)
        few = a.tolist() if a.shape[0] <= 64 else None  # (a decode step's: Python's min and max run warmer)
        if a.shape[0] and ((min(few) < 0 or max(few) >= self.config.vocab_size) if few is not None else
                           (np.minimum.reduce(a) < 0 or np.maximum.reduce(a) >= self.config.vocab_size)):
            raise ValueError("token id outside the vocabulary of %d" % self.config.vocab_size)
        return a, torch_in

    def embed(self, ids: Any, start: int) -> Any:
        """One sample's tokens at positions start.."""
        n = int(ids.shape[0])
        return self.embed_rows(ids, np.arange(start, start + n, dtype=np.int32))

    def forward_blocks(self, x: Any, slot: int, start: int) -> Any:
        """The blocks over one sample's rows x [T, n_embd] at positions start.."""
        return self.forward_rows(x, PassRows([slot], [start], [int(x.shape[0])]))

    def embed_rows(self, ids: Any, positions: Any, virtual: Optional[Tuple[Any, Any]] = None) -> Any:
        """Token rows [rows] at their positions -> embeddings [rows, n_embd] (float32);
        `virtual` (rows, embeddings) replaces those rows' token embeddings (a soft prompt's
        virtual tokens, as the torch chunk does: not scaled, learned positions added)."""
        ids_np, torch_in = self._token_ids(ids)
        n = ids_np.shape[0]
        learned = self.traits.family.positions == "learned"
        later = virtual is not None and learned  # positions added after the virtual rows are in
        g = self._graph(("embed", n, later), lambda: self.builder.embedding(n, not later))
        g.set("ids", ids_np)
        pos = np.zeros(0, dtype=np.int32)
        if learned:
            pos = positions.cpu().numpy() if hasattr(positions, "cpu") else positions
            pos = np.ascontiguousarray(pos, dtype=np.int32).reshape(-1)
        if "pos" in g.inputs:
            g.set("pos", pos)
        self.compute_backend.compute(g.graph)
        out = g.rows_out(n)
        if virtual is not None:
            rows, values = (v.cpu().numpy() if hasattr(v, "cpu") else np.asarray(v) for v in virtual)
            out[rows.astype(np.int64)] = values.astype(np.float32)
            if later:
                p = self._graph(("positions", n), lambda: self.builder.positions(n))
                p.set("x", out)
                p.set("pos", pos)
                self.compute_backend.compute(p.graph)
                out = p.rows_out(n)
        return _back(out, torch_in)

    def head(self, x: Any, lend: bool = False) -> Any:
        """Final norm and LM head over rows [rows, n_embd] -> logits [rows, vocab] (float32).
        `lend`: read in place, not copied, valid until this chunk's next pass: a caller that
        draws from them first saves a copy of vocabulary x rows floats."""
        a, torch_in = _to_numpy(x)
        rows = a.shape[0]
        if rows < self.min_head_rows:  # padded as the blocks' passes are
            a = np.concatenate([a, np.repeat(a[-1:], self.min_head_rows - rows, axis=0)])
        n = a.shape[0]
        g = self._graph(("head", n), lambda: self.builder.head(n))
        g.set("x", a)
        self.compute_backend.compute(g.graph)
        with self._lock:
            out = self._graphs.output(g, rows, lend)
        return _back(out, torch_in)

    def close(self) -> None:
        self.clear_adapters()
        self._graphs.clear()
        self.builder.set_dequant(None, ())
        self.free_cache()
        self.weights.free()
        self.compute_backend.free()
