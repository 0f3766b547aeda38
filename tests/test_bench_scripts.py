"""The benchmark scripts that read a run's node reports run to their end and write their
record. bench_ring, bench_wire_codec, bench_threads and bench_gpu had each read a NodeReport as
a dict (TypeError or AttributeError after the whole run, bench_gpu silently losing its parts)
and no test had run them. Records only: no timing is judged here."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

TINY = os.path.join(ROOT, "models", "nanogpt-shakespeare")


def run_script(name, tmp_path, *args):
    out = str(tmp_path / "record.json")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args, "--out", out],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env=dict(os.environ, MDI_PROFILE_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_bench_ring_records_the_hop_overhead_and_each_nodes_backend(tmp_path):
    record = run_script("bench_ring.py", tmp_path, "--model", TINY, "--nodes", "2", "--tokens", "8", "--repeats", "1",
                        "--no-quota")
    hop, = record["hop_overhead"]
    assert hop["compute_slowdown_per_hop_s"]["n"] == 1
    assert sorted(hop["node_backends"]) == ["board1", "starter"]
    assert set(hop["node_backends"].values()) <= {"ggml", "torch"}


def test_bench_wire_codec_records_every_codecs_hop(tmp_path):
    record = run_script("bench_wire_codec.py", tmp_path, "--model", TINY, "--tokens", "2")
    assert sorted(record["codecs"]) == ["bfloat16", "float16", "int8", "raw"]


def test_bench_threads_records_the_workers_threads(tmp_path):
    record = run_script("bench_threads.py", tmp_path, "--model", TINY, "--tokens", "3", "--repeats", "1")
    assert record["worker_threads"]["--threads 1"] == [1, 1], record
    assert all(isinstance(t, int) and t >= 1 for ts in record["worker_threads"].values() for t in ts), record


@pytest.mark.slow
def test_bench_gpu_on_the_cpu_keeps_its_ring_parts(tmp_path):
    record = run_script("bench_gpu.py", tmp_path, "--device", "cpu", "--quick", "--cache", str(tmp_path / "gguf"))
    text = json.dumps(record)
    assert record["status"] == "complete" and "node_metrics" in text and "Error" not in text
