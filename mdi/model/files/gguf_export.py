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
  - a matrix whose rows are not whole blocks of the type falls back: a 256-value type (K-quants,
    IQ4_XS) to Q8_0 where rows are multiples of 32, else (and any 32-value type) to F16;
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
from mdi.model.families import family_of
from mdi.model.files.gguf_config import PERMUTED_QK
from mdi.model.files.gguf_encode import Job, encoder, is_exact, rows_of
from mdi.model.files.gguf_write import add_model_metadata, arch_of
from mdi.model.ggml.tensors import GGUF_DIRECT, GGUF_FLOAT, GGUF_NEAREST
from mdi.model.layout import FP16_MAX, CheckpointError, QuantSpec
from mdi.model.quantization.quant import QParts, Stored, cat_rows, quantize
from mdi.model.threads import usable_cpus

log = logging.getLogger(__name__)

# --quant values that name a GGUF type (ggml quantizes every one of them without an importance matrix)
EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k",
                "q6_k", "iq4_nl", "iq4_xs")
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


# ----------------------------------------------------------------------------- names

@dataclass(frozen=True)
class Part:
    """A GGUF tensor as a part of a canonical one: rows [start, stop) of `key`, q/k rows
    permuted for llama.cpp's RoPE layout over `heads` heads (0: not permuted)."""
    key: str
    start: int = 0
    stop: Optional[int] = None
    heads: int = 0


def tensor_parts(config: ModelConfig) -> Dict[str, Part]:
    """Every GGUF tensor of the model (llama.cpp's names) -> the canonical tensor it is made
    of (RoPE factors aside: they come from the config)."""
    fam = family_of(config.family)
    permuted = arch_of(config) in PERMUTED_QK
    H, KV, D, I = config.n_head, config.kv_heads, config.head_dim, config.ffn_width
    out: Dict[str, Part] = {"token_embd.weight": Part("tok_emb.weight")}
    if fam.positions == "learned":
        out["position_embd.weight"] = Part("pos_emb.weight")
    norm_parts = ("weight", "bias") if fam.norm == "layer" else ("weight",)

    def norm(gguf: str, canonical: str) -> None:
        for part in norm_parts:
            out["%s.%s" % (gguf, part)] = Part("%s.%s" % (canonical, part))

    for i in range(config.n_layer):
        p, c = "blk.%d." % i, "blocks.%d." % i
        norm(p + "attn_norm", c + "norm1")
        if fam.linear_bias:  # GPT-2: q, k, v stay fused, every linear layer has a bias
            out[p + "attn_qkv.weight"] = Part(c + "attn.qkv.weight")
            out[p + "attn_qkv.bias"] = Part(c + "attn.qkv.bias")
        else:
            q, k = H * D, KV * D
            for part in ("weight", "bias") if config.bias or config.qkv_bias else ("weight",):
                key = c + "attn.qkv." + part
                out[p + "attn_q." + part] = Part(key, 0, q, H if permuted else 0)
                out[p + "attn_k." + part] = Part(key, q, q + k, KV if permuted else 0)
                out[p + "attn_v." + part] = Part(key, q + k, q + 2 * k)
        out[p + "attn_output.weight"] = Part(c + "attn.proj.weight")
        if config.bias or fam.linear_bias:
            out[p + "attn_output.bias"] = Part(c + "attn.proj.bias")
        if config.qk_norm or fam.always_qk_norm:
            out[p + "attn_q_norm.weight"] = Part(c + "attn.q_norm.weight")
            out[p + "attn_k_norm.weight"] = Part(c + "attn.k_norm.weight")
        if fam.post_norms:
            norm(p + "post_attention_norm", c + "post_attn_norm")
            norm(p + "post_ffw_norm", c + "post_mlp_norm")
        norm(p + "ffn_norm", c + "norm2")
        if fam.mlp == "gelu":
            for part in ("weight", "bias"):
                out[p + "ffn_up." + part] = Part(c + "mlp.fc." + part)
                out[p + "ffn_down." + part] = Part(c + "mlp.proj." + part)
        else:
            out[p + "ffn_gate.weight"] = Part(c + "mlp.gate_up.weight", 0, I)
            out[p + "ffn_up.weight"] = Part(c + "mlp.gate_up.weight", I, 2 * I)
            out[p + "ffn_down.weight"] = Part(c + "mlp.down.weight")
    norm("output_norm", "norm_f")
    if not config.tied_head:
        out["output.weight"] = Part("lm_head.weight")
    return out


def _permutation(n: int, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute as a row order: within each head, HF's halves
    [x0..x(h-1), y0..y(h-1)] become llama.cpp's pairs [x0, y0, x1, y1, ...]."""
    return torch.arange(n).reshape(heads, 2, n // heads // 2).transpose(1, 2).reshape(n)


def take_part(state: Mapping[str, Stored], part: Part) -> Stored:
    w = state[part.key]
    if part.start or part.stop is not None:
        w = rows_of(w, slice(part.start, part.stop))
    if part.heads:
        w = rows_of(w, _permutation(int(w.shape[0]), part.heads))
    return w


def rope_factors(config: ModelConfig) -> Optional[np.ndarray]:
    """The rope_freqs tensor (divisors of RoPE's inverse frequencies), from either form the
    config may hold Llama 3's scaling in; None without scaling."""
    if config.rope_factors is not None:
        return np.asarray(config.rope_factors, np.float32)
    if config.rope_scaling is None:
        return None
    from mdi.model.rope import llama3_scaled
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return (inv / llama3_scaled(inv, config.rope_scaling)).numpy().astype(np.float32)


# ----------------------------------------------------------------------------- types

def _block(kind: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    return GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]


def fallback(kind: str, n_per_row: int) -> str:
    """`kind`, or what a row of `n_per_row` values is stored as instead (module docstring)."""
    block = _block(kind)
    if n_per_row % block == 0:
        return kind
    return "Q8_0" if block > 32 and n_per_row % 32 == 0 else "F16"


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
        kind = fallback(kind, int(w.shape[1]))
        out[name] = "F32" if kind == "F16" and _past_f16(w) else kind  # asked for, or a row's fallback
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
        """'Q4_K x 180, Q8_0 x 31, F32 x 61' (most first)."""
        counts: Dict[str, int] = {}
        for kind in self.types.values():
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
            w = rows_of(w, torch.argsort(_permutation(int(w.shape[0]), part.heads)))
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

