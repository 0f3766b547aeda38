"""A node's weights as ggml tensors, read from a GGUF file as stored: block for block, nothing
dequantized or re-rounded, only the tensors the node's layers name.

The file is memory-mapped (mdi.model.files.gguf_layout walks and checks its header first) and each
tensor points into the map, so a node's resident memory holds the pages of its own layers
only, as they are first read. Matrices whose type ggml's CPU backend re-lays for its matrix
kernels (the CPU_REPACK buffer type: Q4_0, Q4_K, IQ4_NL, Q8_0... on AVX2 / NEON) are copied
into that buffer instead, as llama.cpp does by default; the rest stay in the map.
"""
import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple


from mdi.model.files.gguf_layout import GGUFFile, open_reader
from mdi.model.ggml import lib
from mdi.model.layout import CheckpointError

log = logging.getLogger(__name__)

MATMUL_ROWS_PROBE = 512  # llama.cpp's weight_buft_supported asks with a batch this big


class GgufWeights(lib.Freed):
    """Tensors of one GGUF file, by GGUF name, loaded on demand (`load`)."""

    def __init__(self, path: str, reader: Optional[GGUFFile] = None, repack: bool = True) -> None:
        gg = lib.require()
        self.path = path
        self.reader = reader if reader is not None else open_reader(path)
        self.infos = {t.name: t for t in self.reader.tensors}
        self.repack = repack
        self.tensors: Dict[str, Any] = {}
        self.repacked: List[str] = []
        self._ctx: Optional[lib.Context] = None
        self._buffers: List[int] = []
        base = self.reader.bytes.ctypes.data  # the map's address (read-only pages: ggml only reads weights)
        self._base, self._size = base, self.reader.bytes.nbytes
        self._gg = gg

    def has(self, name: str) -> bool:
        return name in self.infos

    def type_name(self, name: str) -> str:
        return self.infos[name].tensor_type.name

    def dims(self, name: str) -> Tuple[int, ...]:
        """ggml order (fastest first), as the file lists them."""
        return tuple(int(d) for d in self.infos[name].shape)

    def load(self, names: Iterable[str], matmul: Iterable[str] = (),
             buffer_type: Optional[int] = None) -> Dict[str, Any]:
        """Create the named tensors (a second call replaces the first's). `matmul`: those used
        as the first operand of a matrix product (candidates for the repack buffer).
        `buffer_type`: a device's (a GPU's), into whose one buffer every tensor is copied from
        the map, its pages dropped as it goes; None: the tensors stay in the map (the CPU)."""
        gg = self._gg
        names = list(dict.fromkeys(names))
        missing = [n for n in names if n not in self.infos]
        if missing:
            raise CheckpointError("%s: GGUF has no tensor %s" % (self.path, ", ".join(missing[:5])))
        self.free()
        ctx = self._ctx = lib.Context(len(names) + 8)
        made: Dict[str, Any] = {}
        for name in names:
            info = self.infos[name]
            dims = [int(d) for d in info.shape] + [1] * (4 - len(info.shape))
            t = gg.ggml_new_tensor_4d(ctx.ptr, int(info.tensor_type), dims[0], dims[1], dims[2], dims[3])
            if gg.ggml_nbytes(t) != info.n_bytes:
                raise CheckpointError("%s: tensor %s holds %d bytes, its type and shape need %d"
                                      % (self.path, name, info.n_bytes, gg.ggml_nbytes(t)))
            gg.ggml_set_name(t, name.encode()[:63])
            made[name] = t
        if buffer_type is not None:
            self._copy_into(buffer_type, made)
            self.repacked, self.tensors = [], made
            return made
        matmul = set(matmul) & set(names)
        repack = self._repack_buffer_type() if self.repack else None
        packed = [n for n in names if n in matmul and repack is not None and self._repacks(made[n], repack)]
        mapped = [n for n in names if n not in packed]
        if mapped:
            start = min(self.infos[n].data_offset for n in mapped)
            end = max(self.infos[n].data_offset + self.infos[n].n_bytes for n in mapped)
            page = 4096
            start -= start % page
            buf = gg.ggml_backend_cpu_buffer_from_ptr(self._base + start, end - start)
            if not buf:
                raise MemoryError("ggml could not wrap %s's map" % self.path)
            self._buffers.append(buf)
            gg.ggml_backend_buffer_set_usage(buf, gg.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
            for n in mapped:
                status = gg.ggml_backend_tensor_alloc(buf, made[n], self._base + self.infos[n].data_offset)
                if status != 0:
                    raise RuntimeError("ggml_backend_tensor_alloc failed for %s (status %d)" % (n, status))
        if packed:
            size = sum(self._gg.ggml_backend_buft_get_alloc_size(repack, made[n]) + 64 for n in packed)
            buf = gg.ggml_backend_buft_alloc_buffer(repack, size)
            if not buf:
                raise MemoryError("ggml could not allocate %d bytes for repacked weights" % size)
            self._buffers.append(buf)
            gg.ggml_backend_buffer_set_usage(buf, gg.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
            base = gg.ggml_backend_buffer_get_base(buf)
            align = gg.ggml_backend_buft_get_alignment(repack)
            offset = 0
            for n in packed:
                t = made[n]
                gg.ggml_backend_tensor_alloc(buf, t, base + offset)
                # set_tensor repacks as it copies; the map's pages are read once, then dropped
                gg.ggml_backend_tensor_set(t, self._base + self.infos[n].data_offset, 0, self.infos[n].n_bytes)
                self.reader.drop_pages(self.infos[n])
                offset += gg.ggml_backend_buft_get_alloc_size(repack, t)
                offset += (-offset) % align
        self.repacked = packed
        self.tensors = made
        return made

    def _copy_into(self, buffer_type: int, made: Dict[str, Any]) -> None:
        """Every tensor (of this object's context) in one new buffer of `buffer_type`, its bytes
        copied from the map, whose pages are dropped once read: on a GPU the host keeps none."""
        gg = self._gg
        assert self._ctx is not None
        buf = gg.ggml_backend_alloc_ctx_tensors_from_buft(self._ctx.ptr, buffer_type)
        if not buf:
            raise MemoryError("%s: ggml could not allocate %d bytes of weights on its device"
                              % (self.path, sum(self.infos[n].n_bytes for n in made)))
        self._buffers.append(buf)
        gg.ggml_backend_buffer_set_usage(buf, gg.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        for n, t in made.items():
            info = self.infos[n]
            gg.ggml_backend_tensor_set(t, self._base + info.data_offset, 0, info.n_bytes)
            self.reader.drop_pages(info)

    def _repack_buffer_type(self) -> Optional[int]:
        for name, buft in lib.extra_buffer_types():
            if name == "CPU_REPACK":
                return buft
        return None

    def _repacks(self, w: Any, buft: int) -> bool:
        """Whether ggml's CPU device runs a matrix product with `w` held in `buft` (llama.cpp's
        weight_buft_supported: a dummy buffer of that type, then supports_op)."""
        gg = self._gg
        probe = lib.Context(4)
        b = gg.ggml_new_tensor_4d(probe.ptr, lib.F32, w.contents.ne[0], MATMUL_ROWS_PROBE, w.contents.ne[2],
                                  w.contents.ne[3])
        op = gg.ggml_mul_mat(probe.ptr, w, b)
        dummy = gg.ggml_backend_buft_alloc_buffer(buft, 0)
        w.contents.buffer = dummy
        try:
            return bool(gg.ggml_backend_dev_supports_op(lib.cpu_device(), op))
        finally:
            w.contents.buffer = None
            gg.ggml_backend_buffer_free(dummy)
            probe.free()

    @property
    def nbytes(self) -> int:
        """Bytes of the loaded tensors as stored."""
        return sum(self.infos[n].n_bytes for n in self.tensors)

    def free(self) -> None:
        gg = self._gg
        for buf in self._buffers:
            gg.ggml_backend_buffer_free(buf)
        self._buffers = []
        self.tensors = {}
        if self._ctx is not None:
            self._ctx.free()
            self._ctx = None
