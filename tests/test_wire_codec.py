"""The data-plane activation codecs (mdi.ring.wire): raw, float16, bfloat16 and blockwise int8
with each row's two largest values apart.
Each round-trips to the activation dtype within its own error, payload sizes follow
payload_nbytes, and malformed payloads, unknown codecs and v1 peers are refused."""
import msgpack
import numpy as np
import pytest
import torch

from mdi.ring import wire

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WIDTHS = (576, 64, 100)  # 100: the last block of each row has 4 values


def prefill(x, kind="prefill"):
    return wire.Frame(kind, 3, [0], [0], [x.shape[0]], x)


def round_trip(frame, codec, **expect):
    header, payload = wire.encode(frame, codec)
    assert len(payload) == wire.payload_nbytes(frame.tensor.shape[0], frame.tensor.shape[1],
                                               frame.tensor.dtype, codec)
    return wire.decode([header, bytes(payload)], **expect)


def int8_bound(x, scales):
    """Per-value error allowed: half the block's stored scale, plus the float16 rounding of the
    scale (the absmax value may clamp at 127 when its scale rounded down), plus float32 slop.
    The outliers (sent as float16) are within their float16 rounding, which this covers too."""
    rows, width = x.shape
    s = scales.float().repeat_interleave(wire.INT8_BLOCK, dim=1)[:, :width]
    return s / 2 + x.float().abs() * (2 ** -11 + 1e-6)


def int8_parts(x):
    return wire.quantize_int8(x)


@pytest.mark.parametrize("codec", wire.CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_each_codec_round_trips_to_the_activation_dtype(codec, dtype, width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(5, width, generator=g) * 3).to(dtype)
    got = round_trip(prefill(x), codec, run=3, hidden=width)
    assert got.tensor.dtype == dtype and got.tensor.shape == (5, width)
    if codec == "raw":
        assert torch.equal(got.tensor, x)
    elif codec in ("float16", "bfloat16"):
        assert torch.equal(got.tensor, x.to(getattr(torch, codec)).to(dtype))
    else:
        p = int8_parts(x)
        assert p.q.dtype == torch.int8 and p.q.shape == (5, width)
        assert p.scales.dtype == torch.float16 and p.scales.shape == (5, -(-width // 32))
        assert p.columns.shape == (5, wire.INT8_OUTLIERS)
        # the outliers are each row's largest magnitudes
        assert torch.equal(x.float().abs().gather(1, p.columns), x.float().abs().topk(2, dim=1).values)
        assert torch.equal(got.tensor, wire.dequantize_int8(p, width, dtype))
        exact = wire.dequantize_int8(p, width, torch.float32)
        assert ((exact - x.float()).abs() <= int8_bound(x, p.scales)).all()


def test_cast_codecs_keep_the_cast_semantics_for_out_of_range_values():
    x = torch.tensor([[1e5, -1e5, 1e-8, 3.14159] * 8])
    for codec in ("float16", "bfloat16"):
        got = round_trip(prefill(x), codec).tensor
        assert torch.equal(got, x.to(getattr(torch, codec)).float())
    assert torch.isinf(round_trip(prefill(x), "float16").tensor[0, 0])  # float16 overflows, as a cast does


@pytest.mark.parametrize("width", WIDTHS)
def test_int8_zero_blocks_are_exact_zeros(width):
    x = torch.randn(4, width)
    x[1] = 0  # a whole zero row
    x[2, 32:64] = 0  # one zero block
    x[3, -(width % 32 or 32):] = 0  # the row's last (possibly short) block
    q, scales = wire.quantize_int8_blocks(x)
    assert (scales[1] == 0).all() and scales[2, 1] == 0 and scales[3, -1] == 0
    got = round_trip(prefill(x), "int8").tensor
    assert (got[1] == 0).all() and (got[2, 32:64] == 0).all() and (got[3, -(width % 32 or 32):] == 0).all()
    assert ((got - x).abs() <= int8_bound(x, int8_parts(x).scales)).all()


def test_int8_rounds_against_the_stored_scale_and_saturates_at_float16s_limit():
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-1, 1, 32)
    x[0, 32] = 1e9  # absmax / 127 beyond float16: the scale clamps to 65504 instead of inf
    q, scales = wire.quantize_int8_blocks(x)
    assert int(q.abs().max()) == 127 and torch.isfinite(scales).all()
    assert wire.dequantize_int8_blocks(q, scales, 64)[0, 32] == 127 * 65504
    got = round_trip(prefill(x), "int8").tensor
    # As an outlier of its row the value goes as float16: it saturates at float16's largest.
    assert torch.isfinite(got).all() and got[0, 32] == 65504
    assert ((got[:, :32] - x[:, :32]).abs() <= int8_bound(x, int8_parts(x).scales)[:, :32]).all()


def test_int8_keeps_a_massive_activation_from_flattening_its_block():
    x = torch.randn(1, 64)
    x[0, 5] = 3000.0  # a "massive" channel, as real residual streams have
    got = round_trip(prefill(x), "int8").tensor
    assert abs(got[0, 5].item() - 3000.0) <= 2.0  # float16 rounding
    # Its block's scale is set by the values that stay in the block, not by the row's outliers
    # (which of its neighbours are outliers too depends on the random values: the row's largest).
    parts = int8_parts(x)
    kept = x[0, :32].clone()
    kept[[c for c in parts.columns[0].tolist() if c < 32]] = 0
    assert 5 in parts.columns[0].tolist()
    assert float(parts.scales[0, 0]) <= float(kept.abs().max()) / 127 * (1 + 2 ** -10)
    assert ((got - x).abs()[0, :32] <= int8_bound(x, parts.scales)[0, :32]).all()


def test_int8_quantize_does_not_touch_its_input():
    x = torch.randn(2, 100)
    before = x.clone()
    wire.quantize_int8_blocks(x)
    wire.quantize_int8_blocks(x[:, 10:])  # a non-contiguous view too
    wire.quantize_int8(x)
    wire.quantize_int8(x[:, 10:])
    assert torch.equal(x, before)


def test_int8_payload_layout_is_values_scales_columns_outliers():
    x = torch.randn(3, 100)
    p = int8_parts(x)
    payload = bytes(wire.encode(prefill(x), "int8")[1])
    assert payload[:300] == p.q.numpy().tobytes()
    assert payload[300:324] == p.scales.numpy().tobytes()
    assert payload[324:336] == p.columns.to(torch.int16).numpy().tobytes()
    assert payload[336:] == p.values.numpy().tobytes() and len(payload) == 300 + 3 * 4 * 2 + 3 * 2 * 4


def test_int8_outlier_columns_outside_the_row_are_refused():
    x = torch.randn(2, 64)
    header, payload = wire.encode(prefill(x), "int8")
    body = bytearray(payload)
    at = 128 + 2 * 2 * 2  # past the values and the scales: the first outlier's column
    body[at:at + 2] = (64).to_bytes(2, "little", signed=True)
    with pytest.raises(wire.FrameError, match="outlier column"):
        wire.decode([header, bytes(body)])
    body[at:at + 2] = (-1).to_bytes(2, "little", signed=True)
    with pytest.raises(wire.FrameError, match="outlier column"):
        wire.decode([header, bytes(body)])


def test_decode_hop_payload_shrinks_to_about_a_quarter_with_int8():
    x = torch.randn(1, 576)
    frame = wire.Frame("decode", 3, [0], [17], [1], x)
    sizes = {c: len(wire.encode(frame, c)[1]) for c in wire.CODECS}
    assert sizes == {"raw": 2304, "float16": 1152, "bfloat16": 1152, "int8": 576 + 18 * 2 + 2 * 4}
    assert sizes["int8"] / sizes["raw"] <= 0.27


def test_payload_nbytes():
    assert wire.payload_nbytes(2, 100, torch.float32, "raw") == 800
    assert wire.payload_nbytes(2, 100, "bfloat16", "raw") == 400
    assert wire.payload_nbytes(2, 100, torch.float32, "float16") == 400
    assert wire.payload_nbytes(2, 100, torch.float16, "int8") == 200 + 2 * 4 * 2 + 2 * 2 * 4
    assert wire.payload_nbytes(1, 32, torch.float32, "int8") == 32 + 2 + 2 * 4
    assert wire.payload_nbytes(1, 1, torch.float32, "int8") == 1 + 2 + 4  # one value: one outlier
    with pytest.raises(wire.FrameError, match="at most 32767"):
        wire.payload_nbytes(1, 40000, torch.float32, "int8")
    with pytest.raises(wire.FrameError, match="unknown codec 'int4'"):
        wire.payload_nbytes(1, 32, torch.float32, "int4")
    with pytest.raises(wire.FrameError, match="needs a float dtype"):
        wire.payload_nbytes(1, 32, torch.int32, "int8")


def test_raw_stays_zero_copy_both_ways():
    x = torch.randn(2, 64)
    header, payload = wire.encode(prefill(x), "raw")
    assert torch.frombuffer(payload, dtype=torch.uint8).data_ptr() == x.data_ptr()
    buf = bytearray(payload)
    got = wire.decode([header, buf])
    assert got.tensor.data_ptr() == torch.frombuffer(buf, dtype=torch.uint8).data_ptr()


def test_a_ggml_starters_passes_decode_to_numpy_with_torch_loaded():
    """`host_kinds`: a ggml starter's generation passes come back as numpy arrays (its head takes
    them as they are), zero-copy from a numpy array's bytes; other kinds still decode to torch
    where torch is loaded, and numpy and torch rows encode to the same bytes."""
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    header, payload = wire.encode(prefill(x), "raw")
    assert np.frombuffer(payload, dtype=np.uint8).ctypes.data == x.ctypes.data
    assert bytes(payload) == bytes(wire.encode(prefill(torch.from_numpy(x)), "raw")[1])
    buf = bytearray(payload)
    got = wire.decode([header, buf], host_kinds=wire.GENERATION_KINDS)
    assert isinstance(got.tensor, np.ndarray) and np.array_equal(got.tensor, x)
    assert got.tensor.ctypes.data == np.frombuffer(buf, dtype=np.uint8).ctypes.data
    assert isinstance(wire.decode([header, buf]).tensor, torch.Tensor)
    score_header, _ = wire.encode(prefill(x, "score"), "raw")
    assert isinstance(wire.decode([score_header, buf], host_kinds=wire.GENERATION_KINDS).tensor, torch.Tensor)


@pytest.mark.parametrize("codec", wire.CODECS)
def test_wrong_payload_length_is_rejected(codec):
    header, payload = wire.encode(prefill(torch.randn(3, 100)), codec)
    payload = bytes(payload)
    for body in (payload[:-1], payload + b"\0", payload[:-2], payload + b"\0\0", b""):
        with pytest.raises(wire.FrameError, match="payload has %d bytes" % len(body)):
            wire.decode([header, body])


def test_a_header_naming_the_wrong_codec_for_its_payload_is_rejected():
    header, payload = wire.encode(prefill(torch.randn(3, 64)), "float16")
    lie = msgpack.packb(dict(msgpack.unpackb(header), codec="int8"))
    with pytest.raises(wire.FrameError, match="codec int8 needs"):
        wire.decode([lie, bytes(payload)])


def test_unknown_codec_is_rejected():
    header, payload = wire.encode(prefill(torch.randn(3, 64)))
    for codec in ("int4", "", None, 8, "RAW"):
        bad = msgpack.packb(dict(msgpack.unpackb(header), codec=codec))
        with pytest.raises(wire.FrameError, match="unknown codec %r" % (codec,)):
            wire.decode([bad, bytes(payload)])
    with pytest.raises(ValueError, match="unknown codec 'q4'"):
        wire.encode(prefill(torch.randn(3, 64)), "q4")


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5, 6])
def test_an_older_peer_is_refused(version):
    assert wire.PROTOCOL_VERSION == 7
    header, payload = wire.encode(prefill(torch.randn(3, 64)))
    old = msgpack.packb(dict(msgpack.unpackb(header), v=version))
    with pytest.raises(wire.FrameError, match="protocol version %d, expected 7" % version):
        wire.decode([old, bytes(payload)])


def test_adapter_ids_travel_only_when_used_and_are_checked():
    x = torch.randn(3, 64)
    base = wire.Frame("prefill", 7, [0, 1], [0, 0], [1, 2], x)
    header, payload = wire.encode(base)
    assert "adapter" not in msgpack.unpackb(header)
    assert wire.decode([header, bytes(payload)]).adapters == []
    mixed = wire.Frame("prefill", 7, [0, 1], [0, 0], [1, 2], x, adapters=[2, 0])
    header, payload = wire.encode(mixed)
    assert msgpack.unpackb(header)["adapter"] == [2, 0]
    assert wire.decode([header, bytes(payload)], adapters={2}).adapters == [2, 0]
    with pytest.raises(wire.FrameError, match="adapter 2 is not loaded here"):
        wire.decode([header, bytes(payload)], adapters={1})
    for bad in ([2], [2, -1], [2, wire.MAX_ADAPTER_ID + 1], [2, "x"]):
        forged = msgpack.packb(dict(msgpack.unpackb(header), adapter=bad))
        with pytest.raises(wire.FrameError, match="adapter"):
            wire.decode([forged, bytes(payload)])


def test_the_limit_bounds_both_the_payload_and_the_decoded_tensor():
    x = torch.randn(4, 64)  # float32: 1024 bytes decoded, int8: 256 + 16 + 32 bytes on the wire
    header, payload = wire.encode(prefill(x), "int8")
    wire.decode([header, bytes(payload)], max_payload=1024)
    with pytest.raises(wire.FrameError, match="decoded tensor of 1024 bytes exceeds the 1000-byte limit"):
        wire.decode([header, bytes(payload)], max_payload=1000)
    with pytest.raises(wire.FrameError, match="payload of 304 bytes exceeds"):
        wire.decode([header, bytes(payload)], max_payload=200)


def test_hostile_int8_scales_are_only_data():
    x = torch.randn(2, 64)
    header, payload = wire.encode(prefill(x), "int8")
    body = bytearray(payload)
    body[128:130] = b"\x00\x7c"  # +inf (little-endian float16)
    body[130:132] = b"\x00\x7e"  # NaN
    got = wire.decode([header, bytes(body)]).tensor
    assert got.shape == (2, 64) and not torch.isfinite(got[0]).all()
    assert torch.equal(got[1], round_trip(prefill(x), "int8").tensor[1])


@pytest.mark.parametrize("codec", wire.CODECS)
def test_multi_sample_frames_keep_samples_start_and_count(codec):
    samples, start, count = [0, 2, 5], [0, 10, 3], [4, 1, 7]
    for kind, rows in (("prefill", 12), ("prefill", 3), ("score", 12), ("decode", 3)):
        c = [1, 1, 1] if kind == "decode" else count
        x = torch.randn(rows, 100).to(torch.bfloat16)
        got = round_trip(wire.Frame(kind, 4, samples, start, c, x), codec, run=4, hidden=100, n_slots=6, max_len=64)
        assert (got.kind, got.run, got.samples, got.start, got.count) == (kind, 4, samples, start, c)
        assert got.tensor.shape == (rows, 100) and got.tensor.dtype == torch.bfloat16
        if codec == "raw":
            assert torch.equal(got.tensor, x)
    header, payload = wire.encode(wire.Frame("score", 4, samples, start, count, torch.randn(3, 100)), codec)
    with pytest.raises(wire.FrameError, match="rows 3"):  # score frames carry every position
        wire.decode([header, bytes(payload)])


@pytest.mark.parametrize("kind", ["stop", "reset"])
def test_control_frames_carry_no_payload_whatever_the_codec(kind):
    for codec in wire.CODECS:
        header, payload = wire.encode(wire.Frame(kind, 2), codec)
        assert payload == b""
        got = wire.decode([header, payload], run=2)
        assert got.kind == kind and got.tensor is None


@pytest.mark.parametrize("codec", ["raw", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("width", [1, 33, 576])
def test_numpy_codecs_speak_the_torch_codecs_bytes(codec, width):
    """A node computing with ggml encodes and decodes frames with numpy (mdi.ring.wire_numpy),
    never loading torch: the same format, the same values both ways."""
    from mdi.ring import wire_numpy, wire_torch
    x = torch.randn(5, width) * torch.logspace(-2, 2, width)  # a few large channels, as residual streams have
    x[2, :] = 0.0  # an all-zero row
    from_torch = bytes(wire_torch.encode_payload(x, codec))
    from_numpy = bytes(wire_numpy.encode_payload(x.numpy(), codec))
    assert len(from_numpy) == len(from_torch) == wire.payload_nbytes(5, width, "float32", codec)
    if codec != "int8":  # int8 may list a row's outliers in another order: compared decoded
        assert from_numpy == from_torch
    for payload in (from_torch, from_numpy):
        a = wire_torch.decode_payload(payload, 5, width, "float32", codec)
        b = wire_numpy.decode_payload(payload, 5, width, "float32", codec)
        assert b.dtype == np.float32 and np.array_equal(a.numpy(), b)
    assert np.array_equal(wire_torch.decode_payload(from_torch, 5, width, "float32", codec).numpy(),
                          wire_numpy.decode_payload(from_numpy, 5, width, "float32", codec))


def test_a_process_without_torch_decodes_frames_to_numpy():
    import subprocess
    import sys
    frame = wire.Frame(wire.FrameKind.DECODE, 7, [0], [3], [1], torch.randn(1, 8))
    header, payload = wire.encode(frame, "bfloat16")
    code = ("import sys, numpy as np; from mdi.ring import wire; "
            "f = wire.decode([sys.stdin.buffer.read(%d), sys.stdin.buffer.read()], run=7, hidden=8); "
            "assert isinstance(f.tensor, np.ndarray) and f.tensor.shape == (1, 8); "
            "out = wire.encode(f, 'raw'); assert 'torch' not in sys.modules; "
            "sys.stdout.buffer.write(bytes(out[1]))" % len(header))
    proc = subprocess.run([sys.executable, "-c", code], input=bytes(header) + bytes(payload), capture_output=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    want = wire.decode([header, payload], run=7, hidden=8).tensor
    assert np.array_equal(np.frombuffer(proc.stdout, np.float32).reshape(1, 8), want.numpy())
