"""The ggml library, reached through its Python binding (`ggml-python`, pinned in setup.py).

The binding is ctypes over the shared libraries it builds from source with the machine's own
ISA. This module is the one place the rest of mdi touches it: it loads the binding (or says in
one line why it cannot), corrects the few declarations the binding gets wrong, and adds the
small helpers every graph needs (contexts, numpy in and out of tensors, the backend a chunk
computes on: the CPU, or a GPU where the binding was built with CUDA).

No kernels of our own: every computation is one of ggml's ops.
"""
import ctypes
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from mdi.system.devices import GGML_DEVICE_CPU, GGML_DEVICE_GPU, GGML_DEVICE_IGPU, ggml_device_name

log = logging.getLogger(__name__)

# A failed ggml assert ends the process (every operand is checked before a graph is built, so
# this is a bug); by default ggml first runs gdb to print a backtrace, which takes seconds.
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

_import_error: Optional[str] = None
try:
    from ggml import ggml as gg  # noqa: F401  (re-exported: mdi.model.ggml's modules call ggml through it)
except Exception as e:  # the binding missing, or its shared library unloadable on this machine
    gg = None  # type: ignore[assignment]
    _import_error = "%s: %s" % (type(e).__name__, e)

# Four functions return a pointer that the binding declares through a NewType of int: ctypes
# then reads a C int and truncates the pointer (ggml-python 0.0.45; a segfault at first use).
_POINTER_RESULTS = ("ggml_backend_cpu_buffer_type", "ggml_backend_cpu_buffer_from_ptr",
                    "ggml_backend_alloc_buffer", "ggml_backend_sched_get_tensor_backend")
if gg is not None:
    for _name in _POINTER_RESULTS:
        getattr(gg, _name).restype = ctypes.c_void_p


def _log_from_ggml(level: int, text: bytes, user_data: Any) -> None:
    """ggml's messages (repacking each tensor, buffer sizes...) into Python's logging: its own
    default prints every one of them on stderr."""
    message = text.decode("utf-8", "replace").rstrip("\n")
    if message:
        log.log({3: logging.WARNING, 4: logging.ERROR}.get(level, logging.DEBUG), "ggml: %s", message)


if gg is not None:
    _LOG_CALLBACK = gg.ggml_log_callback(_log_from_ggml)  # kept: ggml holds a pointer to it
    gg.ggml_log_set(_LOG_CALLBACK, None)

# GGUF / ggml type ids (ggml.h's enum ggml_type), by name: the ones a GGUF may hold.
TYPE_IDS: Dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9,
    "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_K": 15,
    "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22,
    "IQ4_XS": 23, "I8": 24, "I16": 25, "I32": 26, "I64": 27, "F64": 28, "IQ1_M": 29, "BF16": 30,
    "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39,
}
TYPE_NAMES = {v: k for k, v in TYPE_IDS.items()}
F32, F16, I32, I64 = TYPE_IDS["F32"], TYPE_IDS["F16"], TYPE_IDS["I32"], TYPE_IDS["I64"]
NUMPY_TYPES = {F32: np.float32, F16: np.float16, I32: np.int32, I64: np.int64}

ROPE_NORMAL, ROPE_NEOX = 0, 2  # ggml_rope_ext's modes: adjacent pairs, or halves (rotate-half)
PREC_F32 = 10  # GGML_PREC_F32: flash attention accumulates in float32 where the backend can


def unavailable_reason() -> Optional[str]:
    """Why ggml cannot run in this process (None: it can)."""
    if gg is None:
        return ("the ggml binding (ggml-python) does not load: %s; install it with "
                "./scripts/setup_env.sh (it builds from source for this CPU)" % _import_error)
    return None


def require() -> Any:
    """The binding module, or a one-line error saying why it is missing."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    return gg


def cpu_features() -> Dict[str, bool]:
    """The instruction sets this build of ggml uses here (ggml_cpu_has_*), true ones only."""
    require()
    out = {}
    for name in ("avx", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "f16c", "fma",
                 "neon", "dotprod", "matmul_int8", "sve", "sme"):
        fn = getattr(gg, "ggml_cpu_has_" + name, None)
        try:
            if fn is not None and fn():
                out[name] = True
        except RuntimeError:  # declared by the binding, absent from this build
            pass
    return out


def version() -> str:
    """ggml's version and the binding's, e.g. "ggml 0.15.3, ggml-python 0.0.45"."""
    require()
    import ggml as package
    try:
        v = gg.ggml_version().decode()
    except (AttributeError, RuntimeError):
        v = "?"
    return "ggml %s, ggml-python %s" % (v, getattr(package, "__version__", "?"))


class Freed:
    """Something holding ggml memory that `free()` gives back: collected, it frees itself, quietly
    (at interpreter shutdown the library may already be gone)."""

    def free(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass


class Context(Freed):
    """A ggml context that holds tensor and graph metadata only (no_alloc): data lives in
    backend buffers, or in one CPU buffer of its own (`allocate`). Freed with the object (or
    `free`), its buffer first."""

    def __init__(self, n_tensors: int, graph_nodes: int = 0) -> None:
        require()
        size = gg.ggml_tensor_overhead() * n_tensors
        if graph_nodes:
            size += gg.ggml_graph_overhead_custom(graph_nodes, False)
        self.ptr = gg.ggml_init(gg.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        if not self.ptr:
            raise MemoryError("ggml_init failed for %d tensors" % n_tensors)
        self.buffer: Optional[int] = None

    def allocate(self, what: str, zeroed: bool = False, buffer_type: Optional[int] = None) -> int:
        """Place every tensor of this context in one buffer of `buffer_type` (None: the CPU's;
        `zeroed`: cleared to zeros); its bytes. MemoryError naming `what` where it cannot be had."""
        buft = cpu_buffer_type() if buffer_type is None else buffer_type
        self.buffer = gg.ggml_backend_alloc_ctx_tensors_from_buft(self.ptr, buft)
        if not self.buffer:
            self.buffer = None
            raise MemoryError("ggml could not allocate %s" % what)
        if zeroed:
            gg.ggml_backend_buffer_clear(self.buffer, 0)
        return int(gg.ggml_backend_buffer_get_size(self.buffer))

    def free(self) -> None:
        if self.buffer is not None and gg is not None:
            gg.ggml_backend_buffer_free(self.buffer)
        self.buffer = None
        if self.ptr and gg is not None:
            gg.ggml_free(self.ptr)
        self.ptr = None


# ggml's device types that mdi computes on as a GPU: a discrete one, or an integrated one sharing
# the host's memory (a Jetson's, where ggml reports it so)
GPU_DEVICE_TYPES = (GGML_DEVICE_GPU, GGML_DEVICE_IGPU)


def gpu_device_names() -> List[str]:
    """ggml's GPU devices in this build, by ggml's names ("CUDA0"...): none where the binding
    was built for the CPU alone."""
    require()
    out = []
    for i in range(gg.ggml_backend_dev_count()):
        dev = gg.ggml_backend_dev_get(i)
        if gg.ggml_backend_dev_type(dev) in GPU_DEVICE_TYPES:
            out.append(gg.ggml_backend_dev_name(dev).decode())
    return out


def gpu_unusable_reason(device: str) -> Optional[str]:
    """None when ggml can compute on `device` ("cuda", "cuda:N") in this process, else why not."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    name, gpus = ggml_device_name(device), gpu_device_names()
    if name in gpus:
        return None
    if not gpus:
        return ("%s: this ggml binding has no GPU device (it was built for the CPU alone; where nvcc is, build it "
                "with CUDA: MDI_GGML_CMAKE_ARGS=-DGGML_CUDA=on ./scripts/setup_env.sh, or jetson/setup.sh "
                "--ggml-cuda)" % device)
    return "%s: ggml has no device %s here (it has %s)" % (device, name, ", ".join(gpus))


class ComputeBackend(Freed):
    """The ggml backend a chunk computes on: the CPU (`device` "cpu": its threads set here, the
    weights read from the GGUF's map in place) or a device of ggml's registry ("cuda", "cuda:N",
    or a ggml device name: mdi.system.devices.ggml_device_name): every tensor of the chunk
    (weights, KV cache, a graph's buffers) in that device's buffers, the weights copied in once.
    Its free memory: mdi.system.memory.free_bytes_on."""

    def __init__(self, device: str = "cpu", threads: int = 1) -> None:
        require()
        self.device = device
        self.threads = 0
        if device == "cpu":
            self.dev = cpu_device()
            self.ptr = gg.ggml_backend_cpu_init()
            self.buffer_type = cpu_buffer_type()
        else:
            name = ggml_device_name(device)
            self.dev = gg.ggml_backend_dev_by_name(name.encode())
            if not self.dev:
                raise RuntimeError(gpu_unusable_reason(device) or "ggml has no device %s" % name)
            self.ptr = gg.ggml_backend_dev_init(self.dev, None)
            self.buffer_type = gg.ggml_backend_dev_buffer_type(self.dev)
        if not self.ptr:
            raise RuntimeError("ggml could not start its backend on %s" % device)
        self.on_cpu = gg.ggml_backend_dev_type(self.dev) == GGML_DEVICE_CPU  # (threads apply)
        self.set_threads(threads)

    @property
    def maps_weights(self) -> bool:
        """Whether the weights stay in the GGUF's map (else they are copied into this backend's buffers)."""
        return self.device == "cpu"

    def set_threads(self, threads: int) -> None:
        threads = max(1, int(threads))
        if threads != self.threads:
            if self.on_cpu:
                gg.ggml_backend_cpu_set_n_threads(self.ptr, threads)
            self.threads = threads

    def compute(self, graph: Any) -> None:
        status = gg.ggml_backend_graph_compute(self.ptr, graph)
        if status != 0:
            raise RuntimeError("ggml graph compute failed on %s (status %d)" % (self.device, status))

    def check_supported(self, graph: Any) -> None:
        """RuntimeError naming the first op of `graph` this device cannot compute (a CPU computes
        every op; ggml-cuda's flash attention, say, takes head sizes of 64 and up): one line
        where the graph is built, not an abort inside ggml when it runs."""
        if self.on_cpu:
            return
        for i in range(gg.ggml_graph_n_nodes(graph)):
            node = gg.ggml_graph_node(graph, i)
            if not gg.ggml_backend_supports_op(self.ptr, node):
                raise RuntimeError("ggml on %s cannot compute %s (%s, shape %s) of this model: compute this node on "
                                   "the CPU" % (self.device, gg.ggml_op_desc(node).decode(),
                                                gg.ggml_get_name(node).decode(), shape(node)))

    def free(self) -> None:
        if self.ptr and gg is not None:
            gg.ggml_backend_free(self.ptr)
        self.ptr = None


def cpu_buffer_type() -> int:
    return require().ggml_backend_cpu_buffer_type()


def extra_buffer_types() -> List[Tuple[str, int]]:
    """The CPU device's extra buffer types, by name (e.g. CPU_REPACK: weights re-laid for its
    matrix kernels), as llama.cpp lists them for its weights."""
    require()
    reg = gg.ggml_backend_cpu_reg()
    dev = gg.ggml_backend_reg_dev_get(reg, 0)
    fn = gg.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return []
    proto = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
    listed = proto(fn)(dev)
    out, i = [], 0
    while listed[i]:
        out.append((gg.ggml_backend_buft_name(listed[i]).decode(), listed[i]))
        i += 1
    return out


def cpu_device() -> int:
    require()
    return gg.ggml_backend_reg_dev_get(gg.ggml_backend_cpu_reg(), 0)


def leading_tensors(tensors: Dict[str, Any], names: List[str], max_bytes: int) -> List[Any]:
    """The tensors `names` names, in order, up to `max_bytes` of their data (at least one where
    any): what a measurement times of a node's matrices, past the caches but not all of them."""
    out, total = [], 0
    for name in names:
        out.append(tensors[name])
        total += int(gg.ggml_nbytes(tensors[name]))
        if total >= max_bytes:
            break
    return out


def shape(t: Any) -> Tuple[int, ...]:
    """A tensor's ne (ggml order: fastest first), all four."""
    return tuple(t.contents.ne)


def set_data(t: Any, array: np.ndarray) -> None:
    """Copy a contiguous numpy array into a tensor's backend memory (sizes must agree)."""
    a = np.ascontiguousarray(array)
    n = gg.ggml_nbytes(t)
    if a.nbytes != n:
        raise ValueError("%d bytes for a tensor of %d" % (a.nbytes, n))
    gg.ggml_backend_tensor_set(t, a.ctypes.data, 0, n)


def number_dtype(t: Any) -> Optional[np.dtype]:
    """numpy's dtype of a tensor of plain numbers (F32, F16, I32, I64), else None (a quantized type)."""
    numbers: Dict[int, Any] = {gg.GGML_TYPE_F32: np.dtype(np.float32), gg.GGML_TYPE_F16: np.dtype(np.float16),
                               gg.GGML_TYPE_I32: np.dtype(np.int32), gg.GGML_TYPE_I64: np.dtype(np.int64)}
    return numbers.get(int(t.contents.type))


def host_view(t: Any) -> Optional[np.ndarray]:
    """A flat, writable numpy view of a tensor's memory where its buffer is the host's and its
    type a plain number (F32, F16, I32, I64), contiguous, else None (a GPU's buffer: set_data / get_data).
    Writing through it is what set_data does on the CPU, minus ggml's call and numpy's ctypes
    wrapper: a step's Python runs cold after each graph, where each such call costs tens of us."""
    c = t.contents
    dtype = number_dtype(t)
    if dtype is None or not c.buffer or not c.data or not gg.ggml_backend_buffer_is_host(c.buffer) \
            or not gg.ggml_is_contiguous(t):
        return None
    n = int(gg.ggml_nelements(t))
    memory: Any = (ctypes.c_char * (n * dtype.itemsize)).from_address(c.data)
    return np.frombuffer(memory, dtype=dtype)


def get_data(t: Any, out: np.ndarray) -> np.ndarray:
    """Copy a tensor's data into the contiguous numpy array `out` (sizes must agree)."""
    n = gg.ggml_nbytes(t)
    if out.nbytes != n or not out.flags.c_contiguous:
        raise ValueError("%d bytes for a tensor of %d" % (out.nbytes, n))
    gg.ggml_backend_tensor_get(t, out.ctypes.data, 0, n)
    return out
