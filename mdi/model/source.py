"""Open a model from any supported source and build the chunk a node needs.

A prepared mdi directory is read lazily (a node loads only its own tensors); a raw source
(Hugging Face directory, GGUF, nanoGPT ckpt.pt) is converted in memory once.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

from mdi.model.files.model_dir import GGUF_FILE, MDI_CONFIG, MODEL_FILE, file_layout, read_mdi_config
from mdi.model.config import ModelConfig
from mdi.model.files.gguf_config import GgufModel, open_gguf, read_gguf_model, rope_mode_of
from mdi.model.layout import (QUANT_SUFFIXES, CheckpointError, QuantLayout, QuantSpec, expected_keys,
                              quantizable)
from mdi.model.quantization.layouts import restrict, uniform_layout
from mdi.model.files.tokenizer_import import NoGgufVocabulary, tokenizer_from_gguf, tokenizer_from_hf_dir
from mdi.model.tokenizers import META_FILE, Tokenizer, TokenizerError, load_tokenizer
from mdi.system.devices import use_shape_agnostic_attention
from mdi.system.memory import release_freed_memory

# torch, and what holds weights in it, is imported where torch's weights are read or a torch
# chunk is built: a node computing with ggml opens the model, its tokenizer and GGUF without it
if TYPE_CHECKING:
    import torch

    from mdi.model.quantization.quant import Stored
    from mdi.model.transformer import ModelChunk

log = logging.getLogger(__name__)


def is_mdi_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MDI_CONFIG))


def gguf_file_of(path: str) -> Optional[str]:
    """The GGUF a model path computes from with ggml: the path itself (a .gguf file), or a
    prepared directory's model.gguf; None without one."""
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return path
    inside = os.path.join(path, GGUF_FILE)
    return inside if os.path.isdir(path) and os.path.isfile(inside) else None


def check_model_path(path: str, config: Optional[str] = None) -> None:
    """CheckpointError where nothing is at `path` (said before any other complaint of a run's);
    `config`: the file whose model.path it is (a relative one was looked for from the current
    folder, the file's and its parent: runconfig.resolve_model_path)."""
    if os.path.exists(path):
        return
    if config is not None and not os.path.isabs(path):
        here = os.path.dirname(os.path.abspath(config))
        raise CheckpointError("%s: model.path: model path %s does not exist (looked from the current folder, %s and "
                              "%s; prepare it with mdi-prepare)" % (config, path, here, os.path.dirname(here)))
    raise CheckpointError("model path %s does not exist (prepare it with mdi-prepare)" % path)


class ModelSource:
    """A model's config, tokenizer and a way to fetch any node's weights."""

    def __init__(self, path: str) -> None:
        check_model_path(path)
        self.path = path
        self._full: Optional[Dict[str, Stored]] = None
        self._reread = threading.Lock()
        self._raw = not is_mdi_dir(path)  # a checkpoint converted in memory, not a prepared directory
        self._stored_quant: Optional[Dict[str, QuantSpec]] = None
        self._gguf: Optional[GgufModel] = None
        self.gguf_path = gguf_file_of(path)  # what a node computing with ggml reads, if any
        if not self._raw:
            self.config = read_mdi_config(path)
            self._stored_quant = file_layout(path)
        elif self.gguf_path is not None:
            # its metadata only: the torch backend reads the tensors when a chunk asks (a node
            # computing with ggml never holds them in memory)
            self.config = self.gguf().config
        else:
            from mdi.model.files import checkpoints
            self.config, self._full = checkpoints.read_checkpoint(path, keep_quant=True)
        self.tokenizer: Optional[Tokenizer] = read_tokenizer(path)
        if self.tokenizer is not None:
            check_vocab(self.tokenizer, self.config, path)

    @property
    def stored_quant(self) -> Dict[str, QuantSpec]:
        """The weights the source holds quantized, and how: a raw GGUF's from its tensor types
        (what the torch reader will make of them), nothing read; another checkpoint's read."""
        if self._stored_quant is None and self.gguf_path is not None and self._raw:
            self._stored_quant = _gguf_torch_layout(self)  # no torch: a ggml starter never loads it
        elif self._stored_quant is None:
            from mdi.model.quantization.quant import weights_layout
            self._stored_quant = weights_layout(self._held(()))
        return self._stored_quant

    def gguf(self) -> GgufModel:
        """The model as its GGUF describes it (its file's architecture and RoPE layout)."""
        if self.gguf_path is None:
            raise CheckpointError("%s has no GGUF (mdi-prepare writes %s into a model directory)" % (self.path, GGUF_FILE))
        if self._gguf is None:
            reader = open_gguf(self.gguf_path)
            self._gguf = read_gguf_model(reader, self.gguf_path)
            self._gguf_reader = reader
        return self._gguf

    def gguf_types(self, first: int, last: int, with_embedding: bool, with_head: bool) -> Dict[str, str]:
        """GGUF name -> ggml type of what a node of layers [first, last) computes with."""
        from mdi.model.ggml.tensors import node_tensors
        self.gguf()
        infos = {t.name: t for t in self._gguf_reader.tensors}
        want = node_tensors(self.config, first, last, with_embedding, with_head, "rope_freqs.weight" in infos)
        return {n: infos[n].tensor_type.name for n in want if n in infos}

    def gguf_bytes(self, first: int, last: int, with_embedding: bool, with_head: bool) -> int:
        """Bytes of the GGUF tensors a node of layers [first, last) computes with, as stored."""
        self.gguf()
        sizes = {t.name: t.n_bytes for t in self._gguf_reader.tensors}
        return sum(sizes[n] for n in self.gguf_types(first, last, with_embedding, with_head))

    def gguf_chunk_file(self, first: int, last: int) -> str:
        """A temporary file (the caller removes it) holding a worker's layers as a GGUF of their
        tensors, copied block for block from the model's: what the starter pushes to a worker
        computing with ggml. Each tensor is read from the model's file as it is written, never
        through the starter's mapping of it: the starter's memory keeps none of the worker's
        layers (a mapped read kept every page it copied resident)."""
        import tempfile
        from mdi.model.files.gguf_write import FileBytes, remove_quietly, write_gguf
        self.gguf()
        assert self.gguf_path is not None  # gguf() raises without one
        infos = {t.name: t for t in self._gguf_reader.tensors}
        tensors = {n: (kind, tuple(int(d) for d in infos[n].shape),
                       FileBytes(self.gguf_path, int(infos[n].data_offset), int(infos[n].n_bytes)))
                   for n, kind in self.gguf_types(first, last, False, False).items()}
        fd, path = tempfile.mkstemp(prefix="mdi-push-", suffix=".gguf")
        os.close(fd)
        try:
            return write_gguf(path, self.config, tensors, arch=self.gguf().arch)
        except BaseException:
            remove_quietly(path)
            raise

    def ggml_chunk(self, first: int, last: int, with_embedding: bool, with_head: bool, threads: int = 1,
                   kv_type: str = "f16", repack: bool = True, device: str = "cpu") -> Any:
        """A chunk computing with ggml over this model's GGUF (mdi.model.ggml.chunk.GgmlChunk) on
        `device` (the CPU, or a GPU ggml was built for)."""
        from mdi.model.ggml.chunk import GgmlChunk
        from mdi.model.ggml.weights import GgufWeights
        model = self.gguf()
        assert self.gguf_path is not None  # gguf() raises without one
        return GgmlChunk(model.config if self._raw else self.config, first, last, with_embedding, with_head,
                         GgufWeights(self.gguf_path), rope_mode_of(model.permuted_qk), threads, kv_type,
                         repack, device)

    def layout(self, first: int, last: int, with_ends: bool, mode: str,
               group_size: Optional[int] = None) -> Dict[str, QuantSpec]:
        """Which weights of blocks [first, last) (+ the starter's ends) a node keeps quantized,
        and how: `mode` none, auto (as stored: a GGUF's own precision class) or int8 / int4
        (`group_size` None: per output channel for int8, 32 for int4)."""
        bases = list(quantizable(self.config, (first, last), with_ends, with_ends))
        if mode == "none":
            return {}
        if mode == "auto":
            return restrict(self.stored_quant, bases)
        return uniform_layout(self.config, (first, last), with_ends, with_ends, mode, group_size)

    def weights(self, first: int, last: int, with_embedding: bool, with_head: bool,
                dtype: torch.dtype, quant: Optional[QuantLayout] = None) -> Dict[str, torch.Tensor]:
        """The flat state dict of a node: float tensors in `dtype`, the weights named in
        `quant` quantized (as stored when they already are, else quantized here)."""
        from mdi.model.files import store
        from mdi.model.quantization.quant import convert
        if not self._raw:
            stored = store.load_weights(self.path, (first, last), with_embedding, with_head)
        else:
            keys = expected_keys(self.config, (first, last), with_embedding, with_head)
            full = self._held(keys)
            stored = {k: full[k] for k in keys}
        return convert(stored, quant or {}, dtype, _log_requantize)

    def _held(self, keys: Sequence[str]) -> Dict[str, Stored]:
        """The raw checkpoint's weights, read again if a chunk took some of `keys` (`consume`)."""
        from mdi.model.files import checkpoints
        with self._reread:
            full = self._full
            if full is None or any(k not in full for k in keys):
                if full is not None:  # (the first read says nothing: a refusal stays one line)
                    log.info("mdi: %s: reading the checkpoint again for weights a chunk took", self.path)
                requantized: List[str] = []
                _, full = checkpoints.read_checkpoint(self.path, keep_quant=True, requantized=requantized)
                if requantized and self._full is None:
                    _say_rerounded(self.path, requantized)
                self._full = full
            return full

    def load_chunk(self, first: int, last: int, with_embedding: bool, with_head: bool, dtype: torch.dtype,
                   device: str, compute_dtype: Optional[torch.dtype] = None,
                   quant: Optional[QuantLayout] = None, consume: bool = False) -> ModelChunk:
        """`build_chunk(config, self.weights(...), ...)` without the dict in between: the
        chunk's tensors are allocated first and filled one weight at a time (`fill`), so
        loading peaks at the chunk plus one weight, not the chunk plus a copy of the model.
        `consume`: a raw checkpoint held in memory (a GGUF) lets go of each weight once the
        chunk has it (a one-node run held the model twice; read again if asked for later)."""
        chunk = _empty_chunk(self.config, first, last, with_embedding, with_head, dtype, device, quant)
        self.fill(chunk.state_dict(), first, last, with_embedding, with_head, dtype, quant, consume)
        return _finish_chunk(chunk, dtype, compute_dtype)

    def fill(self, targets: Mapping[str, torch.Tensor], first: int, last: int, with_embedding: bool,
             with_head: bool, dtype: torch.dtype, quant: Optional[QuantLayout] = None, consume: bool = False) -> None:
        """Fill `targets` (a chunk's state_dict(): name -> preallocated tensor) with exactly
        what `weights` would return, one weight at a time. A prepared directory's tensors that
        are stored as the node wants them are read straight into place (store.read_tensors_into);
        a weight to (de/re)quantize is read alone, converted (quant.convert) and copied in."""
        from mdi.model.files import store
        from mdi.model.quantization.quant import convert, gather
        quant = quant or {}
        want = expected_keys(self.config, (first, last), with_embedding, with_head, quant)
        missing, unexpected = sorted(set(targets) - set(want)), sorted(set(want) - set(targets))
        if missing or unexpected:  # worded as ModelChunk.load_weights words it
            raise ValueError("weights do not match layers [%d, %d): missing %s; unexpected %s"
                             % (first, last, missing[:5] or "none", unexpected[:5] or "none"))
        canonical = expected_keys(self.config, (first, last), with_embedding, with_head)
        if self._raw:  # a raw checkpoint held in memory: convert one weight at a time
            full = self._held(canonical)
            freed = 0
            for key in canonical:
                _copy_into(targets, convert({key: full[key]}, quant, dtype, _log_requantize))
                if consume:
                    freed += _stored_bytes(full.pop(key))
                if freed >= TRIM_EVERY_BYTES:  # glibc keeps the freed weights resident until trimmed:
                    release_freed_memory()  # the chunk would fill up beside most of the model
                    freed = 0
            release_freed_memory()
            return
        fn = os.path.join(self.path, MODEL_FILE)
        direct: Dict[str, torch.Tensor] = {}
        converted: List[str] = []
        for key in canonical:
            base = key[:-len(".weight")] if key.endswith(".weight") else None
            spec = quant.get(base) if base is not None else None
            have = self.stored_quant.get(base) if base is not None else None
            if spec != have:
                converted.append(key)
            elif spec is None:
                direct[key] = targets[key]
            else:
                assert base is not None  # spec came from quant.get(base)
                for suffix in spec.tensor_shapes(1, spec.group_size):
                    direct[base + "." + suffix] = targets[base + "." + suffix]
        store.read_tensors_into(fn, direct)
        for key in converted:
            base = key[:-len(".weight")]
            spec = self.stored_quant.get(base)
            names = [key] if spec is None else [base + "." + s for s in spec.tensor_shapes(1, spec.group_size)]
            _copy_into(targets, convert(gather(store.read_tensors(fn, names)), quant, dtype, _log_requantize))
        if converted:
            release_freed_memory()  # the conversions' temporaries

    def chunk_bytes(self, first: int, last: int, dtype: torch.dtype, quant: Optional[QuantLayout] = None) -> bytes:
        """A worker's weights as safetensors bytes, to push over the control plane."""
        from safetensors.torch import save as safetensors_save
        w = self.weights(first, last, False, False, dtype, quant)
        return safetensors_save({k: v.contiguous() for k, v in w.items()})


# mdi's canonical matrices -> the GGUF tensors the torch reader stacks into each (mdi.model.files.gguf)
_GGUF_PARTS = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "attn.proj": ("attn_output",),
               "mlp.gate_up": ("ffn_gate", "ffn_up"), "mlp.down": ("ffn_down",)}
_GGUF_PARTS_GPT2 = {"attn.qkv": ("attn_qkv",), "attn.proj": ("attn_output",), "mlp.fc": ("ffn_up",),
                    "mlp.proj": ("ffn_down",)}


def _gguf_torch_layout(source: "ModelSource") -> Dict[str, QuantSpec]:
    """The layout the torch backend's GGUF reader gives a raw GGUF (keep_quant), worked out from
    its tensor types alone: Q8_0 / Q4_0 / Q4_1 as mdi int8 / int4, K-quants as their nearest,
    floats float; matrices stacked from parts of several types take the most precise (quant.cat_rows)."""
    from mdi.model.ggml.tensors import GGUF_DIRECT, GGUF_NEAREST
    source.gguf()
    types = {t.name: t.tensor_type.name for t in source._gguf_reader.tensors}
    config = source.config
    table = _GGUF_PARTS_GPT2 if config.family == "gpt2" else _GGUF_PARTS
    out: Dict[str, QuantSpec] = {}
    for base, (n_out, n_in) in quantizable(config, (0, config.n_layer), True, True).items():
        if base.startswith("blocks."):
            _, layer, rest = base.split(".", 2)
            parts = ["blk.%s.%s.weight" % (layer, p) for p in table.get(rest, ())]
        else:
            parts = [{"tok_emb": "token_embd.weight", "lm_head": "output.weight"}.get(base, "")]
        kinds = [types[p] for p in parts if p in types]
        if not parts or n_in % 32 or len(kinds) < len(parts):
            continue
        mapped = [m for m in (GGUF_DIRECT.get(k) or GGUF_NEAREST.get(k) for k in kinds) if m is not None]
        if len(mapped) < len(kinds):
            continue  # float (or unmappable: the torch reader says so when it loads)
        specs = [QuantSpec(m, 32) for m in mapped]
        out[base] = specs[0] if len(set(specs)) == 1 else max(specs, key=lambda s: (s.kind == "int8", -s.group_size))
    return out


TRIM_EVERY_BYTES = 16 * 2 ** 20  # weights let go of (`consume`) between giving the heap's free pages back


def _stored_bytes(w: Stored) -> int:
    from mdi.model.quantization.quant import QParts
    tensors = w.tensors.values() if isinstance(w, QParts) else [w]
    return sum(t.numel() * t.element_size() for t in tensors)


def _say_rerounded(path: str, requantized: List[str]) -> None:
    """One line: the torch backend computes a GGUF's K-quant (IQ4, Q5) tensors rounded to mdi's
    int4 / int8, under every --quant (none dequantizes those), so not the file's values."""
    kinds = sorted({entry.split()[1] for entry in requantized})
    log.warning("mdi: %s: the torch backend rounds %d %s tensors to mdi's int4 / int8 (under --quant none too): "
                "not the file's values; the ggml backend computes them as stored, and mdi-prepare %s --quant none "
                "reads them exactly", path, len(requantized), "/".join(kinds), path)


def _log_requantize(key: str, have: QuantSpec, want: QuantSpec) -> None:
    log.info("re-quantizing %s from %s to %s", key, have.label(), want.label())


def check_vocab(tokenizer: Tokenizer, config: ModelConfig, where: str) -> None:
    """Every id the tokenizer can produce must have an embedding row (a request's token ids
    are bounded by the tokenizer's vocabulary); `where`: the model's path, for the message."""
    if tokenizer.vocab_size > config.vocab_size:
        raise TokenizerError("%s: tokenizer has %d tokens but the model only %d"
                             % (where, tokenizer.vocab_size, config.vocab_size))


def read_tokenizer(path: str) -> Optional[Tokenizer]:
    """A model's tokenizer alone, no weight read (a GGUF's from its metadata); None without one."""
    return load_tokenizer(path) if is_mdi_dir(path) else _raw_tokenizer(path)


def gguf_tokenizer(path: str) -> Tokenizer:
    """A GGUF's tokenizer: from its metadata, else (a prepared directory's model.gguf, written
    without one) the directory's beside it (NoGgufVocabulary where neither is)."""
    try:
        return tokenizer_from_gguf(path)
    except NoGgufVocabulary:
        here = os.path.dirname(os.path.abspath(path))
        if not os.path.isfile(os.path.join(here, META_FILE)):
            raise
        return load_tokenizer(here)


def _raw_tokenizer(path: str) -> Optional[Tokenizer]:
    if path.endswith(".gguf"):
        return gguf_tokenizer(path)
    if os.path.isdir(path):
        return tokenizer_from_hf_dir(path)
    # nanoGPT ckpt.pt: a prepared vocabulary may sit beside it
    here = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(here, "tokenizer_mdi.json")):
        return load_tokenizer(here)
    return None


def _empty_chunk(config: ModelConfig, first: int, last: int, with_embedding: bool, with_head: bool,
                 dtype: torch.dtype, device: str, quant: Optional[QuantLayout] = None) -> ModelChunk:
    """A chunk with uninitialised `dtype` parameters on `device` (no throwaway random
    initialisation) and a real RoPE, ready to be filled with weights. Quantized layers'
    tensors keep their own dtypes (int8 / uint8 codes, float16 scales)."""
    import torch

    from mdi.model.transformer import ModelChunk
    if use_shape_agnostic_attention(device):
        log.info("%s: cuDNN attention off (it compiles a graph per key length, per thread): flash or "
                 "memory-efficient attention instead", device)
    with torch.device("meta"):
        chunk = ModelChunk(config, first, last, with_embedding, with_head, quant)
    rope, chunk.rope = chunk.rope, None  # RoPE state lives on the CPU (RotaryEmbedding says why): kept
    # torch.empty rather than Module.to_empty: its empty_like on meta tensors runs through
    # torch._refs and imports sympy and torch.fx (~60 MB of RSS for nothing).
    for module in chunk.modules():
        for name, p in module.named_parameters(recurse=False):
            setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                     requires_grad=False))
        for name, b in module.named_buffers(recurse=False):
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))
    chunk.rope = rope.to(device) if rope is not None else None
    return chunk


def build_chunk(config: ModelConfig, weights: Dict[str, torch.Tensor], first: int, last: int,
                with_embedding: bool, with_head: bool, dtype: torch.dtype, device: str,
                compute_dtype: Optional[torch.dtype] = None, quant: Optional[QuantLayout] = None) -> ModelChunk:
    """A chunk holding `weights` (a flat state dict, e.g. `ModelSource.weights`); loading
    from a source without that dict in memory is `ModelSource.load_chunk`."""
    chunk = _empty_chunk(config, first, last, with_embedding, with_head, dtype, device, quant)
    chunk.load_weights({k: v if k.rsplit(".", 1)[-1] in QUANT_SUFFIXES else v.to(dtype) for k, v in weights.items()})
    return _finish_chunk(chunk, dtype, compute_dtype)


def _finish_chunk(chunk: ModelChunk, dtype: torch.dtype, compute_dtype: Optional[torch.dtype]) -> ModelChunk:
    chunk.compute_dtype = compute_dtype if compute_dtype != dtype else None
    chunk.pick_kernels()
    return chunk.eval()


def random_chunk(config: ModelConfig, first: int, last: int, with_embedding: bool, with_head: bool,
                 dtype: torch.dtype, device: str, compute_dtype: Optional[torch.dtype] = None,
                 quant: Optional[QuantLayout] = None, seed: int = 0) -> ModelChunk:
    """A chunk of the real shapes, dtype and quantization filled with random values a trained
    model could have (norms 1, weights ~0.02, quantized codes uniform): what a board times
    before any weight is sent (mdi.model.block_timing). A kernel's speed does not depend on the
    values, but NaN or denormal activations could slow it."""
    import torch
    chunk = _empty_chunk(config, first, last, with_embedding, with_head, dtype, device, quant)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in chunk.state_dict().items():
            module, suffix = name.rsplit(".", 2)[-2:]
            if suffix == "qweight":
                lo, hi = (-127, 128) if t.dtype == torch.int8 else (0, 256)
                t.copy_(torch.randint(lo, hi, t.shape, generator=g, dtype=torch.int16))
            elif suffix in ("scales", "mins"):
                t.fill_(0.002 if suffix == "scales" else -0.015)
            elif "norm" in module or module.startswith("ln"):
                t.fill_(1.0 if suffix == "weight" else 0.0)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    return _finish_chunk(chunk, dtype, compute_dtype)


def _copy_into(targets: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy a converted weight's tensors into the chunk's (`Module.load_state_dict` copies the same way)."""
    import torch
    with torch.no_grad():
        for name, t in tensors.items():
            target = targets[name]
            if tuple(t.shape) != tuple(target.shape):
                raise ValueError("tensor %s has shape %s, expected %s" % (name, tuple(t.shape), tuple(target.shape)))
            target.copy_(t)


def build_chunk_from_file(config: ModelConfig, fn: str, first: int, last: int, dtype: torch.dtype, device: str,
                          exact: bool = False, quant: Optional[QuantLayout] = None) -> ModelChunk:
    """A worker's chunk (blocks [first, last), no embedding or head) read from the safetensors
    file `fn` tensor by tensor into its parameters: peak memory is the chunk plus its largest
    tensor, never a second copy of the weights (store.read_tensors_into). `exact`: the file
    holds exactly these tensors (a pushed chunk); else it may hold more (a full model).
    `quant`: the weights the file holds quantized, and so the chunk."""
    from mdi.model.files import store
    chunk = _empty_chunk(config, first, last, False, False, dtype, device, quant)
    store.read_tensors_into(fn, chunk.state_dict(), exact=exact)  # detached views of the parameters
    chunk.pick_kernels()
    return chunk.eval()
