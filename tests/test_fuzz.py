"""Fuzzing the two network inputs: the frame decoder and the worker's HTTP routes. Random and
mutated inputs are rejected cleanly; the worker keeps answering and computing correctly."""
import json
import os

import msgpack
import pytest
import requests
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import WorkerProcess, free_ports
from ringconfigs import parse_run_config
from mdi.ring import wire
from mdi.starter import batch

FUZZ = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)


def valid_frame(rows=3, hidden=8):
    return wire.Frame("prefill", 5, [1], [0], [rows], torch.randn(rows, hidden))


def decode_or_reject(parts, **expect):
    try:
        frame = wire.decode(parts, **expect)
    except wire.FrameError:
        return None
    if frame.tensor is not None:
        # Whatever the codec, the payload had exactly the bytes its header promised.
        codec = msgpack.unpackb(parts[0])["codec"]
        rows, width = frame.tensor.shape
        assert wire.payload_nbytes(rows, width, frame.tensor.dtype, codec) == len(parts[1])
    return frame


def mutate_header(header_bytes, key, value, drop):
    """A valid header with `key` dropped or set to `value`, packed again; None when msgpack
    cannot pack the value."""
    header = msgpack.unpackb(header_bytes)
    if drop and key in header:
        del header[key]
    else:
        header[key] = value
    try:
        return msgpack.packb(header)
    except (TypeError, ValueError, OverflowError):
        return None


def test_valid_frames_round_trip():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        frame = wire.Frame("decode", 9, [0, 3], [4, 7], [1, 1], torch.randn(2, 16).to(dtype))
        header, payload = wire.encode(frame)
        got = wire.decode([header, bytes(payload)], run=9, hidden=16, n_slots=4, max_len=32)
        assert got.samples == [0, 3] and got.start == [4, 7] and torch.equal(got.tensor, frame.tensor)


@settings(max_examples=4000, **FUZZ)
@given(header=st.binary(max_size=200), payload=st.binary(max_size=200))
def test_random_bytes_are_rejected(header, payload):
    decode_or_reject([header, payload], run=5, hidden=8, n_slots=4, max_len=64)


@settings(max_examples=6000, **FUZZ)
@given(key=st.sampled_from(["v", "kind", "run", "samples", "start", "count", "dtype", "shape", "codec", "extra"]),
       value=msgpack_values, drop=st.booleans(), cut=st.integers(0, 200))
def test_mutated_valid_frames_are_rejected_or_consistent(key, value, drop, cut):
    header_bytes, payload = wire.encode(valid_frame())
    mutated = mutate_header(header_bytes, key, value, drop)
    if mutated is None:
        return
    payload = bytes(payload)
    for body in (payload, payload[:cut]):
        frame = decode_or_reject([mutated, body], run=5, hidden=8, n_slots=4, max_len=64)
        if frame is not None:
            assert frame.run == 5 and all(0 <= s < 4 for s in frame.samples)


HIDDEN = 40  # not a multiple of the int8 block: every row has a short last block


@st.composite
def multi_sample_frames(draw):
    """A valid frame of several samples with their own start/count; rows = every position or
    (generation passes) each sample's last one; any codec and activation dtype."""
    kind = draw(st.sampled_from(["prefill", "decode", "score"]))
    n = draw(st.integers(1, 4))
    samples = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n, unique=True))
    count = [1] * n if kind == "decode" else draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    start = [draw(st.integers(0, 64 - c)) for c in count]
    rows = sum(count) if kind == "score" or draw(st.booleans()) else n
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    x = (torch.randn(rows, HIDDEN, generator=g) * draw(st.sampled_from([0.0, 1e-3, 1.0, 300.0]))).to(dtype)
    return wire.Frame(kind, 5, samples, start, count, x), draw(st.sampled_from(wire.CODECS))


@settings(max_examples=400, **FUZZ)
@given(case=multi_sample_frames())
def test_multi_sample_frames_round_trip_with_every_codec(case):
    frame, codec = case
    header, payload = wire.encode(frame, codec)
    got = decode_or_reject([header, bytes(payload)], run=5, hidden=HIDDEN, n_slots=4, max_len=64)
    assert got is not None
    assert (got.kind, got.samples, got.start, got.count) == (frame.kind, frame.samples, frame.start, frame.count)
    x = frame.tensor
    assert got.tensor.dtype == x.dtype and got.tensor.shape == x.shape
    if codec == "raw":
        assert torch.equal(got.tensor, x)
    elif codec == "int8":
        assert torch.equal(got.tensor, wire.dequantize_int8(wire.quantize_int8(x), HIDDEN, x.dtype))
    else:
        assert torch.equal(got.tensor, x.to(getattr(torch, codec)).to(x.dtype))


@settings(max_examples=2000, **FUZZ)
@given(case=multi_sample_frames(),
       key=st.sampled_from(["v", "kind", "samples", "start", "count", "dtype", "shape", "codec", "extra"]),
       value=msgpack_values | st.sampled_from(list(wire.CODECS) + ["float32", "int4", 1, 2])
       | st.lists(st.integers(-1, 70), max_size=5),
       drop=st.booleans(), cut=st.integers(0, 400), junk=st.binary(min_size=1, max_size=3))
def test_mutated_multi_sample_frames_with_codecs_are_rejected_or_consistent(case, key, value, drop, cut, junk):
    frame, codec = case
    header_bytes, payload = wire.encode(frame, codec)
    mutated = mutate_header(header_bytes, key, value, drop)
    if mutated is None:
        return
    payload = bytes(payload)
    for head, body in ((mutated, payload), (mutated, payload[:cut]), (header_bytes, payload[:cut]),
                       (header_bytes, payload + junk)):
        got = decode_or_reject([head, body], run=5, hidden=HIDDEN, n_slots=4, max_len=64)
        if got is not None:
            assert got.run == 5 and all(0 <= s < 4 for s in got.samples)
            assert all(s + c <= 64 for s, c in zip(got.start, got.count))
            if got.tensor is not None:
                assert got.tensor.shape[1] == HIDDEN and got.tensor.shape[0] in (sum(got.count), len(got.samples))


def test_oversized_and_stale_frames_are_rejected():
    header, payload = wire.encode(valid_frame())
    with pytest.raises(wire.FrameError, match="stale"):
        wire.decode([header, payload], run=6)
    with pytest.raises(wire.FrameError, match="limit"):
        wire.decode([header, payload], run=5, max_payload=10)
    huge = msgpack.packb(dict(msgpack.unpackb(header), shape=[1 << 24, 1 << 24]))
    with pytest.raises(wire.FrameError):
        wire.decode([huge, payload], run=5)


def init_spec(model_dir, port, data_port):
    with open(os.path.join(model_dir, "mdi_config.json")) as f:
        model = json.load(f)["model"]
    return {"run_id": 1, "model": model, "layers": [2, 4], "dtype": "float32", "device": "cpu",
            "n_slots": 2, "max_len": 64,
            "data": {"bind_port": data_port, "next_host": "127.0.0.1", "next_port": free_ports(1)[0],
                     "is_last": True},
            "weights": {"push": {"nbytes": 1000, "sha256": "0" * 64}}}


@pytest.fixture(scope="module")
def fuzz_worker():
    w = WorkerProcess(free_ports(1)[0]).wait_ready()
    yield w
    w.stop()


def test_http_routes_survive_fuzzing_then_serve_correctly(fuzz_worker, tiny_models):
    url = fuzz_worker.url
    session = requests.Session()
    data_port = free_ports(1)[0]
    spec = init_spec(tiny_models["gpt2"], fuzz_worker.port, data_port)
    seen = {}

    @settings(max_examples=2500, **FUZZ)
    @given(route=st.sampled_from([("POST", "/init"), ("POST", "/weights"), ("PUT", "/stop"), ("GET", "/status"),
                                  ("GET", "/health"), ("POST", "/nope"), ("DELETE", "/init")]),
           body=json_values, key=st.sampled_from(sorted(spec) + ["data", "weights"]), mutate=st.booleans(),
           raw=st.binary(max_size=64))
    def fuzz(route, body, key, mutate, raw):
        method, path = route
        if path == "/weights":
            r = session.request(method, url + path, data=raw, timeout=10,
                                headers={"Content-Type": "application/octet-stream"})
        elif mutate and path == "/init":
            r = session.request(method, url + path, json=dict(spec, **{key: body}), timeout=10)
        elif mutate:
            r = session.request(method, url + path, data=raw, timeout=10, headers={"Content-Type": "application/json"})
        else:
            r = session.request(method, url + path, json=body, timeout=10)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 404, 405, 413), (path, r.status_code, r.text[:300])
        assert r.headers.get("Content-Type", "").startswith("application/json") or r.status_code in (404, 405)

    fuzz()
    assert seen.get(400, 0) > 100
    assert session.get(url + "/health", timeout=5).json()["ok"] is True
    session.put(url + "/stop", timeout=5)
    check_ring_still_correct(fuzz_worker, tiny_models["gpt2"])


def test_data_port_garbage_is_dropped_and_counted(fuzz_worker, tiny_models):
    """Random frames on a worker's data port during a configured run are logged and dropped."""
    data_port = free_ports(1)[0]
    spec = init_spec(tiny_models["gpt2"], fuzz_worker.port, data_port)
    from safetensors.torch import save
    from mdi.model.files.store import load_weights
    import hashlib
    blob = save(load_weights(tiny_models["gpt2"], (2, 4), False, False, torch.float32))
    spec["weights"] = {"push": {"nbytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}
    url = fuzz_worker.url
    assert requests.post(url + "/init", json=spec, timeout=30).json()["need_weights"] in (True, False)
    requests.post(url + "/weights", data=blob, timeout=30, headers={"Content-Type": "application/octet-stream"})
    assert requests.get(url + "/status", timeout=5).json()["state"] == "running"
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect("tcp://127.0.0.1:%d" % data_port)
    rng = torch.Generator().manual_seed(0)
    header, payload = wire.encode(valid_frame(hidden=64))
    sent = 0
    for i in range(300):
        junk = torch.randint(0, 256, (int(torch.randint(0, 64, (1,), generator=rng)),), generator=rng,
                             dtype=torch.uint8).numpy().tobytes()
        parts = [[junk, junk], [header, junk], [junk], [header, bytes(payload)], [header, bytes(payload), junk]][i % 5]
        push.send_multipart(parts)
        sent += 1
    push.close(linger=5000)  # deliver everything queued before closing
    import time
    deadline = time.monotonic() + 60  # (at once when idle; a bound that only catches frames never counted)
    while time.monotonic() < deadline:
        counters = requests.get(url + "/status?run=1", timeout=5).json()["counters"]
        if counters.get("bad_frames", 0) >= sent:
            break
        time.sleep(0.1)
    assert counters["bad_frames"] == sent  # every one rejected (run id 5 is not run 1)
    requests.put(url + "/stop", timeout=5)
    check_ring_still_correct(fuzz_worker, tiny_models["gpt2"])


def check_ring_still_correct(worker, model):
    ring = parse_run_config(model, [worker], label="ring", n_tokens=12)
    alone = parse_run_config(model, label="alone", n_tokens=12)
    got = batch.run(ring, ["fuzz"]).samples[0].token_ids
    assert got == batch.run(alone, ["fuzz"]).samples[0].token_ids


def test_json_nested_past_the_parser_stack_is_a_400(fuzz_worker):
    body = "[" * 200000 + "]" * 200000  # within the body limit, deeper than json's recursion
    for path in ("/init", "/profile"):
        r = requests.post(fuzz_worker.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"], (path, r.status_code, r.text[:200])
    assert requests.get(fuzz_worker.url + "/health", timeout=5).json()["ok"] is True


def test_backend_route_validates_every_field_then_answers(fuzz_worker, tiny_models):
    """POST /backend (asked before /init): a mutated request is a 400 naming what is wrong, never
    a 500 nor a measurement; the unmutated one is answered with the backend asked."""
    with open(os.path.join(tiny_models["gpt2"], "mdi_config.json")) as f:
        model = json.load(f)["model"]
    spec = {"model": model, "layers": [2, 4], "asked": "torch", "device": "cpu", "dtype": "float32",
            "rows": 2, "kv_type": "f16", "adapters": False}
    url = fuzz_worker.url + "/backend"
    session = requests.Session()
    seen = {}

    @settings(max_examples=400, **FUZZ)
    @given(key=st.sampled_from(sorted(spec) + ["threads", "gguf_types", "quant", "quant_kernel", "extra"]),
           body=json_values)
    def fuzz(key, body):
        r = session.post(url, json=dict(spec, **{key: body}), timeout=30)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400), (key, body, r.status_code, r.text[:300])
        if r.status_code == 400:
            assert "\n" not in r.json()["error"].strip()
        else:
            assert r.json()["backend"] in ("ggml", "torch")

    fuzz()
    assert seen.get(400, 0) > 200
    for key, value, needle in (("asked", "fastest", "asked must be one of"), ("layers", [3, 1], "layers[1]"),
                               ("kv_type", "q2", "kv_type must be one of"), ("rows", 0, "rows")):
        r = session.post(url, json=dict(spec, **{key: value}), timeout=30)
        assert r.status_code == 400 and needle in r.json()["error"], (key, r.text[:300])
    reply = session.post(url, json=spec, timeout=30).json()
    assert reply["backend"] == "torch" and reply["seconds"] == 0.0
