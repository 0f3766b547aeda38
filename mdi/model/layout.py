"""The one home of a model's layout facts: dtypes, canonical tensor shapes, weight sizes and
how layers are cut into per-node ranges.

Everything that needs one of these (the run YAML, the wire format, the /init check, memory
planning, recovery, mdi-bench) asks here, so no table or split rule is written twice.
"""
from typing import Dict, List, Mapping, Sequence, Tuple, Union

import torch

from mdi.model.config import ModelConfig

# Storage dtypes mdi accepts for weights and activations: name -> (torch dtype, bytes per element).
DTYPES = {
    "float32": (torch.float32, 4),
    "float16": (torch.float16, 2),
    "bfloat16": (torch.bfloat16, 2),
}
DTYPE_NAMES = tuple(DTYPES)
_NAME_OF = {t: name for name, (t, _) in DTYPES.items()}

Range = Tuple[int, int]


class CheckpointError(ValueError):
    """A checkpoint or partition that is missing, unrecognised, or does not match the expected layout."""


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name][0]


def dtype_name(dtype: torch.dtype) -> str:
    return _NAME_OF[dtype]


def dtype_bytes(name: str) -> int:
    return DTYPES[name][1]


# ----------------------------------------------------------------------------- canonical tensors

def expected_shapes(config: ModelConfig, layer_range: Range, with_embedding: bool,
                    with_head: bool) -> Dict[str, Tuple[int, ...]]:
    """Canonical tensor names and shapes for blocks [first, last) plus the optional ends.

    ``with_head`` needs the final norm and the LM head; with a tied head that is
    ``tok_emb.weight``, so it is listed even when ``with_embedding`` is False.
    Linear-layer biases follow ``config.bias``; gpt2 norms always have biases.
    """
    c = config
    first, last = layer_range
    if not 0 <= first <= last <= c.n_layer:
        raise CheckpointError("layer range [%d, %d) is outside the model's %d layers" % (first, last, c.n_layer))
    gpt2 = c.family == "gpt2"
    E, I, V = c.n_embd, c.intermediate_size, c.vocab_size
    qkv = (c.n_head + 2 * c.n_kv_head) * c.head_dim
    out = {}  # type: Dict[str, Tuple[int, ...]]

    def linear(name: str, n_out: int, n_in: int) -> None:
        out[name + ".weight"] = (n_out, n_in)
        if c.bias:
            out[name + ".bias"] = (n_out,)

    def norm(name: str) -> None:
        out[name + ".weight"] = (E,)
        if gpt2:
            out[name + ".bias"] = (E,)

    if with_embedding or (with_head and c.tied_head):
        out["tok_emb.weight"] = (V, E)
    if with_embedding and gpt2:
        out["pos_emb.weight"] = (c.block_size, E)
    for i in range(first, last):
        p = "blocks.%d." % i
        norm(p + "norm1")
        linear(p + "attn.qkv", qkv, E)
        linear(p + "attn.proj", E, E)
        norm(p + "norm2")
        if gpt2:
            linear(p + "mlp.fc", I, E)
            linear(p + "mlp.proj", E, I)
        else:
            out[p + "mlp.gate_up.weight"] = (2 * I, E)
            out[p + "mlp.down.weight"] = (E, I)
    if with_head:
        norm("norm_f")
        if not c.tied_head:
            out["lm_head.weight"] = (V, E)
    return out


def expected_keys(config: ModelConfig, layer_range: Range, with_embedding: bool,
                  with_head: bool) -> List[str]:
    return list(expected_shapes(config, layer_range, with_embedding, with_head))


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_bytes(config: ModelConfig, layer_range: Sequence[int], dtype: str, with_ends: bool = False) -> int:
    """Bytes of the weights of blocks [first, last) in `dtype`; `with_ends` adds the starter's
    embedding, final norm and head."""
    shapes = expected_shapes(config, (layer_range[0], layer_range[1]), with_ends, with_ends)
    return sum(numel(s) for s in shapes.values()) * dtype_bytes(dtype)


def state_dict_nbytes(state_dict: Mapping[str, torch.Tensor]) -> int:
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


def split_layers(n_layer: int, counts: Union[str, Sequence[int]]) -> List[Range]:
    """A partition checked against the model: positive counts summing to its layers -> ranges."""
    counts = parse_partition(counts)
    if not counts or any(c <= 0 for c in counts) or sum(counts) != n_layer:
        raise CheckpointError("partition %s must be positive layer counts summing to n_layer=%d"
                              % ("-".join(map(str, counts)), n_layer))
    return [(a, b) for a, b in layer_ranges(counts)]
