"""Typed seams with unchanged outsides: a worker's report and a recovery write the metrics
record's keys; str enums are their words on the wire, in JSON, in format() and as dict keys."""
import json

import msgpack
import pytest

from mdi.ring.status import BatchCounter, NodeCounters, StatusError, StatusReply, WorkerState
from mdi.ring.wire import Frame, FrameError, FrameKind, decode, encode
from mdi.starter.node_report import Recovery, worker_report
from mdi.starter.sample import FinishReason


def test_worker_report_has_the_metrics_record_keys():
    batching = BatchCounter()
    batching.add(3, 2)
    status = StatusReply(state="running", version="x", port=1, device="cpu", threads=2, kernels={"a": "b"},
                         counters=NodeCounters(bytes_sent=10, messages_sent=2, bytes_sent_by_kind={"decode": 10},
                                               messages_sent_by_kind={"decode": 2}, compute_seconds=0.5,
                                               batching=batching))
    assert worker_report("w1", [1, 3], status, 123).to_json() == {
        "name": "w1", "layers": [1, 3], "peak_memory_bytes": 0, "cache_bytes": 123, "bytes_sent": 10,
        "messages_sent": 2, "bytes_sent_by_kind": {"decode": 10}, "messages_sent_by_kind": {"decode": 2},
        "compute_seconds": 0.5, "threads": 2, "kernels": {"a": "b"}, **batching.metrics(),
        "speculation": {"passes_cancelled": 0, "rows_cancelled": 0}}  # counted whether or not the run drafted


def test_recovery_json():
    rec = Recovery("node w1 died", "spare took its layers", at_s=1.5, seconds=0.25)
    assert json.loads(json.dumps(rec.to_json())) == {"cause": "node w1 died", "action": "spare took its layers",
                                                     "at_s": 1.5, "seconds": 0.25}


def test_str_enums_are_their_words():
    assert json.dumps({FrameKind.DECODE: FinishReason.EOS}) == '{"decode": "eos"}'
    assert msgpack.packb(FrameKind.SCORE) == msgpack.packb("score")
    assert "%s %s" % (WorkerState.RUNNING, FinishReason.STOP) == "running stop" == "{} {}".format(
        WorkerState.RUNNING, FinishReason.STOP)
    assert {FrameKind.DECODE: 1}["decode"] == 1 and {"decode": 1}[FrameKind.DECODE] == 1


def test_frame_kinds_on_the_wire_are_unchanged():
    header, _ = encode(Frame(FrameKind.STOP, 5))
    assert msgpack.unpackb(header)["kind"] == "stop" and type(msgpack.unpackb(header)["kind"]) is str
    assert decode(encode(Frame(FrameKind.RESET, 5)), run=5).kind == FrameKind.RESET
    raw = msgpack.unpackb(header)
    raw["kind"] = "nope"
    with pytest.raises(FrameError, match="unknown kind"):
        decode([msgpack.packb(raw), b""])


def test_worker_states_parse_to_members():
    reply = StatusReply.from_json({"state": "idle", "version": "x", "port": 1, "device": "cpu"})
    assert reply.state == WorkerState.IDLE and reply.to_json()["state"] == "idle"
    with pytest.raises(StatusError, match="state"):
        StatusReply.from_json({"state": "asleep", "version": "x", "port": 1, "device": "cpu"})
