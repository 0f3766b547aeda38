"""Open a model from any supported source and build the chunk a node needs.

A prepared mdi directory is read lazily (a node loads only its own tensors); a raw source
(Hugging Face directory, GGUF, nanoGPT ckpt.pt) is converted in memory once.
"""
import os
from typing import Dict, Optional

import torch
from safetensors.torch import save as safetensors_save

from mdi.model import checkpoints, store
from mdi.model.config import ModelConfig
from mdi.model.layout import CheckpointError, expected_keys
from mdi.model.transformer import ModelChunk
from mdi.model.tokenizer_import import tokenizer_from_gguf, tokenizer_from_hf_dir
from mdi.model.tokenizers import Tokenizer, TokenizerError, load_tokenizer

def is_mdi_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, store.MDI_CONFIG))


class ModelSource:
    """A model's config, tokenizer and a way to fetch any node's weights."""

    def __init__(self, path: str) -> None:
        if not os.path.exists(path):
            raise CheckpointError("model path %s does not exist (prepare it with mdi-prepare)" % path)
        self.path = path
        self._full = None  # type: Optional[Dict[str, torch.Tensor]]
        if is_mdi_dir(path):
            self.config = store.read_mdi_config(path)
            self.tokenizer = load_tokenizer(path)  # type: Optional[Tokenizer]
        else:
            self.config, self._full = checkpoints.read_checkpoint(path)
            self.tokenizer = _raw_tokenizer(path)
        if self.tokenizer is not None:
            check_vocab(self.tokenizer, self.config)

    def weights(self, first: int, last: int, with_embedding: bool, with_head: bool,
                dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        if self._full is None:
            return store.load_weights(self.path, (first, last), with_embedding, with_head, dtype)
        keys = expected_keys(self.config, (first, last), with_embedding, with_head)
        return {k: self._full[k].to(dtype) for k in keys}

    def chunk_bytes(self, first: int, last: int, dtype: torch.dtype) -> bytes:
        """A worker's weights as safetensors bytes, to push over the control plane."""
        w = self.weights(first, last, False, False, dtype)
        return safetensors_save({k: v.contiguous() for k, v in w.items()})


def check_vocab(tokenizer: Tokenizer, config: ModelConfig) -> None:
    """Every id the tokenizer can produce must have an embedding row (a request's token ids
    are bounded by the tokenizer's vocabulary)."""
    if tokenizer.vocab_size > config.vocab_size:
        raise TokenizerError("tokenizer has %d tokens but the model only %d" % (tokenizer.vocab_size, config.vocab_size))


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
                 dtype: torch.dtype, device: str) -> ModelChunk:
    """A chunk with uninitialised `dtype` parameters on `device` (no throwaway random
    initialisation) and real RoPE tables, ready to be filled with weights."""
    with torch.device("meta"):
        chunk = ModelChunk(config, first, last, with_embedding, with_head)
    chunk = chunk.to(dtype=dtype).to_empty(device=device)
    if chunk.rope is not None:  # its buffers were on meta: compute them for real
        from mdi.model.transformer import RotaryEmbedding
        chunk.rope = RotaryEmbedding(config).to(device)
    return chunk


def build_chunk(config: ModelConfig, weights: Dict[str, torch.Tensor], first: int, last: int,
                with_embedding: bool, with_head: bool, dtype: torch.dtype, device: str,
                compute_dtype: Optional[torch.dtype] = None) -> ModelChunk:
    chunk = _empty_chunk(config, first, last, with_embedding, with_head, dtype, device)
    chunk.load_weights({k: v.to(dtype) for k, v in weights.items()})
    chunk.compute_dtype = compute_dtype if compute_dtype != dtype else None
    return chunk.eval()


def build_chunk_from_file(config: ModelConfig, fn: str, first: int, last: int, dtype: torch.dtype, device: str,
                          exact: bool = False) -> ModelChunk:
    """A worker's chunk (blocks [first, last), no embedding or head) read from the safetensors
    file `fn` tensor by tensor into its parameters: peak memory is the chunk plus its largest
    tensor, never a second copy of the weights (store.read_tensors_into). `exact`: the file
    holds exactly these tensors (a pushed chunk); else it may hold more (a full model)."""
    chunk = _empty_chunk(config, first, last, False, False, dtype, device)
    store.read_tensors_into(fn, chunk.state_dict(), exact=exact)  # detached views of the parameters
    return chunk.eval()
