"""The run's settings a node's backend does not read, said where its backend is chosen:
`--quant int4` or `--dtype float16` on a ggml ring and `--kv-type q8_0` on a torch one had been
ignored without a word."""
import logging
from typing import List

from mdi.runconfig import NodeSpec, RunConfig

log = logging.getLogger(__name__)


def unread_settings(cfg: RunConfig, node: NodeSpec, backend: str) -> List[str]:
    """What `node` computing with `backend` ignores of `cfg`, one clause each."""
    unread = []
    quant = cfg.quant_of(node)
    if backend == "ggml" and quant != "auto":
        unread.append("quant %s is torch's: ggml computes the GGUF's tensors as stored (mdi-prepare --quant writes "
                      "other types)" % quant)
    if backend == "ggml" and cfg.model.dtype != "float32":
        unread.append("dtype %s is torch's: ggml computes with float32 activations" % cfg.model.dtype)
    if backend == "torch" and cfg.runtime.kv_type != "f16":
        unread.append("runtime.kv_type %s is ggml's: torch keeps its KV cache in the compute dtype"
                      % cfg.runtime.kv_type)
    return unread


def warn_unread_settings(cfg: RunConfig, node: NodeSpec, backend: str) -> None:
    unread = unread_settings(cfg, node, backend)
    if unread:
        log.warning("mdi: %s: %s", "starter" if node is cfg.starter else node.name, "; ".join(unread))
