"""Write a llama.cpp-compatible GGUF from mdi's canonical weights (what `mdi-prepare` puts in a
model directory as model.gguf, the ggml backend's weights), quantized by ggml's own quantizer.

Names, layouts and metadata are llama.cpp's (convert_hf_to_gguf.py's): fused q/k/v rows split
into attn_q / attn_k / attn_v (GPT-2 keeps attn_qkv, with its bias), gate/up rows into
ffn_gate / ffn_up; q and k rows (and biases) of architecture "llama" permuted as LlamaModel.permute
does (llama.cpp's RoPE rotates adjacent pairs there; qwen2 / qwen3 / gemma3 keep HF's halves);
canonical matrices are [out, in] like torch's Linear, which is ggml's [in, out] as it is (GPT-2's
Conv1D transposition is undone in canonical form already); Gemma 3's norm weights are stored as
the multipliers 1 + w, which canonical weights are already. Llama 3's RoPE scaling is written as
the rope_freqs tensor.

Types (`weight_type`): one GGUF type for every weight matrix (the token embedding, the blocks'
linear layers, an untied head), quantized by ggml (`ggml_quantize_chunk`), or None: each matrix
as its canonical form holds it (below). Whatever the type:
  - norms, biases, RoPE factors and GPT-2's position table are F32;
  - a type under 8 bits stores the head (output.weight, or token_embd.weight when the head is
    tied) as Q8_0, as mdi's int4 keeps its head int8 (llama.cpp's quantize keeps it at Q6_K for
    the same reason; Q8_0 is what the torch backend reads back exactly);
  - a matrix whose rows are not whole blocks of the type falls back as llama.cpp's quantize does
    (FALLBACKS: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, Q2_K/Q3_K to Q4_0, IQ4_XS to IQ4_NL),
    and to F16 where rows are not whole blocks of that either; the count is said in one line;
  - a quantized canonical weight (quant.QParts) is dequantized and quantized to the type, except
    where the type is its own exact form: mdi int8 in groups of 32 IS Q8_0 (a float16 scale and
    32 int8 a block), int4 in groups of 32 (float16 scale and min) IS Q4_1, and IS Q4_0 where each
    min is -8 scales (a model read from a Q4_0 GGUF): those blocks are copied, nothing re-rounded.
With `weight_type` None (mdi-prepare's --quant auto / none / int8 / int4): int8 -> Q8_0, int4 ->
Q4_1 (Q4_0 where it is Q4_0's numbers; exact in groups of 32, re-rounded from other group sizes),
float -> `float_type` (F32 for a matrix with values past float16's range).
Other types are refused: IQ1_S / IQ2_XXS / IQ2_XS need an importance matrix; the rest ggml computes
(IQ1_M, IQ2_S, IQ3_*, TQ*, MXFP4) are not written, as the torch weights are read back from the file.

Metadata: general.architecture and the architecture's keys (gguf_write.add_model_metadata),
general.file_type, general.quantization_version, and the tokenizer.* keys of a source GGUF when
one is given (else tokenizer.ggml.model "no_vocab": llama.cpp opens the file, mdi reads the
prepared directory's tokenizer). Tensors are planned first (the header), then encoded on a few
threads (ggml quantizes outside the GIL) and written in order, so the peak is the canonical
weights plus the few tensors in flight.
"""
import logging
import os
import struct
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from mdi.model.config import ModelConfig
from mdi.model.files.gguf_encode import Job, encoder, is_exact, rows_of
from mdi.model.files.gguf_parts import permutation, rope_factors, take_part, tensor_parts
from mdi.model.files.gguf_write import add_model_metadata, arch_of
from mdi.model.ggml.tensors import GGUF_DIRECT, GGUF_FLOAT, GGUF_NEAREST
from mdi.model.layout import EXPORT_TYPES, FP16_MAX, CheckpointError, QuantSpec
from mdi.model.quantization.quant import QParts, Stored, cat_rows, quantize
from mdi.model.threads import usable_cpus

log = logging.getLogger(__name__)

# the types ggml quantizes only with an importance matrix (ggml_quantize_requires_imatrix)
IMATRIX_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ1_S")
FLOAT_TYPES = GGUF_FLOAT
WIDE_TYPES = ("F32", "F16", "BF16", "Q8_0")  # 8 bits or more: the head keeps the named type
HEAD_TYPE = "Q8_0"
VECTOR_TYPE = "F32"
# general.file_type (llama.cpp's llama_ftype) of a file whose matrices are mostly this type; a
# single-type file is a K-quant's "_S" (small) mix
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 11,
              "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32}
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION


def is_gguf_type(name: str) -> bool:
    """Whether --quant `name` names a GGUF type (q4_k...), not one of mdi's torch modes."""
    from mdi.model.ggml.tensors import MATRIX_TYPES
    return name.lower() in EXPORT_TYPES or name.upper() in MATRIX_TYPES


def gguf_type(name: str, flag: str = "--quant") -> str:
    """'q4_k' -> 'Q4_K', or a one-line error naming the flag: not a type, one ggml cannot
    quantize without an importance matrix, or one mdi-prepare does not write."""
    from mdi.model.ggml.tensors import MATRIX_TYPES
    kind = name.upper()
    if name.lower() in EXPORT_TYPES:
        return kind
    if kind in IMATRIX_TYPES:
        raise CheckpointError("%s %s: ggml quantizes %s only with an importance matrix (llama-imatrix), which "
                              "mdi-prepare does not compute; use one of %s"
                              % (flag, name, kind, ", ".join(EXPORT_TYPES)))
    if kind in MATRIX_TYPES:  # ggml computes it (a GGUF holding it runs), but mdi-prepare does not write it
        raise CheckpointError("%s %s: %s is not a type mdi-prepare writes (the torch weights are read back from "
                              "model.gguf, in these types only): choose one of %s"
                              % (flag, name, kind, ", ".join(EXPORT_TYPES)))
    raise CheckpointError("%s %s is not a GGUF type mdi writes (%s)" % (flag, name, ", ".join(EXPORT_TYPES)))


# ----------------------------------------------------------------------------- types

def _block(kind: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    return GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]


# llama.cpp's tensor_type_fallback (llama-quant.cpp): a 256-value type's 32-value stand-in of
# about its size (Q8_0 had stood in for all of them: SmolLM2's rows of 576 made --quant q4_k
# 131 MB, over its int4 file's 98)
FALLBACKS = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


def fallback(kind: str, n_per_row: int) -> str:
    """`kind`, or what a row of `n_per_row` values is stored as instead (module docstring)."""
    if n_per_row % _block(kind) == 0:
        return kind
    stand_in = FALLBACKS.get(kind, "F16")
    return stand_in if n_per_row % _block(stand_in) == 0 else "F16"


def _stored_type(w: Stored, float_type: str) -> str:
    if isinstance(w, QParts):
        if w.spec.kind == "int8":
            return "Q8_0"
        return "Q4_0" if is_exact(w, "Q4_0") else "Q4_1"  # (read from a Q4_0 GGUF: its own blocks again)
    return float_type


def _past_f16(w: Stored) -> bool:
    """Whether float weights hold a value float16 would turn into an infinity."""
    return not isinstance(w, QParts) and bool(w.numel()) and float(w.detach().abs().max()) > FP16_MAX


def plan_types(config: ModelConfig, state: Mapping[str, Stored], weight_type: Optional[str],
               float_type: str = "F16") -> Dict[str, str]:
    """GGUF name -> the ggml type it is written as (module docstring)."""
    out: Dict[str, str] = {}
    parts = tensor_parts(config)
    fell: Dict[str, int] = {}  # "Q4_K -> Q5_0" -> matrices
    for name, part in parts.items():
        w = state[part.key]
        if len(w.shape) == 1 or name == "position_embd.weight":
            out[name] = VECTOR_TYPE
            continue
        head = name == "output.weight" or (name == "token_embd.weight" and config.tied_head)
        if weight_type is None:
            kind = _stored_type(w, float_type)
        else:
            kind = HEAD_TYPE if head and weight_type not in WIDE_TYPES else weight_type
        stored = fallback(kind, int(w.shape[1]))
        if stored != kind:
            key = "%s -> %s (rows of %d values)" % (kind, stored, int(w.shape[1]))
            fell[key] = fell.get(key, 0) + 1
        out[name] = "F32" if stored == "F16" and _past_f16(w) else stored  # asked for, or a row's fallback
    if fell and weight_type is not None:  # (as llama.cpp's quantize says "N tensor(s) required fallback")
        log.warning("mdi: %d of %d matrices are stored in another type, their rows not whole blocks of %s: %s",
                    sum(fell.values()), sum(1 for n in out if out[n] != VECTOR_TYPE), weight_type,
                    ", ".join("%s x %d" % kv for kv in sorted(fell.items())))
    if rope_factors(config) is not None:
        out["rope_freqs.weight"] = VECTOR_TYPE
    return out


def file_type(types: Mapping[str, str], weight_type: Optional[str]) -> int:
    """general.file_type: the named type's, else that of most block matrices."""
    if weight_type is None:
        counts: Dict[str, int] = {}
        for name, kind in types.items():
            if name.startswith("blk.") and name.endswith(".weight") and "norm" not in name:
                counts[kind] = counts.get(kind, 0) + 1
        weight_type = max(sorted(counts), key=lambda k: counts[k]) if counts else "F32"
    return FILE_TYPES.get(weight_type, FILE_TYPES["F16"])


# ----------------------------------------------------------------------------- the file

@dataclass
class Exported:
    path: str
    types: Dict[str, str]  # GGUF name -> type written
    nbytes: int
    seconds: float

    def describe(self) -> str:
        return describe_types(self.types)


def describe_types(types: Mapping[str, str]) -> str:
    """GGUF name -> type as 'Q4_K x 180, Q8_0 x 31, F32 x 61' (most first)."""
    counts: Dict[str, int] = {}
    for kind in types.values():
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join("%s x %d" % (k, n) for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def tokenizer_metadata(gguf_path: str) -> List[Tuple[str, Any, int, Optional[int]]]:
    """A GGUF's tokenizer.* keys as (key, value, GGUF value type, array item type)."""
    from mdi.model.files.gguf_layout import ARRAY, open_reader
    reader = open_reader(gguf_path)
    out = []
    for key in reader.keys():
        if not key.startswith("tokenizer."):
            continue
        vtype, pos = reader._values[key]
        item = None
        if vtype == ARRAY:
            (item,) = struct.unpack_from(reader._order + "I", reader._map, pos)
        out.append((key, reader.value(key), vtype, item))
    return out


def export_gguf(path: str, config: ModelConfig, state: Mapping[str, Stored], weight_type: Optional[str] = None,
                float_type: str = "F16", tokenizer_from: Optional[str] = None,
                threads: Optional[int] = None) -> Exported:
    """Write `state` (canonical names, mdi.model.layout) as a GGUF at `path` (through a
    temporary file beside it: a failure leaves no partial model.gguf). `weight_type`: a GGUF
    type name for every matrix (gguf_type), or None (each as stored; floats as `float_type`).
    `tokenizer_from`: a GGUF whose tokenizer.* keys are copied."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    t0 = time.perf_counter()
    kind = gguf_type(weight_type) if weight_type is not None else None
    parts = tensor_parts(config)
    missing = sorted({p.key for p in parts.values()} - set(state))
    if missing:
        raise CheckpointError("cannot write %s: the weights have no %s" % (path, ", ".join(missing[:4])))
    types = plan_types(config, state, kind, float_type)
    factors = rope_factors(config)
    arch = arch_of(config)
    from mdi.model.ggml.tensors import node_tensors
    dims = node_tensors(config, 0, config.n_layer, True, True, rope_freqs=factors is not None)
    if set(dims) != set(types):  # the two tables of llama.cpp's names disagree: a bug, said plainly
        raise CheckpointError("GGUF export of a %s model: names %s vs %s" % (
            config.family, sorted(set(dims) - set(types))[:3], sorted(set(types) - set(dims))[:3]))
    for name, part in parts.items():
        shape = tuple(int(d) for d in state[part.key].shape)
        rows = (part.stop if part.stop is not None else shape[0]) - part.start
        if (rows,) + shape[1:] != tuple(reversed(dims[name])):
            raise CheckpointError("cannot write %s: %s has shape %s, the model's %s needs %s" % (
                path, part.key, list(shape), name, list(reversed(dims[name]))))
    order: List[str] = [n for n in ("token_embd.weight", "position_embd.weight", "rope_freqs.weight") if n in types]
    order += [n for n in dims if n not in order]

    tmp = path + ".tmp"
    quiet = logging.getLogger("gguf")  # it logs every file it writes at INFO
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    threads = threads or min(8, usable_cpus())
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        writer = GGUFWriter(tmp, arch)
        writer.add_name(config.name)
        add_model_metadata(writer, config, arch)
        writer.add_file_type(file_type(types, kind))
        if any(t not in FLOAT_TYPES for t in types.values()):
            writer.add_quantization_version(QUANTIZATION_VERSION)
        tokenizer = tokenizer_metadata(tokenizer_from) if tokenizer_from else []
        if not tokenizer:
            writer.add_tokenizer_model("no_vocab")
        for key, value, vtype, item in tokenizer:
            if not any(key in kv for kv in writer.kv_data):  # bos / eos: the config's, written above
                sub = GGUFValueType(item) if item is not None else None
                writer.add_key_value(key, value, GGUFValueType(vtype), sub)
        from mdi.model.ggml.tensors import tensor_bytes
        for name in order:
            writer.add_tensor_info(name, tuple(reversed(dims[name])), np.dtype(np.float32),
                                   tensor_bytes(types[name], dims[name]), raw_dtype=GGMLQuantizationType[types[name]])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(tensor_bytes(types[n], dims[n]) for n in order)
        done, shown = 0, time.perf_counter()
        window: "deque[Tuple[str, Any, List[Any]]]" = deque()  # tensors being encoded, in file order

        def write_first() -> None:
            nonlocal done, shown
            name, out, futures = window.popleft()
            for f in futures:
                f.result()
            writer.write_tensor_data(out)
            done += tensor_bytes(types[name], dims[name])
            if time.perf_counter() - shown > 5 and window:
                shown = time.perf_counter()
                log.info("writing %s: %d%% (%s)", path, 100 * done // max(1, total), name)

        for name in order:
            jobs: List[Job] = []
            if name == "rope_freqs.weight":
                out = factors
            else:
                out, jobs = encoder(take_part(state, parts[name]), types[name])
            if pool is None:
                for job in jobs:
                    job()
                window.append((name, out, []))
            else:
                window.append((name, out, [pool.submit(job) for job in jobs]))
            while len(window) > 2 * threads:
                write_first()
        while window:
            write_first()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        quiet.setLevel(level)
        if pool is not None:
            pool.shutdown()
    return Exported(path, types, os.path.getsize(path), time.perf_counter() - t0)


# ----------------------------------------------------------------------------- reading back

def read_back(path: str, config: ModelConfig, requantized: Optional[List[str]] = None) -> Dict[str, Stored]:
    """The canonical weights the torch backend computes from an exported GGUF: its blocks as
    mdi.model.files.gguf.read_gguf(keep_quant=True) takes them (Q8_0 -> int8, Q4_0 / Q4_1 -> int4 in
    groups of 32 exactly, K-quants and IQ4 re-rounded to the nearest mdi format, floats float).
    read_gguf itself where it reads the file; for what it does not (GPT-2, IQ4 types) the same
    rules here, through this module's table of names."""
    from mdi.model.files import gguf as gguf_reader
    from mdi.model.files.gguf_layout import open_reader
    reader = open_reader(path)
    infos = {t.name: t for t in reader.tensors}
    kinds = {t.tensor_type.name for t in reader.tensors}
    readable = all(k in GGUF_DIRECT or k in GGUF_NEAREST or k in FLOAT_TYPES for k in kinds)
    if arch_of(config) in gguf_reader.TORCH_ARCHITECTURES and readable:
        _, state = gguf_reader.read_gguf(path, keep_quant=True, requantized=requantized)
        return state
    pieces: Dict[str, List[Tuple[int, Stored]]] = {}
    parts = tensor_parts(config)
    missing = [n for n in parts if n not in infos]
    if missing:
        raise CheckpointError("%s: GGUF has no tensor %s" % (path, ", ".join(missing[:4])))
    for name, part in parts.items():
        w = _load(path, infos[name], requantized)
        reader.drop_pages(infos[name])
        if part.heads:
            w = rows_of(w, torch.argsort(permutation(int(w.shape[0]), part.heads)))
        pieces.setdefault(part.key, []).append((part.start, w))
    out: Dict[str, Stored] = {}
    for key, found in pieces.items():
        found.sort(key=lambda p: p[0])
        ws = [w for _, w in found]
        out[key] = ws[0] if len(ws) == 1 else cat_rows(ws)  # (biases too: rows of floats)
    return out


def _load(path: str, t: Any, requantized: Optional[List[str]]) -> Stored:
    from mdi.model.quantization.quant import from_gguf_blocks
    kind = t.tensor_type.name
    shape = t.dims
    matrix = len(shape) == 2 and shape[1] % 32 == 0
    if matrix and kind in GGUF_DIRECT:
        return from_gguf_blocks(t.data, kind, shape[0], shape[1])
    a = np.array(t.values(), dtype=np.float32)
    w = torch.from_numpy(a)
    if matrix and kind in GGUF_NEAREST:
        spec = QuantSpec(GGUF_NEAREST[kind], 32)
        if requantized is not None:
            requantized.append("%s %s -> %s" % (t.name, kind, spec.label()))
        return QParts(spec, quantize(w, spec), shape[1])
    if kind not in FLOAT_TYPES:
        raise CheckpointError("%s: tensor %s has type %s, which mdi does not read" % (path, t.name, kind))
    return w

