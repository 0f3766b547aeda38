"""A GGUF file's header checked against the file's own size before any reader believes it.

The `gguf` package's reader allocates what the header's counts claim: a 64-byte file whose
metadata array claims 2^40 items made it allocate until the OOM killer came (`mdi-prepare`
hung; loaded as an adapter, the starter grew 1.3 GB and never answered). Here the header is
walked first with every count, length and dimension bounded by the bytes left in the file,
nothing allocated but the walk's own position: a lie is a one-line error naming the file and
what was claimed. Every GGUF mdi opens (models, tokenizers, adapters) goes through
`open_reader`.

Layout (GGUF v2 / v3, llama.cpp's gguf.md): magic "GGUF", version u32, tensor count u64,
metadata count u64; each metadata entry a string key, a u32 value type and the value (an
array: u32 item type, u64 count, items); each tensor a string name, u32 dims, u64 per dim, u32
type, u64 offset. A string is a u64 length and its bytes.
"""
import mmap
import struct
from typing import Any, Tuple

STRING, ARRAY = 8, 9
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8  # arrays of arrays: deeper is no model's metadata
TENSOR_INFO_MIN = 8 + 4 + 4 + 8  # an empty name, no dims, type, offset


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

    def count(self, what: str, item_bytes: int) -> int:
        """A u64 count of items of at least `item_bytes` each, bounded by the bytes left."""
        n = self.read("Q", what)
        if n * max(1, item_bytes) > self.left():
            raise self.fail("%s claims %d items of %d+ bytes, more than the %d bytes left"
                            % (what, n, item_bytes, self.left()))
        return n

    def skip_string(self, what: str) -> None:
        n = self.count(what, 1)  # read before adding: `pos += count()` would add to the old pos
        self.pos += n

    def skip_value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in FIXED_SIZES:
            if FIXED_SIZES[vtype] > self.left():
                raise self.fail("the file ends inside %s" % what)
            self.pos += FIXED_SIZES[vtype]
        elif vtype == STRING:
            self.skip_string(what)
        elif vtype == ARRAY:
            if depth >= MAX_NESTING:
                raise self.fail("%s nests arrays more than %d deep" % (what, MAX_NESTING))
            item = self.read("I", what + "'s item type")
            if item in FIXED_SIZES:
                n = self.count(what, FIXED_SIZES[item])
                self.pos += n * FIXED_SIZES[item]
            elif item in (STRING, ARRAY):
                for _ in range(self.count(what, 8)):  # every string or array starts with 8+ bytes
                    self.skip_value(item, what, depth + 1)
            else:
                raise self.fail("%s has unknown item type %d" % (what, item))
        else:
            raise self.fail("%s has unknown value type %d" % (what, vtype))

    def key(self) -> str:
        n = self.count("a metadata key", 1)
        key = bytes(self.buf[self.pos:self.pos + min(n, 200)]).decode("utf-8", "replace")
        self.pos += n
        return key


def check_layout(path: str) -> Tuple[int, int]:
    """(tensor count, metadata count) of the GGUF file at `path` once its header has been
    walked within the file's bytes; GGUFLayoutError (a ValueError) naming the file otherwise."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFLayoutError("%s: not a GGUF file (%d bytes)" % (path, size))
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            walk = _Walk(buf, size, path)
            if bytes(buf[:4]) != b"GGUF":
                raise GGUFLayoutError("%s: not a GGUF file (no GGUF magic)" % path)
            walk.pos = 4
            version = walk.read("I", "the version")
            if version not in (2, 3):
                walk.order = ">"  # a big-endian file reads its version byte-swapped
                walk.pos = 4
                version = walk.read("I", "the version")
                if version not in (2, 3):
                    raise GGUFLayoutError("%s: GGUF version %d is not read (2 and 3 are)" % (path, version))
            n_tensors = walk.read("Q", "the tensor count")
            n_kv = walk.count("the metadata count", 8 + 4)
            for _ in range(n_kv):
                key = walk.key()
                walk.skip_value(walk.read("I", "the type of %r" % key), "metadata %r" % key)
            if n_tensors * TENSOR_INFO_MIN > walk.left():
                raise walk.fail("%d tensors claimed, more than the %d bytes left hold" % (n_tensors, walk.left()))
            for i in range(n_tensors):
                walk.skip_string("tensor %d's name" % i)
                dims = walk.read("I", "tensor %d's dimensions" % i)
                if dims > MAX_DIMS:
                    raise walk.fail("tensor %d claims %d dimensions (at most %d)" % (i, dims, MAX_DIMS))
                for _ in range(dims):
                    walk.read("Q", "tensor %d's shape" % i)
                walk.read("I", "tensor %d's type" % i)
                walk.read("Q", "tensor %d's offset" % i)
            return n_tensors, n_kv


def open_reader(path: str) -> Any:
    """gguf's GGUFReader over `path`, once check_layout found its header within the file."""
    from gguf import GGUFReader
    check_layout(path)
    return GGUFReader(path)
