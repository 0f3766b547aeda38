"""Open a model from any supported source and build the chunk a node needs.

A prepared mdi directory is read lazily (a node loads only its own tensors); a raw source
(Hugging Face directory, GGUF, nanoGPT ckpt.pt) is converted in memory once.
"""
import logging
import os
import threading
from typing import Dict, List, Mapping, Optional, Sequence

import torch
from safetensors.torch import save as safetensors_save

from mdi.model import checkpoints, store
from mdi.model.config import ModelConfig
from mdi.model.layout import QUANT_SUFFIXES, CheckpointError, QuantLayout, QuantSpec, expected_keys, quantizable
from mdi.model.quant import QParts, Stored, convert, gather, restrict, uniform_layout, weights_layout
from mdi.model.transformer import ModelChunk
from mdi.model.tokenizer_import import tokenizer_from_gguf, tokenizer_from_hf_dir
from mdi.model.tokenizers import Tokenizer, TokenizerError, load_tokenizer
from mdi.system.devices import use_shape_agnostic_attention
from mdi.system.memory import release_freed_memory

log = logging.getLogger(__name__)


def is_mdi_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, store.MDI_CONFIG))


class ModelSource:
    """A model's config, tokenizer and a way to fetch any node's weights."""

    def __init__(self, path: str) -> None:
        if not os.path.exists(path):
            raise CheckpointError("model path %s does not exist (prepare it with mdi-prepare)" % path)
        self.path = path
        self._full: Optional[Dict[str, Stored]] = None
        self._reread = threading.Lock()
        if is_mdi_dir(path):
            self.config = store.read_mdi_config(path)
            self.stored_quant: Dict[str, QuantSpec] = store.file_layout(path)
        else:  # a GGUF keeps its Q8_0 / Q4 blocks quantized in memory
            self.config, self._full = checkpoints.read_checkpoint(path, keep_quant=True)
            self.stored_quant = weights_layout(self._full)
        self.tokenizer: Optional[Tokenizer] = read_tokenizer(path)
        if self.tokenizer is not None:
            check_vocab(self.tokenizer, self.config)

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
        if self._full is None:
            stored = store.load_weights(self.path, (first, last), with_embedding, with_head)
        else:
            keys = expected_keys(self.config, (first, last), with_embedding, with_head)
            full = self._held(keys)
            stored = {k: full[k] for k in keys}
        return convert(stored, quant or {}, dtype, _log_requantize)

    def _held(self, keys: Sequence[str]) -> Dict[str, Stored]:
        """The raw checkpoint's weights, read again if a chunk took some of `keys` (`consume`)."""
        with self._reread:
            full = self._full
            assert full is not None
            if any(k not in full for k in keys):
                log.info("mdi: %s: reading the checkpoint again for weights a chunk took", self.path)
                _, full = checkpoints.read_checkpoint(self.path, keep_quant=True)
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
        quant = quant or {}
        want = expected_keys(self.config, (first, last), with_embedding, with_head, quant)
        missing, unexpected = sorted(set(targets) - set(want)), sorted(set(want) - set(targets))
        if missing or unexpected:  # worded as ModelChunk.load_weights words it
            raise ValueError("weights do not match layers [%d, %d): missing %s; unexpected %s"
                             % (first, last, missing[:5] or "none", unexpected[:5] or "none"))
        canonical = expected_keys(self.config, (first, last), with_embedding, with_head)
        if self._full is not None:  # a raw checkpoint held in memory: convert one weight at a time
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
        fn = os.path.join(self.path, store.MODEL_FILE)
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
        w = self.weights(first, last, False, False, dtype, quant)
        return safetensors_save({k: v.contiguous() for k, v in w.items()})


TRIM_EVERY_BYTES = 16 * 2 ** 20  # weights let go of (`consume`) between giving the heap's free pages back


def _stored_bytes(w: Stored) -> int:
    tensors = w.tensors.values() if isinstance(w, QParts) else [w]
    return sum(t.numel() * t.element_size() for t in tensors)


def _log_requantize(key: str, have: QuantSpec, want: QuantSpec) -> None:
    log.info("re-quantizing %s from %s to %s", key, have.label(), want.label())


def check_vocab(tokenizer: Tokenizer, config: ModelConfig) -> None:
    """Every id the tokenizer can produce must have an embedding row (a request's token ids
    are bounded by the tokenizer's vocabulary)."""
    if tokenizer.vocab_size > config.vocab_size:
        raise TokenizerError("tokenizer has %d tokens but the model only %d" % (tokenizer.vocab_size, config.vocab_size))


def read_tokenizer(path: str) -> Optional[Tokenizer]:
    """A model's tokenizer alone, no weight read (a GGUF's from its metadata); None without one."""
    return load_tokenizer(path) if is_mdi_dir(path) else _raw_tokenizer(path)


def _raw_tokenizer(path: str) -> Optional[Tokenizer]:
    if path.endswith(".gguf"):
        return tokenizer_from_gguf(path)
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
    chunk = _empty_chunk(config, first, last, False, False, dtype, device, quant)
    store.read_tensors_into(fn, chunk.state_dict(), exact=exact)  # detached views of the parameters
    chunk.pick_kernels()
    return chunk.eval()
