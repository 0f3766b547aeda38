"""GGUF headers that claim more than their file holds are refused before any reader allocates.

A 64-byte file whose metadata array claimed 2^40 items made gguf's reader allocate until the
OOM killer came: `mdi-prepare` hung, and as an adapter it grew the starter by 1.3 GB. Every lie
below is refused by mdi.model.files.gguf_layout in a fraction of a second, naming the file, through
every door a GGUF comes in by (model, tokenizer, LoRA adapter, mdi-prepare); real GGUF files
pass.
"""
import os
import struct
import subprocess
import time

import pytest

from conftest import BIN, tiny_config
from mdi.model.adapters.adapter_files import load_gguf_lora
from mdi.model.adapters.lora import AdapterError
from mdi.model.files.gguf import read_gguf
from mdi.model.files.gguf_layout import GGUFLayoutError, open_reader
from mdi.model.files.tokenizer_import import tokenizer_from_gguf
from mdi.model.layout import CheckpointError
from mdi.model.tokenizers import TokenizerError
from test_quant import _write_llama_gguf

STRING, ARRAY, UINT32 = 8, 9, 4


def string(text):
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def gguf(kv=b"", n_kv=0, tensors=b"", n_tensors=0, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kv + tensors


def nested(depth):
    """An array of arrays `depth` deep, each holding the next (one item)."""
    body = struct.pack("<IQ", UINT32, 0)
    for _ in range(depth):
        body = struct.pack("<IQ", ARRAY, 1) + body
    return string("deep") + struct.pack("<I", ARRAY) + body


def tensor_info(offset, name="w", n=32, f32=0):
    return string(name) + struct.pack("<IQIQ", 1, n, f32, offset)


HOSTILE = {
    "array of 2^40 strings": (gguf(string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 1 << 40), 1),
                              "claims 1099511627776 items"),
    "array of 2^40 u32": (gguf(string("tokenizer.ggml.token_type") + struct.pack("<IIQ", ARRAY, UINT32, 1 << 40), 1),
                          "claims 1099511627776 items"),
    "key of 2^40 bytes": (gguf(struct.pack("<Q", 1 << 40) + b"k" * 16, 1), "claims 1099511627776 items"),
    "2^40 metadata entries": (gguf(n_kv=1 << 40), "claims 1099511627776 items"),
    "2^40 tensors": (gguf(n_tensors=1 << 40), "1099511627776 tensors claimed"),
    "1000 dimensions": (gguf(tensors=string("w") + struct.pack("<I", 1000) + b"\0" * 64, n_tensors=1), "1000 dimensions"),
    "arrays 100 deep": (gguf(nested(100), 1), "nests arrays"),
    "unknown value type": (gguf(string("k") + struct.pack("<I", 77) + b"\0" * 8, 1), "unknown value type 77"),
    "a token runs past the file": (gguf(string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 2)
                                        + string("a") + struct.pack("<Q", 1 << 40) + b"x" * 8, 1),
                                   "runs past the end of the file"),
    "the file ends in a token's length": (gguf(string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 2)
                                               + string("x" * 10), 1), "the file ends inside"),
    "truncated string": (gguf(string("general.name") + struct.pack("<IQ", STRING, 5) + b"ab", 1), "claims 5 items"),
    "version 99": (gguf(version=99), "version"),
    # a tensor whose data offset breaks the alignment every GGUF reader relies on
    "misaligned offset": (gguf(tensors=tensor_info(offset=3), n_tensors=1) + b"\0" * 64, "not a multiple of the alignment 32"),
    "offset past the end": (gguf(tensors=tensor_info(offset=1 << 40), n_tensors=1), "past the end of the file"),
    "alignment 0": (gguf(string("general.alignment") + struct.pack("<II", UINT32, 0), 1), "not a power of two"),
    "alignment 24": (gguf(string("general.alignment") + struct.pack("<II", UINT32, 24), 1), "not a power of two"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_header_claiming_more_than_its_file_is_refused_at_once(tmp_path, case):
    data, needle = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    t0 = time.monotonic()
    with pytest.raises(GGUFLayoutError) as e:
        open_reader(str(path))
    assert time.monotonic() - t0 < 5  # a walk, not an allocation
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)


@pytest.mark.parametrize("version", [1, 4, 99])
@pytest.mark.parametrize("order", ["<", ">"])
def test_an_unread_version_is_named_as_the_file_holds_it(tmp_path, version, order):
    """Not the value of the other byte order's reading (version 4 byte-swapped is 67108864)."""
    path = tmp_path / "v.gguf"
    path.write_bytes(b"GGUF" + struct.pack(order + "IQQ", version, 0, 0))
    with pytest.raises(GGUFLayoutError) as e:
        open_reader(str(path))
    assert "GGUF version %d is not read (2 and 3 are" % version in str(e.value), str(e.value)


def test_every_door_refuses_it_in_one_line(tmp_path):
    path = tmp_path / "lora.gguf"
    path.write_bytes(HOSTILE["array of 2^40 strings"][0])
    for call, error in ((lambda: read_gguf(str(path)), CheckpointError),
                        (lambda: tokenizer_from_gguf(str(path)), TokenizerError),
                        (lambda: load_gguf_lora(str(path), tiny_config("llama")), AdapterError)):
        with pytest.raises(error) as e:
            call()
        assert "claims 1099511627776 items" in str(e.value) and "\n" not in str(e.value)
    r = subprocess.run([os.path.join(BIN, "mdi-prepare"), str(path), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "claims 1099511627776 items" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_real_gguf_files_pass(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    _write_llama_gguf(path, {"attn_q": "Q8_0", "ffn_down": "Q4_1"})
    f = open_reader(path)
    n_tensors, n_kv = len(f.tensors), len(f.keys())
    assert n_tensors > 0 and n_kv > 0
    read_gguf(path)  # and the reader after it
    try:
        from mdi.model.files.gguf import packaged_gguf_path
        packaged = packaged_gguf_path()
    except Exception:  # noqa: BLE001 - the default model's package is not installed here
        return
    f = open_reader(packaged)
    assert (len(f.tensors), len(f.keys())) == (272, 33)  # SmolLM2-135M Q4_1: 272 tensors, 33 metadata keys


@pytest.mark.parametrize("declared, second_offset, needle", [
    (0, 256, "tensor b has offset 256, expected 128: where the tensor before it, a (F32 [32]), ends"),  # a gap
    (1, 128, "tensor b has offset 128, expected 64: where the tensor before it, a (F16 [32]), ends"),  # relabelled
])
def test_tensors_that_do_not_follow_one_another_are_refused_as_llama_cpp_refuses_them(tmp_path, declared,
                                                                                       second_offset, needle):
    """A GGUF whose tensor was relabelled (a Q4_1 read as Q4_0) loaded, computed NaN for every
    logit and exited 0; gguf_init_from_file refuses a file whose tensors do not sit one after
    another, each where the ones before it end (padded to the alignment)."""
    infos = tensor_info(0, name="a", f32=declared) + tensor_info(second_offset, name="b")
    path = tmp_path / "gap.gguf"
    path.write_bytes(gguf(tensors=infos, n_tensors=2).ljust(2048, b"\0"))
    with pytest.raises(GGUFLayoutError) as e:
        open_reader(str(path))
    assert needle in str(e.value) and str(path) in str(e.value), str(e.value)


def test_values_and_tensors_read_as_ggufs_own_reader_reads_them(tmp_path):
    """mdi reads a GGUF lazily (gguf_layout.GGUFFile: gguf's reader built objects for every
    vocabulary item, ~170 MB and seconds per open); every value and tensor must come back as
    gguf's reader gives them, big-endian files included."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    for endian in ("little", "big"):
        from gguf import GGUFEndian
        path = str(tmp_path / ("values-%s.gguf" % endian))
        w = GGUFWriter(path, "llama", endianess=GGUFEndian.LITTLE if endian == "little" else GGUFEndian.BIG)
        w.add_uint32("a.u32", 7)
        w.add_int64("a.i64", -5)
        w.add_float32("a.f32", 0.25)
        w.add_bool("a.bool", True)
        w.add_string("a.text", "héllo")
        w.add_array("a.strings", ["x", "", "ü" * 3])
        w.add_array("a.ints", [1, -2, 3])
        w.add_array("a.floats", [0.5, 1.5])
        w.add_array("a.bools", [True, False])
        rng = np.random.default_rng(0)
        w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
        w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
        q = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
        w.add_tensor("q8", q, raw_dtype=GGMLQuantizationType.Q8_0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        theirs, ours = GGUFReader(path), open_reader(path)
        for key, field in theirs.fields.items():
            if not key.startswith("GGUF."):  # the reader's own header fields
                assert ours.value(key) == field.contents(), (endian, key)
        assert ours.value("missing", "default") == "default"
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors):
            assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape)
            assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data), (endian, a.name)


def test_a_lora_header_listing_more_tensors_than_its_base_has_layers_is_refused_before_reading_them(tmp_path):
    # 200k tensor records cost the starter 12-15 s of CPU to read: a LoRA for a 4-layer base
    # holds at most an A and a B per linear layer of each block
    records = b"".join(tensor_info(offset=0, name="blk.%d.attn_q.weight.lora_a" % i) for i in range(20000))
    path = tmp_path / "many.gguf"
    path.write_bytes(gguf(tensors=records, n_tensors=20000) + b"\0" * 64)
    t0 = time.monotonic()
    with pytest.raises(AdapterError) as e:
        load_gguf_lora(str(path), tiny_config("llama"))
    assert "20000 tensors, more than the" in str(e.value) and time.monotonic() - t0 < 5


def test_a_chunk_that_consumes_a_ggufs_weights_leaves_them_readable_again(tmp_path, monkeypatch):
    """A one-node run holds a GGUF's weights once: the starter's chunk takes them out of the
    source (ModelSource.load_chunk consume=True); a later ask (a worker push after a recovery)
    reads the file again and gets the same weights."""
    import torch
    from mdi.model import source as source_module
    from mdi.model.source import ModelSource
    monkeypatch.setattr(source_module, "_raw_tokenizer", lambda path: None)  # the tiny file has none
    path = str(tmp_path / "tiny.gguf")
    _write_llama_gguf(path, {"attn_q": "Q8_0", "ffn_down": "Q4_1"})
    source, fresh = ModelSource(path), ModelSource(path)
    n = source.config.n_layer
    quant = source.layout(0, n, True, "auto")
    chunk = source.load_chunk(0, n, True, True, torch.float32, "cpu", None, quant, consume=True)
    assert not source._full  # every weight went into the chunk
    again = source.weights(0, n, False, False, torch.float32, quant)
    want = fresh.weights(0, n, False, False, torch.float32, quant)
    assert sorted(again) == sorted(want) and all(torch.equal(again[k], want[k]) for k in want)
    assert chunk.n_layers == n
