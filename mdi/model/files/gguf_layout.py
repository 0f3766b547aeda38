"""A GGUF file's header checked against the file's own size before any reader believes it.

The `gguf` package's reader allocates what the header's counts claim: a 64-byte file whose
metadata array claims 2^40 items made it allocate until the OOM killer came (`mdi-prepare`
hung; loaded as an adapter, the starter grew 1.3 GB and never answered). Here the header is
walked first with every count, length and dimension bounded by the bytes left in the file,
nothing allocated but the walk's own position: a lie is a one-line error naming the file and
what was claimed. Every GGUF mdi opens (models, tokenizers, adapters) goes through
`open_reader`, whose `GGUFFile` then reads values and tensors lazily from the positions the
walk recorded (it says why it is not gguf's reader).

Layout (GGUF v2 / v3, llama.cpp's gguf.md): magic "GGUF", version u32, tensor count u64,
metadata count u64; each metadata entry a string key, a u32 value type and the value (an
array: u32 item type, u64 count, items); each tensor a string name, u32 dims, u64 per dim, u32
type, u64 offset. A string is a u64 length and its bytes.
"""
import mmap
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

STRING, ARRAY = 8, 9
# value type -> struct format: u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
FIXED_SIZES = {vtype: struct.calcsize("<" + fmt) for vtype, fmt in SCALAR_FORMATS.items()}  # value type -> bytes
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: deeper is no model's metadata
TENSOR_INFO_MIN = 8 + 4 + 4 + 8  # an empty name, no dims, type, offset
ALIGNMENT_KEY, DEFAULT_ALIGNMENT, U32 = "general.alignment", 32, 4


class GGUFLayoutError(ValueError):
    """The header claims more than the file holds, or is not GGUF v2/v3."""


class _Walk:
    def __init__(self, buf: Any, size: int, path: str) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0
        self.order = "<"

    def left(self) -> int:
        return self.size - self.pos

    def fail(self, what: str) -> GGUFLayoutError:
        return GGUFLayoutError("%s: not a valid GGUF file: %s (at byte %d of %d)" % (self.path, what, self.pos, self.size))

    def read(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        if n > self.left():
            raise self.fail("the file ends inside %s" % what)
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def read_many(self, fmt: str, n: int, what: str) -> Tuple[int, ...]:
        size = struct.calcsize(self.order + fmt) * n
        if size > self.left():
            raise self.fail("the file ends inside %s" % what)
        values = struct.unpack_from("%s%d%s" % (self.order, n, fmt), self.buf, self.pos)
        self.pos += size
        return values

    def count(self, what: str, item_bytes: int) -> int:
        """A u64 count of items of at least `item_bytes` each, bounded by the bytes left."""
        n = self.read("Q", what)
        if n * max(1, item_bytes) > self.left():
            raise self.fail("%s claims %d items of %d+ bytes, more than the %d bytes left"
                            % (what, n, item_bytes, self.left()))
        return n

    def string_bytes(self, what: str, keep: Optional[int] = None) -> bytes:
        """A string's bytes (its first `keep` of them), the walk past all of them."""
        n = self.count(what, 1)  # read before adding: `pos += count()` would add to the old pos
        text = bytes(self.buf[self.pos:self.pos + (n if keep is None else min(n, keep))])
        self.pos += n
        return text

    def strings(self, n: int, what: str, keep: bool) -> List[bytes]:
        """`n` strings in a row (an array's items: a vocabulary's 50k-250k tokens and merges),
        in one tight loop; their bytes when `keep`, else [] and the walk past them."""
        buf, pos, size = self.buf, self.pos, self.size
        length_at = struct.Struct(self.order + "Q").unpack_from
        out = []
        for _ in range(n):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail("the file ends inside %s" % what)
            (length,) = length_at(buf, pos)
            pos += 8
            if pos + length > size:  # before its bytes are copied: a hostile length would copy the file
                self.pos = pos
                raise self.fail("%s: a string runs past the end of the file" % what)
            if keep:
                out.append(bytes(buf[pos:pos + length]))
            pos += length
        self.pos = pos
        return out

    def skip_value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in FIXED_SIZES:
            if FIXED_SIZES[vtype] > self.left():
                raise self.fail("the file ends inside %s" % what)
            self.pos += FIXED_SIZES[vtype]
        elif vtype == STRING:
            self.string_bytes(what, keep=0)
        elif vtype == ARRAY:
            if depth >= MAX_NESTING:
                raise self.fail("%s nests arrays more than %d deep" % (what, MAX_NESTING))
            item = self.read("I", what + "'s item type")
            if item in FIXED_SIZES:
                n = self.count(what, FIXED_SIZES[item])
                self.pos += n * FIXED_SIZES[item]
            elif item == STRING:
                self.strings(self.count(what, 8), what, keep=False)
            elif item == ARRAY:
                for _ in range(self.count(what, 8)):  # every array starts with 8+ bytes
                    self.skip_value(item, what, depth + 1)
            else:
                raise self.fail("%s has unknown item type %d" % (what, item))
        else:
            raise self.fail("%s has unknown value type %d" % (what, vtype))

    def key(self) -> str:
        return self.string_bytes("a metadata key", keep=200).decode("utf-8", "replace")


@dataclass
class Header:
    """What the walk found: where each metadata value starts, and each tensor's record."""
    order: str  # "<" or ">": the file's byte order
    values: Dict[str, Tuple[int, int]]  # key -> (value type, position of the value)
    tensors: List[Tuple[str, Tuple[int, ...], int, int]]  # (name, dims innermost first, ggml type, offset)
    data_start: int
    alignment: int = 32


GGUF_MAGIC = b"GGUF"  # a GGUF file's first 4 bytes


def is_gguf(path: str) -> bool:
    """Whether `path` starts as a GGUF does (for an error that names what a file is)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _walk_header(buf: Any, size: int, path: str, max_tensors: Optional[int] = None) -> Header:
    walk = _Walk(buf, size, path)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFLayoutError("%s: not a GGUF file (no GGUF magic)" % path)
    walk.pos = 4
    version = walk.read("I", "the version")
    if version not in (2, 3):
        walk.order = ">"  # a big-endian file reads its version byte-swapped
        walk.pos = 4
        swapped = walk.read("I", "the version")
        if swapped not in (2, 3):
            # a version is small: the smaller reading is the file's (4, not 67108864 byte-swapped)
            raise GGUFLayoutError("%s: GGUF version %d is not read (2 and 3 are, either byte order)"
                                  % (path, min(version, swapped)))
    n_tensors = walk.read("Q", "the tensor count")
    if max_tensors is not None and n_tensors > max_tensors:
        raise GGUFLayoutError("%s: %d tensors, more than the %d such a file can hold" % (path, n_tensors, max_tensors))
    n_kv = walk.count("the metadata count", 8 + 4)
    values: Dict[str, Tuple[int, int]] = {}
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = walk.key()
        vtype = walk.read("I", "the type of %r" % key)
        values.setdefault(key, (vtype, walk.pos))
        if key == ALIGNMENT_KEY and vtype == U32:
            alignment = walk.read("I", ALIGNMENT_KEY)
            if alignment == 0 or alignment & (alignment - 1):
                raise walk.fail("%s is %d, not a power of two" % (ALIGNMENT_KEY, alignment))
        else:
            walk.skip_value(vtype, "metadata %r" % key)
    if n_tensors * TENSOR_INFO_MIN > walk.left():
        raise walk.fail("%d tensors claimed, more than the %d bytes left hold" % (n_tensors, walk.left()))
    tensors = []
    for i in range(n_tensors):
        name = walk.string_bytes("tensor %d's name" % i).decode("utf-8", "replace")
        n_dims = walk.read("I", "tensor %d's dimensions" % i)
        if n_dims > MAX_DIMS:
            raise walk.fail("tensor %d claims %d dimensions (at most %d)" % (i, n_dims, MAX_DIMS))
        dims = walk.read_many("Q", n_dims, "tensor %d's shape" % i)
        ggml_type, offset = walk.read_many("IQ", 1, "tensor %d's type and offset" % i)
        tensors.append((name, dims, ggml_type, offset))
    # Data starts at the next multiple of the alignment; each tensor's offset within it is a
    # multiple too (what llama.cpp requires) and inside the file.
    data_start = -(-walk.pos // alignment) * alignment
    for i, (_, _, _, offset) in enumerate(tensors):
        if offset % alignment:
            raise walk.fail("tensor %d's offset %d is not a multiple of the alignment %d" % (i, offset, alignment))
        if data_start + offset > size:
            raise walk.fail("tensor %d's offset %d is past the end of the file" % (i, offset))
    return Header(walk.order, values, tensors, data_start, alignment)


def _file_size(f: Any, path: str) -> int:
    size = f.seek(0, 2)
    if size < 24:
        raise GGUFLayoutError("%s: not a GGUF file (%d bytes)" % (path, size))
    return size


class GGUFTensor:
    """One tensor as gguf's reader presents it: `data` a read-only view of the file, float and
    integer types as their own dtype in torch's order, quantized ones as uint8 rows of blocks
    (made when first asked for: a LoRA header may list 200k tensors)."""
    __slots__ = ("name", "tensor_type", "shape", "_bytes", "_start", "_n_bytes", "_view", "_data")

    def __init__(self, name: str, tensor_type: Any, shape: Tuple[int, ...], file_bytes: Any, start: int,
                 n_bytes: int, view: Tuple[str, Tuple[int, ...]]) -> None:
        self.name, self.tensor_type, self.shape = name, tensor_type, shape  # shape: GGUF's order, innermost first
        # the file's bytes, not the GGUFFile: a cycle would keep the whole map (and its pages,
        # counted as resident) until the cyclic collector ran, after the model's load
        self._bytes, self._start, self._n_bytes, self._view = file_bytes, start, n_bytes, view
        self._data: Any = None

    @property
    def data_offset(self) -> int:
        """Where its bytes start in the file (gguf's ReaderTensor's name)."""
        return self._start

    @property
    def n_bytes(self) -> int:
        return self._n_bytes

    @property
    def dims(self) -> Tuple[int, ...]:
        """Its shape outermost first, as torch and numpy order it ([out, in] for a matrix)."""
        return tuple(int(x) for x in reversed(self.shape))

    def values(self) -> Any:
        """Its values as a numpy array of `dims`, gguf's own dequantizer undoing a quantized
        type's blocks (float types come back as a read-only view of the file). gguf raises
        NotImplementedError, ValueError or KeyError for a type it cannot read."""
        from gguf.quants import dequantize
        return dequantize(self.data, self.tensor_type).reshape(self.dims)

    @property
    def data(self) -> Any:
        if self._data is None:
            import numpy as np
            dtype, shape = self._view
            raw = self._bytes[self._start:self._start + self._n_bytes]
            self._data = raw.view(np.dtype(dtype)).reshape(shape)
        return self._data


def _expected_at(previous: Optional[Tuple[str, str, Tuple[int, ...]]]) -> str:
    """Where a tensor should have started: the data's start, or where the one before it ends."""
    if previous is None:
        return "the data's start"
    name, kind, dims = previous
    return ("where the tensor before it, %s (%s %s), ends: one of them is not the type or shape it says"
            % (name, kind, list(dims)))


class GGUFFile:
    """A GGUF file's metadata and tensors, read lazily from one map of the file.

    gguf's GGUFReader builds numpy objects for every item of every metadata array at open: for
    a 49k-token vocabulary that was ~170 MB of RSS and ~5 s of CPU, paid twice (weights, then
    tokenizer), and the peak of loading a GGUF model. The header walk that bounds the file
    (above) already passes every value, so it records where each one starts, and a value is
    decoded only when asked for. gguf's tables still say what each tensor type's blocks hold."""

    def __init__(self, path: str, max_tensors: Optional[int] = None) -> None:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        with open(path, "rb") as f:
            size = _file_size(f, path)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays open with the arrays on it
        try:
            header = _walk_header(self._map, size, path, max_tensors)
        except BaseException:
            self._map.close()
            raise
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._order, self._values = header.order, header.values
        self.tensors: List[GGUFTensor] = []
        seen: set = set()
        types: Dict[int, Tuple[Any, int, int]] = {}
        expected = 0  # where gguf's reader puts each tensor: right after the one before, padded
        previous: Optional[Tuple[str, str, Tuple[int, ...]]] = None  # (name, type, dims): named on a mismatch
        for name, dims, type_id, offset in header.tensors:
            where = "%s: tensor %s" % (path, name)
            if name in seen:
                raise GGUFLayoutError("%s appears twice" % where)
            seen.add(name)
            if type_id not in types:
                try:
                    ggml_type = GGMLQuantizationType(type_id)
                    block, type_size = GGML_QUANT_SIZES[ggml_type]
                    types[type_id] = (ggml_type, block, type_size)
                except (ValueError, KeyError):
                    raise GGUFLayoutError("%s has unknown tensor type %d" % (where, type_id)) from None
            ggml_type, block, type_size = types[type_id]
            n = 1
            for d in dims:
                n *= d
            shape = dims[::-1]  # torch's order, outermost first
            item = PLAIN_TYPES.get(ggml_type.name)
            if item is None and (not shape or shape[-1] % block):
                raise GGUFLayoutError("%s: a row of %s is not whole blocks of %d" % (where, ggml_type.name, block))
            n_bytes = n * type_size // block
            start = header.data_start + offset
            if start + n_bytes > size:
                raise GGUFLayoutError("%s: its %d bytes run past the end of the file" % (where, n_bytes))
            if offset != expected:  # llama.cpp's gguf_init_from_file refuses such a file too
                raise GGUFLayoutError("%s has offset %d, expected %d: %s"
                                      % (where, offset, expected, _expected_at(previous)))
            expected += -(-n_bytes // header.alignment) * header.alignment
            previous = (name, ggml_type.name, dims)
            view = (self._order + item, shape) if item is not None else \
                ("u1", shape[:-1] + (shape[-1] // block * type_size,))  # quantized: rows of blocks, as bytes
            self.tensors.append(GGUFTensor(name, ggml_type, dims, self.bytes, start, n_bytes, view))
        # The walk read every page of the header (Gemma 3's 262k-token vocabulary: 5 MB), which
        # would stay resident as long as this map: a value asked for later reads its pages again.
        self._drop_range(0, header.data_start)

    def keys(self) -> List[str]:
        return list(self._values)

    def drop_pages(self, tensor: GGUFTensor) -> None:
        """Let the file's pages under `tensor` leave this process's resident set once its values
        are copied out (they stay in the page cache; a later read faults them in again). Every
        page of the map that was read counts in RSS until the map closes: reading a whole GGUF
        model held the file (98 MB for SmolLM2) on top of the weights copied from it, the peak
        of loading one. Nothing where madvise is missing (not Linux / BSD)."""
        self._drop_range(tensor._start, tensor._start + tensor._n_bytes)

    def _drop_range(self, start: int, end: int) -> None:
        advise = getattr(self._map, "madvise", None)
        if advise is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start -= start % mmap.PAGESIZE
        end = min(len(self._map), end)
        if end > start:
            advise(mmap.MADV_DONTNEED, start, end - start)

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as a plain Python value (a list for an array), or `default`."""
        if key not in self._values:
            return default
        vtype, pos = self._values[key]
        walk = _Walk(self._map, len(self._map), self.path)
        walk.order, walk.pos = self._order, pos
        return _read_value(walk, vtype, "metadata %r" % key)


PLAIN_TYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


def _read_value(walk: _Walk, vtype: int, what: str) -> Any:
    """The value at the walk's position (bounded by the walk, as the header check was)."""
    if vtype in SCALAR_FORMATS:
        return walk.read(SCALAR_FORMATS[vtype], what)
    if vtype == STRING:
        try:
            return walk.string_bytes(what).decode("utf-8")
        except UnicodeDecodeError:
            raise walk.fail("%s is not UTF-8 text" % what) from None
    if vtype == ARRAY:
        import numpy as np
        item = walk.read("I", what + "'s item type")
        if item in SCALAR_FORMATS:
            n = walk.count(what, FIXED_SIZES[item])
            fmt = SCALAR_FORMATS[item]
            dtype = np.dtype(walk.order + (fmt if fmt != "?" else "B"))
            values = np.frombuffer(walk.buf, dtype=dtype, count=n, offset=walk.pos).tolist()
            walk.pos += n * FIXED_SIZES[item]
            return [bool(v) for v in values] if fmt == "?" else values
        if item == STRING:
            try:
                return [t.decode("utf-8") for t in walk.strings(walk.count(what, 8), what, keep=True)]
            except UnicodeDecodeError:
                raise walk.fail("%s is not UTF-8 text" % what) from None
        return [_read_value(walk, item, what) for _ in range(walk.count(what, 8))]
    raise walk.fail("%s has unknown value type %d" % (what, vtype))


def open_reader(path: str, max_tensors: Optional[int] = None) -> GGUFFile:
    """The GGUF file at `path`, its header walked within the file before anything is read;
    `max_tensors`: more is refused before a tensor record is read (what a LoRA for the base
    model could hold: a header listing 200k cost the starter seconds)."""
    return GGUFFile(path, max_tensors)
