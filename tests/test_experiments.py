"""mdi-bench: the experiment schema, the sweep expansion, the delay proxy, and a smoke sweep
of tiny random models end to end (CSV columns, summary, PNGs). Needs no root: emulation is off."""
import csv
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
SMOKE = os.path.join(ROOT, "configs", "experiments", "smoke.yaml")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

from mdi.lab.emulation import DelayProxy, Emulation, EmulationSettings  # noqa: E402
from mdi.lab.report import CSV_COLUMNS, steady_rate, summarize  # noqa: E402
from mdi.lab.spec import ExperimentError, parse_experiment, plan_rings, samples_for  # noqa: E402

GOOD = {"models": [{"name": "m", "path": "models/m"}]}


def parse(extra=None, model=None):
    data = {"models": [dict(GOOD["models"][0], **(model or {}))]}
    data.update(extra or {})
    return parse_experiment(data, "x.yaml")


@pytest.mark.parametrize("extra, model, needle", [
    ({"repeat": 3}, None, "x.yaml: unknown key 'repeat'"),
    ({"samples": ["1..2M"]}, None, "x.yaml.samples[0]"),
    ({"samples": [0]}, None, "x.yaml.samples[0]"),
    ({"nodes": [0]}, None, "x.yaml.nodes[0]"),
    ({"tokens": "many"}, None, "x.yaml.tokens: expected an integer"),
    (None, {"partitions": [[1, "a"]]}, "models[0].partitions[0]"),
    (None, {"dtype": "int4"}, "models[0].dtype"),
    (None, {"random": {"family": "gpt2"}}, "models[0].random.n_layer: required key is missing"),
    ({"emulation": {"enabled": "maybe"}}, None, "emulation.enabled"),
    ({"emulation": {"cpu_quota": 0}}, None, "emulation.cpu_quota"),
    ({"emulation": {"netem": 1}}, None, "emulation: unknown key 'netem'"),
    ({"starter": "thread"}, None, "starter"),
])
def test_schema_errors_name_the_key(extra, model, needle):
    with pytest.raises(ExperimentError) as e:
        parse(extra, model)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_path_and_duplicate_model():
    with pytest.raises(ExperimentError, match=r"models\[0\]\.path: required key is missing"):
        parse_experiment({"models": [{"name": "m"}]}, "x.yaml")
    with pytest.raises(ExperimentError, match=r"models\[1\]\.name: model 'm' is listed twice"):
        parse_experiment({"models": [GOOD["models"][0], GOOD["models"][0]]}, "x.yaml")


def test_defaults_and_overrides():
    exp = parse({"tokens": 9, "nodes": [1, 2], "emulation": {"enabled": False}}, {"tokens": 5})
    m = exp.models[0]
    assert (m.tokens, m.nodes, m.partitions, exp.repeats) == (5, [1, 2], ["balanced"], 3)
    assert exp.emulation.mode == "off"  # YAML's off/false both mean off
    assert exp.output == os.path.join("results", "x")


def test_samples_expansion():
    assert samples_for(["1..2N"], 3) == [1, 2, 3, 4, 5, 6]
    assert samples_for([1, "N", "2N"], 1) == [1, 2]
    assert samples_for([1, 2, 3, 4, "2N"], 3) == [1, 2, 3, 4, 6]


def test_partitions_per_node_count():
    m = parse(model={"nodes": [1, 2, 3], "partitions": ["balanced", [11, 19], [6, 12, 12]]}).models[0]
    rings = plan_rings(m, "x.yaml: models[0]", 30)
    assert rings == [(1, [30], "balanced"), (2, [15, 15], "balanced"), (2, [11, 19], "explicit"),
                     (3, [10, 10, 10], "balanced"), (3, [6, 12, 12], "explicit")]
    bad = parse(model={"partitions": [[10, 10]]}).models[0]
    with pytest.raises(ExperimentError, match=r"models\[0\]\.partitions\[0\]: 10\+10 sums to 20, but m has 30"):
        plan_rings(bad, "x.yaml: models[0]", 30)
    with pytest.raises(ExperimentError, match=r"models\[0\]\.nodes: 3 nodes but m has only 2 layers"):
        plan_rings(parse(model={"nodes": [3]}).models[0], "x.yaml: models[0]", 2)


def test_steady_rate_and_efficiency():
    # Two samples decoding together: 1 token each per 0.1 s -> 20 tokens/s in the window.
    times = [[0.0, 0.1, 0.2, 0.3], [0.05, 0.15, 0.25, 0.35]]
    assert steady_rate(times) == pytest.approx(5 / 0.25)
    rows = [{"model": "m", "nodes": "2", "partition": "1+1", "samples": s, "tokens": "4", "repeat": "1",
             "status": "ok", "decode_tokens_per_s": r, "tokens_per_s": r, "ttft_s": "0.1",
             "peak_memory_mb": "10;20"} for s, r in (("1", "10"), ("2", "15"))]
    by_s = {r["samples"]: r for r in summarize(rows)}
    assert float(by_s["2"]["efficiency_median"]) == pytest.approx(15 / (2 * 10))
    assert by_s["1"]["peak_memory_mb_max"] == "10.0;20.0"


def test_emulation_off_is_reported():
    emu = Emulation(EmulationSettings(mode="off", cpu_quota=0.5), 3)
    emu.start()
    assert not emu.active("cpu") and emu.tag_for_csv() == "off"
    assert "plain loopback" in emu.describe()
    assert emu.command(["true"], "g0k0", 0) == ["true"]
    assert emu.close() == []


def _echo_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        while True:
            data = conn.recv(4096)
            if not data:
                break
            conn.sendall(data)
        conn.close()
    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_delay_proxy_adds_latency_both_ways():
    srv = _echo_server()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    proxy = DelayProxy(listener, srv.getsockname(), 0.05)
    try:
        c = socket.create_connection(listener.getsockname(), timeout=5)
        t0 = time.monotonic()
        c.sendall(b"ping")
        got = b""
        while len(got) < 4:
            got += c.recv(16)
        rtt = time.monotonic() - t0
        assert got == b"ping"
        assert rtt >= 0.1  # 50 ms there and 50 ms back
        c.close()
    finally:
        proxy.close()
        srv.close()


def _bench(*args, timeout=120):
    return subprocess.run([os.path.join(BIN, "mdi-bench")] + list(args), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout, cwd=ROOT)


def test_bad_experiment_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - {name: m, path: x, nodes: [two]}\n")
    r = _bench("--experiment", str(bad))
    assert r.returncode == 2
    err = r.stderr.decode().strip()
    assert err.count("\n") == 0 and err.startswith("mdi-bench: error: ") and "models[0].nodes[0]" in err


@pytest.mark.timeout(120)
def test_smoke_sweep_writes_csv_and_plots(tmp_path):
    with open(SMOKE) as f:
        data = yaml.safe_load(f)
    for m in data["models"]:  # the tiny random models are built in this test's folder
        m["path"] = str(tmp_path / "models" / m["name"])
    data["output"] = str(tmp_path / "out")
    config = tmp_path / "smoke.yaml"
    config.write_text(yaml.safe_dump(data))
    r = _bench("--experiment", str(config), "--emulation", "off")
    log = r.stderr.decode()
    assert r.returncode == 0, log
    assert "emulation: off" in log and "[4/4]" in log

    out = tmp_path / "out"
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_COLUMNS
        rows = list(reader)
    assert [(r["model"], r["nodes"], r["partition"], r["samples"]) for r in rows] == [
        ("tiny-gpt2", "1", "4", "1"), ("tiny-gpt2", "2", "2+2", "1"), ("tiny-gpt2", "2", "2+2", "2"),
        ("tiny-llama", "2", "1+3", "2")]
    for r in rows:
        assert r["status"] == "ok" and r["emulation"] == "off"
        assert float(r["tokens_per_s"]) > 0 and float(r["ttft_s"]) > 0
        assert int(r["generated_tokens"]) == 6 * int(r["samples"])
        assert len(r["peak_memory_mb"].split(";")) == int(r["nodes"])
        busy = [float(x) for x in r["node_busy"].split(";")]  # each node's compute time / run time
        assert len(busy) == int(r["nodes"]) and all(0 < b <= 1.05 for b in busy), r["node_busy"]
        assert (out / r["metrics_file"]).is_file()
    # a decode hop carries one hidden state: 64 floats plus a small header
    two = [r for r in rows if r["nodes"] == "2"]
    assert all(64 * 4 < float(r["decode_bytes_per_hop"]) < 64 * 4 + 512 for r in two)

    for name in ("time_vs_tokens.png", "throughput_vs_samples.png", "memory_per_node.png"):
        with open(out / name, "rb") as f:
            assert f.read(8) == PNG_MAGIC, name
    for name in ("summary.csv", "report.md", "machine.json", "experiment.yaml"):
        assert (out / name).is_file(), name

    os.remove(out / "memory_per_node.png")
    r = _bench("--experiment", str(config), "--plot-only")
    assert r.returncode == 0, r.stderr.decode()
    assert (out / "memory_per_node.png").is_file()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="board emulation needs root")
@pytest.mark.timeout(600)
def test_back_to_back_authenticated_runs_on_emulated_boards(tmp_path):
    """Many short runs with the shared secret through the emulated network: each new run's
    nodes may first reach the previous run's sockets (or a proxy's dead connection); the
    starter's ring probe must make every run finish. Without it ~1 run in 20 stalled here."""
    with open(SMOKE) as f:
        data = yaml.safe_load(f)
    data["models"] = [dict(data["models"][0], path=str(tmp_path / "models" / "tiny-gpt2"), nodes=[3],
                           samples=[1, 3])]
    data.update(output=str(tmp_path / "out"), repeats=30, auth=True)
    config = tmp_path / "auth.yaml"
    config.write_text(yaml.safe_dump(data))
    r = _bench("--experiment", str(config), "--emulation", "on", timeout=580)
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        statuses = [row["status"] for row in csv.DictReader(f)]
    assert r.returncode == 0 and statuses == ["ok"] * 60, [s for s in statuses if s != "ok"][:3]
