"""How weights reach a worker: read from a path inside its models directory, or pushed by the
starter (POST /weights) into a temporary file while hashed. Both are a trust boundary: a path
never leads out of --models-dir, and a push is refused before a byte is read when it cannot
fit, and dropped when its size or hash is not the one /init announced."""
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from mdi.model.config import ModelConfig
from mdi.model.files.model_dir import MODEL_FILE
from mdi.ring.init_request import PushedWeights, RequestError, TooLarge, Weights

PUSH_BLOCK = 1 << 20  # pushed weights go from the socket to disk in blocks of this size


@dataclass
class LoadedWeights:
    """What the chunk in memory was built from: an /init asking for the same reuses it."""
    model: ModelConfig
    layers: List[int]
    dtype: str
    device: str  # where the chunk lives: the worker's --device, else the request's
    weights: Weights
    quant: Dict[str, Any]  # the quantized weights, as their JSON (comparable)
    quant_kernel: Optional[str] = None
    backend: str = "torch"  # what the chunk computes with (ggml: its GGUF tensors as stored)
    kv_type: str = "f16"
    repack: bool = True


def models_dir_default() -> str:
    """mdi-worker's --models-dir when none is given: models/ under its working directory."""
    return os.path.join(os.getcwd(), "models")


def weights_file(models_dir: str, path: str, inside_dir: str = MODEL_FILE) -> str:
    """weights.path as a file inside `models_dir` (a model directory means its
    `inside_dir` file: model.safetensors for torch, model.gguf for ggml). Relative paths are taken from the worker's working directory;
    symlinks are resolved before the check, so none leads out. Anything outside gets one
    answer that does not say whether it exists."""
    base = models_dir

    def inside(p: str) -> bool:
        return os.path.commonpath([base, p]) == base

    try:
        real = os.path.realpath(os.path.abspath(path))
        if inside(real) and os.path.isdir(real):
            real = os.path.realpath(os.path.join(real, inside_dir))
        ok = inside(real)
    except (OSError, ValueError):  # a NUL byte, a name too long
        ok = False
    if not ok:
        raise RequestError("weights.path %r is not inside this worker's models directory %s "
                           "(mdi-worker --models-dir)" % (path, base))
    return real


def check_push_fits(nbytes: int, cache_bytes: int, limit: Optional[int], what: str) -> None:
    """Refuse (413) a push of `nbytes` that, with its KV cache, exceeds the worker's memory
    `limit` (`what` says where that limit comes from), or that its TMPDIR cannot hold."""
    if limit is not None and nbytes + cache_bytes > limit:
        raise TooLarge("weights of %d bytes announced for the push, plus a KV cache of %d bytes, exceed this "
                       "worker's limit of %d bytes (%s)" % (nbytes, cache_bytes, limit, what))
    tmp = tempfile.gettempdir()
    free = shutil.disk_usage(tmp).free
    if nbytes > free:
        raise TooLarge("weights of %d bytes announced for the push do not fit in the %d bytes free in %s "
                       "(the worker's TMPDIR)" % (nbytes, free, tmp))


def receive_push(stream: Any, nbytes: int, announced: PushedWeights, load: Callable[[str], None],
                 alive: Callable[[], None], suffix: str = ".safetensors") -> None:
    """The body read from `stream` (`nbytes` long) goes to a temporary file while it is hashed;
    once its size and hash are the announced ones, `load(path)` reads the chunk from that file
    (memory holds the weights once, whatever their size), and the file goes. `alive` is called
    per block: a long push keeps its /init alive."""
    if nbytes != announced.nbytes:
        raise RequestError("weights have %d bytes, /init announced %d" % (nbytes, announced.nbytes))
    fd, path = tempfile.mkstemp(prefix="mdi-weights-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            got, digest = _copy_body(stream, f, announced.nbytes, alive)
        if got != announced.nbytes:
            raise RequestError("the push ended after %d of the %d bytes announced" % (got, announced.nbytes))
        if digest != announced.sha256:
            raise RequestError("weights sha256 does not match the one announced in /init")
        load(path)  # a GGUF stays mapped once read: its pages outlive the unlinked name
    finally:
        os.unlink(path)


def _copy_body(stream: Any, out: Any, nbytes: int, alive: Callable[[], None]) -> Tuple[int, str]:
    digest = hashlib.sha256()
    got = 0
    while got < nbytes:
        block = stream.read(min(PUSH_BLOCK, nbytes - got))
        if not block:
            break  # the client went away
        digest.update(block)
        out.write(block)
        got += len(block)
        alive()
    return got, digest.hexdigest()
