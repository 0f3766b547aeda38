"""The one home of a model's layout facts: dtypes, canonical tensor shapes, weight sizes and
how layers are cut into per-node ranges.

Everything that needs one of these (the run YAML, the wire format, the /init check, memory
planning, recovery, mdi-bench) asks here, so no table or split rule is written twice.
"""
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from mdi.model.config import ModelConfig
from mdi.model.families import family_of

# Storage dtypes mdi accepts for weights and activations: name -> bytes per element. By name,
# not torch's objects: a node computing with ggml reads configs and frames without torch.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DTYPE_NAMES = tuple(DTYPE_BYTES)
FP16_MAX = 65504.0  # the largest finite float16
# How activations may be encoded on the wire (mdi.ring.wire): here, below both the ring and the
# run configuration that validates runtime.wire_codec.
WIRE_CODECS = ("raw", "float16", "bfloat16", "int8")

Range = Tuple[int, int]


class CheckpointError(ValueError):
    """A checkpoint or partition that is missing, unrecognised, or does not match the expected layout."""


def first_line(e: Exception) -> str:
    """An exception's message in one line (a library's may run to several)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ----------------------------------------------------------------------------- quantized weights

QUANT_KINDS = ("int8", "int4")
QUANT_MODES = ("none", "auto") + QUANT_KINDS  # what model.quant / --quant accept
INT4_GROUPS = (32, 64, 128)  # int4 group sizes mdi writes (GGUF's Q4 blocks are 32)
# mdi-prepare's --quant values that name a GGUF type (ggml quantizes every one of them without an
# importance matrix; mdi.model.files.gguf_export writes them)
EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k",
                "q6_k", "iq4_nl", "iq4_xs")


def quant_mode_problem(value: str) -> Optional[str]:
    """Why `value` is no model.quant / --quant (None: it is one). A GGUF type (q4_k, q8_0, f16...)
    is named once, where the model is prepared: the message says so."""
    if value in QUANT_MODES:
        return None
    problem = "expected one of %s, got %r" % (", ".join(QUANT_MODES), value)
    gguf = value.lower()
    if gguf not in EXPORT_TYPES:  # llama.cpp's mixes (Q4_K_M): mdi-prepare writes their base type
        gguf = re.sub(r"_[sml]$", "", gguf)
    if gguf in EXPORT_TYPES:
        problem += (" (a GGUF type is chosen when the model is prepared: mdi-prepare PATH --quant %s; "
                    "a run's auto then computes its tensors as stored)" % gguf)
    return problem


def group_size_problem(quant: Optional[str], group: int) -> Optional[str]:
    """Why `group` cannot be `quant`'s group size (None: it can): int4 takes INT4_GROUPS only
    (another ran every layer on the slow dequantizing kernel, 0.17x), int8 at least 2."""
    if quant not in QUANT_KINDS:
        return "a group size needs quant int8 or int4"
    if quant == "int4" and group not in INT4_GROUPS:
        return "int4 groups are %s, not %d" % (", ".join(map(str, INT4_GROUPS)), group)
    if group < 2:
        return "int8 groups are at least 2, not %d" % group
    return None
# One quantized weight `X` ([out, in]) is stored as these tensors instead of `X.weight`:
#   X.qweight  int8 [out, in]  (int8: w = q * scale)  or  uint8 [out, in/2]  (int4: two values per
#              byte, the even column in the low nibble; w = q * scale + min, q in 0..15)
#   X.scales   float16 [out, in/group]      X.mins  float16 [out, in/group]  (int4 only)
QUANT_SUFFIXES = ("qweight", "scales", "mins")


@dataclass(frozen=True)
class QuantSpec:
    """How one weight matrix is quantized: `kind` int8 (symmetric) or int4 (scale + min), with
    one scale per `group_size` consecutive input columns (int8 per output channel: the width)."""
    kind: str
    group_size: int

    def tensor_shapes(self, n_out: int, n_in: int) -> Dict[str, Tuple[Tuple[int, ...], Any]]:
        """suffix -> (shape, torch dtype) of the stored tensors of an [n_out, n_in] weight."""
        import torch
        return {suffix: (shape, getattr(torch, name))
                for suffix, (shape, name) in self.stored_shapes(n_out, n_in).items()}

    def stored_shapes(self, n_out: int, n_in: int) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """suffix -> (shape, dtype name) of the stored tensors of an [n_out, n_in] weight."""
        groups = (n_out, n_in // self.group_size)
        if self.kind == "int8":
            return {"qweight": ((n_out, n_in), "int8"), "scales": (groups, "float16")}
        return {"qweight": ((n_out, n_in // 2), "uint8"), "scales": (groups, "float16"), "mins": (groups, "float16")}

    def nbytes(self, n_out: int, n_in: int) -> int:
        sizes = {"int8": 1, "uint8": 1, "float16": 2}
        return sum(numel(shape) * sizes[dt] for shape, dt in self.stored_shapes(n_out, n_in).values())

    def check(self, name: str, n_in: int) -> None:
        """A group size that does not divide the layer's width cannot be stored: say which layer."""
        if self.kind not in QUANT_KINDS:
            raise CheckpointError("%s: unknown quantization %r (expected %s)" % (name, self.kind, ", ".join(QUANT_KINDS)))
        if self.group_size < 2 or n_in % self.group_size or (self.kind == "int4" and self.group_size % 2):
            raise CheckpointError("%s: %s group size %d does not divide its width %d (try --group-size %s)"
                                  % (name, self.kind, self.group_size, n_in,
                                     " or ".join(str(g) for g in INT4_GROUPS if n_in % g == 0) or "of a divisor"))

    def label(self) -> str:
        return "%s/g%d" % (self.kind, self.group_size)

    def to_json(self) -> List:
        return [self.kind, self.group_size]

    @staticmethod
    def from_json(value) -> "QuantSpec":
        if (not isinstance(value, list) or len(value) != 2 or value[0] not in QUANT_KINDS
                or not isinstance(value[1], int) or isinstance(value[1], bool) or not 2 <= value[1] <= 1 << 20):
            raise ValueError("a quantization is [\"int8\" or \"int4\", group size], not %r" % (value,))
        return QuantSpec(value[0], value[1])


QuantLayout = Mapping[str, QuantSpec]  # weight name without ".weight" (blocks.3.attn.qkv, tok_emb) -> spec


def quantizable(config: "ModelConfig", layer_range: Range, with_embedding: bool,
                with_head: bool) -> Dict[str, Tuple[int, int]]:
    """The matrices mdi may quantize -> [out, in]: every linear layer of the blocks, the token
    embedding (the tied head) and an untied head. Norms, biases and GPT-2's positions stay float."""
    return {k[:-len(".weight")]: s for k, s in expected_shapes(config, layer_range, with_embedding, with_head).items()
            if k.endswith(".weight") and len(s) == 2 and not k.startswith("pos_emb")}


def layout_to_json(layout: QuantLayout) -> Dict[str, List]:
    return {base: spec.to_json() for base, spec in sorted(layout.items())}


def layout_from_json(data) -> Dict[str, QuantSpec]:
    if not isinstance(data, dict):
        raise ValueError("a quantization layout is a mapping of weight names to [kind, group size]")
    return {str(k): QuantSpec.from_json(v) for k, v in data.items()}


def stored_layout(tensors: Mapping[str, Tuple[Sequence[int], Any]]) -> Dict[str, QuantSpec]:
    """The quantization of each weight in a stored state dict (name -> (shape, dtype)), read off
    its tensors: int8 vs packed uint8 `qweight`, the group from the width over the scale count."""
    out = {}
    for key, (shape, dtype) in tensors.items():
        if not key.endswith(".qweight"):
            continue
        base = key[:-len(".qweight")]
        scales = tensors.get(base + ".scales")
        if scales is None or len(shape) != 2 or len(scales[0]) != 2 or not scales[0][1]:
            raise CheckpointError("%s has no matching %s.scales" % (key, base))
        named = str(dtype).replace("torch.", "")
        kind = "int8" if named == "int8" else "int4" if named == "uint8" else None
        if kind is None:
            raise CheckpointError("%s has dtype %s, expected int8 or uint8" % (key, dtype))
        width = shape[1] * (2 if kind == "int4" else 1)
        out[base] = QuantSpec(kind, width // scales[0][1])
    return out


def torch_dtype(name: str) -> Any:
    """The torch dtype of one of DTYPE_NAMES (torch imported here, where it is asked for)."""
    if name not in DTYPE_BYTES:
        raise KeyError(name)
    import torch
    return getattr(torch, name)


_dtype_names: Dict[Any, str] = {}  # dtype -> name: str() of a numpy dtype runs Python code, ~100 us cold


def dtype_name(dtype: Any) -> str:
    """The DTYPE_NAMES name of a torch or numpy float dtype (torch.float16 and numpy's
    float16 alike: "float16")."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = _name_of(dtype)
    return name


def _name_of(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        name = getattr(dtype, "__name__", name)  # a numpy scalar type (np.float32)
    if name not in DTYPE_BYTES:
        raise KeyError(dtype)
    return name


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[name]


# ----------------------------------------------------------------------------- canonical tensors

def expected_shapes(config: ModelConfig, layer_range: Range, with_embedding: bool,
                    with_head: bool, quant: Optional[QuantLayout] = None) -> Dict[str, Tuple[int, ...]]:
    """Canonical tensor names and shapes for blocks [first, last) plus the optional ends.

    ``with_head`` needs the final norm and the LM head; with a tied head that is
    ``tok_emb.weight``, so it is listed even when ``with_embedding`` is False.
    Linear-layer biases follow ``config.bias`` (q/k/v also ``qkv_bias``); gpt2 norms always have biases.
    Per block: norm1 (before attention), attn.qkv, attn.proj, attn.q_norm / attn.k_norm (Qwen3,
    Gemma 3), post_attn_norm (Gemma 3), norm2 (before the MLP), the MLP, post_mlp_norm (Gemma 3).
    Norm weights are the multipliers as applied (Gemma's checkpoints store them less one). A weight named
    in `quant` is listed as its quantized tensors (QuantSpec.tensor_shapes) instead.
    """
    c = config
    first, last = layer_range
    if not 0 <= first <= last <= c.n_layer:
        raise CheckpointError("layer range [%d, %d) is outside the model's %d layers" % (first, last, c.n_layer))
    family = family_of(c.family)
    layer_norm = family.norm == "layer"  # with a bias (GPT-2)
    E, I, V = c.n_embd, c.ffn_width, c.vocab_size
    qkv = (c.n_head + 2 * c.kv_heads) * c.head_dim
    out: Dict[str, Tuple[int, ...]] = {}

    def linear(name: str, n_out: int, n_in: int, bias: bool = c.bias) -> None:
        out[name + ".weight"] = (n_out, n_in)
        if bias:
            out[name + ".bias"] = (n_out,)

    def norm(name: str) -> None:
        out[name + ".weight"] = (E,)
        if layer_norm:
            out[name + ".bias"] = (E,)

    if with_embedding or (with_head and c.tied_head):
        out["tok_emb.weight"] = (V, E)
    if with_embedding and family.positions == "learned":
        out["pos_emb.weight"] = (c.block_size, E)
    for i in range(first, last):
        p = "blocks.%d." % i
        norm(p + "norm1")
        linear(p + "attn.qkv", qkv, E, c.bias or c.qkv_bias)
        linear(p + "attn.proj", E, c.n_head * c.head_dim)
        if c.qk_norm or family.always_qk_norm:
            out[p + "attn.q_norm.weight"] = (c.head_dim,)
            out[p + "attn.k_norm.weight"] = (c.head_dim,)
        if family.post_norms:  # on attention's output, before the residual add (Gemma 3)
            norm(p + "post_attn_norm")
        norm(p + "norm2")
        if family.mlp == "gelu":
            linear(p + "mlp.fc", I, E)
            linear(p + "mlp.proj", E, I)
        else:
            out[p + "mlp.gate_up.weight"] = (2 * I, E)
            out[p + "mlp.down.weight"] = (E, I)
        if family.post_norms:  # on the MLP's output, before the residual add
            norm(p + "post_mlp_norm")
    if with_head:
        norm("norm_f")
        if not c.tied_head:
            out["lm_head.weight"] = (V, E)
    if not quant:
        return out
    quantized: Dict[str, Tuple[int, ...]] = {}
    for key, shape in out.items():
        spec = quant.get(key[:-len(".weight")]) if key.endswith(".weight") else None
        if spec is None:
            quantized[key] = shape
        else:
            for suffix, (qshape, _) in spec.tensor_shapes(*shape).items():
                quantized[key[:-len("weight")] + suffix] = qshape
    return quantized


def expected_keys(config: ModelConfig, layer_range: Range, with_embedding: bool,
                  with_head: bool, quant: Optional[QuantLayout] = None) -> List[str]:
    return list(expected_shapes(config, layer_range, with_embedding, with_head, quant))


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_bytes(config: ModelConfig, layer_range: Sequence[int], dtype: str, with_ends: bool = False,
                 quant: Optional[QuantLayout] = None) -> int:
    """Bytes of the weights of blocks [first, last) in `dtype`, the weights named in `quant`
    at their quantized size; `with_ends` adds the starter's embedding, final norm and head."""
    shapes = expected_shapes(config, (layer_range[0], layer_range[1]), with_ends, with_ends)
    total = 0
    for key, shape in shapes.items():
        spec = (quant or {}).get(key[:-len(".weight")]) if key.endswith(".weight") else None
        total += spec.nbytes(*shape) if spec is not None else numel(shape) * dtype_bytes(dtype)
    return total


def torch_kv_cache_bytes(config: ModelConfig, n_layers: int, n_slots: int, max_len: int, dtype: Any) -> int:
    """Bytes of a torch KV cache (mdi.model.kv_cache) of `n_layers` layers, `n_slots` slots of
    `max_len` positions, keys and values in `dtype` (a name, or a torch or numpy dtype)."""
    return 2 * n_layers * n_slots * config.kv_heads * max_len * config.head_dim * dtype_bytes(dtype_name(dtype))


def state_dict_nbytes(state_dict: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


# ----------------------------------------------------------------------------- partitions

def balanced(n_layer: int, n_nodes: int) -> List[int]:
    """Layer counts for an even split; the first nodes take the remainder."""
    if not 0 < n_nodes <= n_layer:
        raise CheckpointError("cannot split %d layers over %d nodes" % (n_layer, n_nodes))
    base, extra = divmod(n_layer, n_nodes)
    return [base + (1 if i < extra else 0) for i in range(n_nodes)]


def parse_partition(counts: Union[str, Sequence[int]]) -> List[int]:
    """"10-10-10" or [10, 10, 10] -> [10, 10, 10]."""
    try:
        out = [int(x) for x in counts.split("-")] if isinstance(counts, str) else [int(x) for x in counts]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise CheckpointError("bad partition %r: expected positive layer counts like '10-10-10'" % (counts,))
    return out


def partition_label(counts: Sequence[int]) -> str:
    return "+".join(str(c) for c in counts)


def layer_ranges(counts: Sequence[int]) -> List[List[int]]:
    """Half-open [first, last) ranges for consecutive layer counts, node 0 first."""
    ranges, first = [], 0
    for c in counts:
        ranges.append([first, first + c])
        first += c
    return ranges


def layer_span(first: int, last: int) -> str:
    """A node's layers [first, last) as every human-facing text shows them: '[0, 10)' for
    blocks 0..9. Data (the metrics file, the dashboard's JSON, a worker's /status) holds the
    same half-open pair as [first, last], so a log line and a record never disagree by one."""
    return "[%d, %d)" % (first, last)


def format_layers(first: int, last: int) -> str:
    """'layers [0, 10)': a node's layer range in a message (see layer_span)."""
    return "layers " + layer_span(first, last)


def split_layers(n_layer: int, counts: Union[str, Sequence[int]]) -> List[Range]:
    """A partition checked against the model: positive counts summing to its layers -> ranges."""
    counts = parse_partition(counts)
    if not counts or any(c <= 0 for c in counts) or sum(counts) != n_layer:
        raise CheckpointError("partition %s must be positive layer counts summing to n_layer=%d"
                              % ("-".join(map(str, counts)), n_layer))
    return [(a, b) for a, b in layer_ranges(counts)]
