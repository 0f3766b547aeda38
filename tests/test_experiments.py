"""mdi-bench: the experiment schema, the sweep expansion, the delay proxy, the plots, a dry
run, and a smoke sweep of tiny random models end to end (CSV columns, summary, PNGs). Needs
no root: emulation is off (one test runs on emulated boards when root)."""
import csv
import json
import os
import signal
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

from mdi.lab.cgroups import cgroup_unavailable_reason  # noqa: E402
from mdi.lab.delay_proxy import DelayProxy  # noqa: E402
from mdi.lab.emulation import Emulation, EmulationSettings  # noqa: E402
from mdi.lab.report import CSV_COLUMNS, steady_rate, summarize  # noqa: E402
from mdi.lab.spec import ExperimentError, parse_experiment, plan_rings, samples_for  # noqa: E402

GOOD = {"models": [{"name": "m", "path": "models/m"}]}


def parse(extra=None, model=None):
    data = {"models": [dict(GOOD["models"][0], **(model or {}))]}
    data.update(extra or {})
    return parse_experiment(data, "x.yaml")


@pytest.mark.parametrize("extra, model, needle", [
    ({"repeat": 3}, None, "x.yaml: unknown key 'repeat'"),
    ({"samples": ["1..2M"]}, None, "x.yaml: samples[0]"),
    ({"samples": [0]}, None, "x.yaml: samples[0]"),
    ({"nodes": [0]}, None, "x.yaml: nodes[0]"),
    ({"tokens": "many"}, None, "x.yaml: tokens: expected an integer"),
    (None, {"tokens": 1}, "models[0].tokens: expected an integer >= 2 (a decode rate needs two tokens)"),
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
    # a partition for a node count the sweep does not run would be left out without a word
    unused = parse(model={"nodes": [2, 3], "partitions": [[15, 15], [6, 6, 6, 12]]}).models[0]
    with pytest.raises(ExperimentError, match=r"partitions\[1\]: 6\+6\+6\+12 is for 4 nodes, but nodes is \[2, 3\]"):
        plan_rings(unused, "x.yaml: models[0]", 30)


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


def _bench(*args, timeout=120, env=None):
    return subprocess.run([os.path.join(BIN, "mdi-bench")] + list(args), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout, cwd=ROOT, env=env)


def _bench_error(r):
    """mdi-bench's own error line (else its last line of output)."""
    lines = [line for line in r.stderr.decode(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("mdi-bench: error:")]
    return (errors or lines or ["(no output)"])[-1]


def _bench_statuses(r, out):
    """The status of every run in OUT/results.csv. Where mdi-bench wrote none (it stopped
    before the first run: a bad file, emulation that cannot be set up inside this network
    namespace), the test fails with mdi-bench's own error line, not a FileNotFoundError."""
    path = os.path.join(str(out), "results.csv")
    if not os.path.isfile(path):
        pytest.fail("mdi-bench wrote no results.csv (exit %d): %s" % (r.returncode, _bench_error(r)))
    with open(path, newline="") as f:
        return [row["status"] for row in csv.DictReader(f)]


def _tree(path):
    return sorted(os.path.join(d, f) for d, dirs, files in os.walk(str(path)) for f in dirs + files)


def test_bad_experiment_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - {name: m, path: x, nodes: [two]}\n")
    r = _bench("--experiment", str(bad))
    assert r.returncode == 2
    err = r.stderr.decode().strip()
    assert err.count("\n") == 0 and err.startswith("mdi-bench: error: ") and "models[0].nodes[0]" in err


def test_an_out_that_cannot_be_written_is_one_line_before_any_run(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": "m", "path": str(tmp_path / "no-such-model")}]}))
    (tmp_path / "afile").write_text("")
    for out, problem in ((tmp_path / "afile", "exists and is not a directory"),
                         (tmp_path / "afile" / "sub", "is a file, not a directory")):
        r = _bench("--experiment", str(config), "--out", str(out))
        err = r.stderr.decode().strip()
        assert r.returncode == 2 and err.count("\n") == 0 and err == "mdi-bench: error: --out %s: %s" % (
            out, problem if out.name == "afile" else "%s %s" % (tmp_path / "afile", problem)), err
    # a folder the checks pass and the OS refuses to make (as root: /proc) had been a traceback
    r = _bench("--experiment", str(config), "--out", "/proc/mdi-no-such-folder")
    last = r.stderr.decode().strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr.decode(), r.stderr
    assert last.startswith("mdi-bench: error: ") and "/proc/mdi-no-such-folder" in last, last


def test_a_bench_that_stopped_early_fails_with_its_own_error(tmp_path):
    config = tmp_path / "gone.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": "m", "path": str(tmp_path / "no-such-model")}],
                                      "output": str(tmp_path / "out")}))
    r = _bench("--experiment", str(config), "--emulation", "off")
    assert r.returncode == 2
    with pytest.raises(pytest.fail.Exception) as e:
        _bench_statuses(r, tmp_path / "out")  # was open(out / "results.csv"): FileNotFoundError
    assert "mdi-bench: error: " in str(e.value) and "no-such-model does not exist" in str(e.value)


def test_dry_run_writes_nothing(tmp_path):
    """Not the missing random model, not the output folder, not even a work folder."""
    with open(SMOKE) as f:
        data = yaml.safe_load(f)
    for m in data["models"]:
        m["path"] = str(tmp_path / "models" / m["name"])
    data["output"] = str(tmp_path / "out")
    config = tmp_path / "smoke.yaml"
    config.write_text(yaml.safe_dump(data))
    (tmp_path / "tmp").mkdir()
    before = _tree(tmp_path)
    r = _bench("--experiment", str(config), "--dry-run", env=dict(os.environ, TMPDIR=str(tmp_path / "tmp")))
    log = r.stderr.decode()
    assert r.returncode == 0, log
    assert _tree(tmp_path) == before
    assert "4 runs in all" in log and "tiny-llama: 2 node(s), partition 1+3 (explicit)" in log
    assert "would build random model tiny-gpt2" in log


def _ok_row(nodes, partition, samples, rate, metrics_file="", peak=""):
    return {"model": "m", "nodes": str(nodes), "partition": partition, "samples": str(samples), "tokens": "4",
            "repeat": "1", "status": "ok", "decode_tokens_per_s": rate, "tokens_per_s": rate, "ttft_s": "0.1",
            "peak_memory_mb": peak, "weights_mb": "", "cache_mb": "", "metrics_file": metrics_file}


def test_a_sweep_with_no_good_run_leaves_no_figures_of_an_earlier_one(tmp_path):
    from mdi.lab import plots
    for name in plots.FIGURES:
        (tmp_path / name).write_bytes(b"an earlier sweep's figure")
    failed = dict(_ok_row(2, "1+1", 1, ""), status="failed")
    assert plots.plot_all(str(tmp_path), [failed], summarize([failed])) == []
    assert not any((tmp_path / name).exists() for name in plots.FIGURES)


@pytest.fixture
def figures(tmp_path, monkeypatch):
    """plots.plot_all over some rows, its figures kept open (by file name) instead of saved."""
    from mdi.lab import plots
    figs = {}

    def keep(fig, plt, out, name):
        figs[name] = fig
        return name

    monkeypatch.setattr(plots, "_save", keep)

    def plot(rows):
        plots.plot_all(str(tmp_path), rows, summarize(rows))
        return figs
    yield plot
    for fig in figs.values():
        plots._pyplot().close(fig)


def _notes(ax):
    return [t.get_text() for t in ax.texts]


def test_empty_plot_panels_say_no_data(tmp_path, figures):
    # one 2-node ring run at S=2 only: no 1-sample run, no efficiency, no memory figures
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.json").write_text('{"samples": [{"token_times": [0.1, 0.2]}, {"token_times": [0.15, 0.3]}]}')
    figs = figures([_ok_row(2, "2+2", 2, "10", "runs/a.json")])
    one_sample, in_flight = figs["time_vs_tokens.png"].axes
    rate, efficiency = figs["throughput_vs_samples.png"].axes
    (memory,) = figs["memory_per_node.png"].axes
    for ax in (one_sample, efficiency, memory):
        assert _notes(ax) == ["no data"], ax.get_title()
    for ax in (in_flight, rate):
        assert "no data" not in _notes(ax) and ax.get_legend() is not None, ax.get_title()


def test_samples_in_flight_axes_have_integer_ticks(figures):
    figs = figures([_ok_row(1, "4", 1, "10", peak="50"), _ok_row(2, "2+2", 2, "12", peak="30;30"),
                    _ok_row(2, "2+2", 1, "8", peak="30;30")])
    rate, efficiency = figs["throughput_vs_samples.png"].axes
    for ax in (rate, efficiency):
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(t == int(t) for t in ticks), (ax.get_title(), ticks)
    # a lone point: one tick, at its own value (was 1.900 ... 2.100)
    figs = figures([_ok_row(2, "2+2", 2, "10")])
    rate = figs["throughput_vs_samples.png"].axes[0]
    lo, hi = rate.get_xlim()
    assert [t for t in rate.get_xticks() if lo <= t <= hi] == [2.0]


# --------------------------------------------------------------------------- batched passes (issue 16)

BATCHING = os.path.join(ROOT, "configs", "experiments", "batching.yaml")


def test_batching_keys_default_and_override():
    m = parse().models[0]
    assert (m.max_batch, m.prefill_chunk, m.wire_codec) == (["auto"], None, "raw")
    m = parse({"max_batch": [1, "auto", 4], "prefill_chunk": 64, "wire_codec": "raw"},
              {"max_batch": [1, 1, 2]}).models[0]
    assert (m.max_batch, m.prefill_chunk, m.wire_codec) == ([1, 1, 2], 64, "raw")  # the model's own axis wins
    from mdi.lab.spec import max_batches
    assert max_batches(m.max_batch) == [1, 2]


@pytest.mark.parametrize("extra, model, needle", [
    ({"max_batch": [0]}, None, "x.yaml: max_batch[0]: expected a positive integer (1 = unbatched) or 'auto', got 0"),
    ({"max_batch": [1, "fast"]}, None, "x.yaml: max_batch[1]: expected a positive integer"),
    ({"max_batch": [True]}, None, "x.yaml: max_batch[0]"),
    ({"max_batch": []}, None, "x.yaml: max_batch: expected at least one entry"),
    ({"max_batch": "auto"}, None, "x.yaml: max_batch: expected a list"),
    (None, {"max_batch": [2.5]}, "models[0].max_batch[0]"),
    ({"prefill_chunk": 0}, None, "x.yaml: prefill_chunk: expected a positive integer"),
    (None, {"prefill_chunk": "all"}, "models[0].prefill_chunk: expected an integer"),
    ({"wire_codec": "zstd"}, None, "x.yaml: wire_codec: expected one of raw"),
    (None, {"wire_codec": "gzip"}, "models[0].wire_codec: expected one of raw"),
])
def test_batching_key_errors_name_the_key(extra, model, needle):
    with pytest.raises(ExperimentError) as e:
        parse(extra, model)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def _batching_plan(tmp_path, **top):
    """The shipped batching.yaml, its model a tiny random one (never built: plan only)."""
    from mdi.lab.sweep import plan_sweep
    with open(BATCHING) as f:
        data = yaml.safe_load(f)
    data["models"] = [{"name": "tiny", "path": str(tmp_path / "tiny"),
                       "random": {"family": "llama", "n_layer": 3, "n_embd": 32, "n_head": 4, "n_kv_head": 2,
                                  "intermediate_size": 64, "block_size": 128, "seed": 0}}]
    data.update(top)
    exp = parse_experiment(data, "batching.yaml")
    return exp, plan_sweep(exp, lambda m: None, build=False)


def test_batching_sweep_runs_both_max_batch_values_at_every_s(tmp_path):
    from mdi.lab.sweep import run_list
    exp, plans = _batching_plan(tmp_path)
    m = exp.models[0]
    assert (m.max_batch, m.nodes, m.tokens, m.dtype, m.quant, exp.repeats, exp.temperature) == (
        [1, "auto"], [3], 32, "float32", "none", 2, 0.0)
    assert exp.emulation.cpu_quota == 0.5 and exp.output == "results/batching"
    (ring,) = [p for rings in plans for p in rings]
    assert ring.n_nodes == 3 and ring.kind == "balanced" and ring.samples == [1, 2, 3, 6, 12, 18, 24]
    runs = ring.runs()
    assert len(runs) == 14 and len(set(runs)) == 14
    for s in ring.samples:  # each S with and without batching, one after the other
        assert [b for b, s2 in runs if s2 == s] == [1, "auto"]
    assert len(run_list(exp, plans)) == 2 * 14 and not tmp_path.joinpath("tiny").exists()


def test_batching_run_config_per_max_batch(tmp_path):
    """One run configuration per max_batch value, each a valid mdi-start config; prefill_chunk
    only when the experiment gives it."""
    from mdi.lab.nodes import Ring
    from mdi.runconfig import parse_config
    from mdi.lab.sweep import run_file_name
    exp, plans = _batching_plan(tmp_path)
    ring = Ring(plans[0][0], exp, Emulation(EmulationSettings(mode="off"), 3), None, str(tmp_path), print)
    runtimes = {}
    for b in (1, "auto"):
        config = ring.run_config(b)
        runtimes[b] = config["runtime"]
        assert parse_config(config, "ring.yaml").runtime.max_batch == b
    assert runtimes[1]["max_batch"] == 1 and runtimes["auto"]["wire_codec"] == "raw"
    assert "prefill_chunk" not in runtimes[1]
    assert ring.config_path(1) != ring.config_path("auto")
    argv = ring.starter_argv(3, 4, "m.json", 1)
    assert argv[argv.index("--config") + 1] == ring.config_path(1)
    assert run_file_name(ring.plan, 12, "auto", 2) == "tiny_n3_1-1-1_bauto_s12_r2.json"

    exp, plans = _batching_plan(tmp_path, prefill_chunk=16)
    ring = Ring(plans[0][0], exp, Emulation(EmulationSettings(mode="off"), 3), None, str(tmp_path), print)
    assert parse_config(ring.run_config("auto"), "ring.yaml").runtime.prefill_chunk == 16


def _outcome(nodes, samples=2, tokens=4):
    from mdi.lab.nodes import RunOutcome
    record = {"n_tokens": samples * tokens, "tokens_per_s": 8.0, "seconds": 1.0, "nodes": nodes,
              "samples": [{"token_ids": [1] * tokens, "token_times": [0.1 * (k + 1) + 0.01 * i for k in range(tokens)]}
                          for i in range(samples)]}
    return RunOutcome(0, None, record, [None] * len(nodes), [None] * len(nodes), 0.5, 1.0)


def test_csv_row_has_the_batching_columns(tmp_path):
    from mdi.lab.report import make_row
    exp, plans = _batching_plan(tmp_path)
    plan = plans[0][0]
    nodes = [{"compute_seconds": 0.5, "forwards": 10, "rows_per_forward_mean": 2.5, "rows_per_forward_max": 9,
              "samples_per_forward_mean": 1.75, "samples_per_forward_max": 2},
             {"compute_seconds": 0.25, "forwards": 12, "rows_per_forward_mean": 2.0, "rows_per_forward_max": 8,
              "samples_per_forward_mean": 1.5, "samples_per_forward_max": 2},
             {"compute_seconds": 0.25}]  # a node whose record lacks them: an empty entry, in its place
    row = make_row(exp, plan, 2, 1, _outcome(nodes, tokens=plan.model.tokens), "off", "runs/x.json", "auto")
    assert set(row) == set(CSV_COLUMNS)
    assert (row["status"], row["max_batch"], row["wire_codec"], row["samples"]) == ("ok", "auto", "raw", "2")
    assert row["rows_per_forward_mean"] == "2.50;2.00;"
    assert row["rows_per_forward_max"] == "9;8;"
    assert row["samples_per_forward_mean"] == "1.75;1.50;"
    assert row["samples_per_forward_max"] == "2;2;"
    assert row["node_busy"] == "0.500;0.250;0.250"
    # an old record (no batching keys at all): the columns are empty, the row is still ok
    old = make_row(exp, plan, 2, 1, _outcome([{"compute_seconds": 0.5}] * 3, tokens=plan.model.tokens), "off", "runs/y.json", 1)
    assert old["status"] == "ok" and old["max_batch"] == "1"
    assert all(old[c] == "" for c in ("rows_per_forward_mean", "rows_per_forward_max", "samples_per_forward_mean",
                                      "samples_per_forward_max"))


def _batched_rows(rates, nodes=3, partition="1+1+1"):
    """{(max_batch, S): rate} -> ok rows of one repeat."""
    rows = []
    for (mb, s), rate in sorted(rates.items(), key=lambda kv: (kv[0][1], str(kv[0][0]))):
        row = _ok_row(nodes, partition, s, str(rate), peak="10;10;10")
        row.update(max_batch=str(mb), samples_per_forward_mean="1.00;1.00;1.00" if mb == 1 else "4.00;4.00;4.00")
        rows.append(row)
    return rows


BATCH_RATES = {(1, 1): 10, ("auto", 1): 10, (1, 3): 24, ("auto", 3): 24, (1, 12): 20, ("auto", 12): 60}


def test_summary_keeps_batched_and_unbatched_apart():
    from mdi.lab.report_md import batching_lines
    summary = summarize(_batched_rows(BATCH_RATES))
    by = {(r["max_batch"], r["samples"]): r for r in summary}
    assert len(summary) == 6 and [(r["max_batch"], r["samples"]) for r in summary][:3] == [
        ("1", "1"), ("1", "3"), ("1", "12")]  # unbatched first, S ascending
    assert float(by["1", "12"]["decode_tokens_per_s_median"]) == 20
    assert float(by["auto", "12"]["decode_tokens_per_s_median"]) == 60
    # efficiency against the 1-sample runs of the same max_batch
    assert float(by["auto", "12"]["efficiency_median"]) == pytest.approx(60 / (3 * 10))
    assert float(by["auto", "12"]["speedup_vs_unbatched"]) == pytest.approx(3.0)
    assert by["1", "12"]["speedup_vs_unbatched"] == ""
    assert by["auto", "12"]["samples_per_forward_median"] == "4.00;4.00;4.00"
    (line,) = batching_lines(summary)
    assert "batched (auto): S=12 (4N) 60.00 tok/s = 3.00x unbatched at the same S" in line
    assert "2.50x the best unbatched (24.00 tok/s at S=3)" in line

    # without its own 1-sample runs a max_batch is measured against the unbatched ones
    rates = {k: v for k, v in BATCH_RATES.items() if k != ("auto", 1)}
    by = {(r["max_batch"], r["samples"]): r for r in summarize(_batched_rows(rates))}
    assert float(by["auto", "12"]["efficiency_median"]) == pytest.approx(60 / (3 * 10))

    # rows from before the max_batch column: one group per S as before
    old = [_ok_row(2, "1+1", s, r) for s, r in ((1, "10"), (2, "15"))]
    assert [(r["max_batch"], r["samples"]) for r in summarize(old)] == [("", "1"), ("", "2")]
    assert batching_lines(summarize(old)) == []


def test_report_table_has_a_max_batch_column(tmp_path):
    from mdi.lab.report_md import write_report
    path = tmp_path / "report.md"
    write_report(str(path), summarize(_batched_rows(BATCH_RATES)), {"experiment": {"name": "batching"}})
    text = path.read_text()
    assert "| nodes | partition | max_batch | backends | S=1 | S=3 | S=12 |" in text
    assert "| 3 | 1+1+1 | 1 | " in text and "| 3 | 1+1+1 | auto | " in text
    assert "Batched against unbatched" in text and "3.00x unbatched at the same S" in text


def test_throughput_plot_draws_one_line_per_max_batch(figures):
    figs = figures(_batched_rows(BATCH_RATES))
    rate, efficiency = figs["throughput_vs_samples.png"].axes
    for ax in (rate, efficiency):
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["unbatched", "batched (auto)"], ax.get_title()
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(t == int(t) for t in ticks), ticks
    # two rings and two max_batch values: the ring and the batching in each label
    rows = _batched_rows(BATCH_RATES) + _batched_rows({(1, 1): 8, (4, 1): 8, (1, 2): 12, (4, 2): 15}, 2, "2+1")
    figs = figures(rows)
    labels = [t.get_text() for t in figs["throughput_vs_samples.png"].axes[0].get_legend().get_texts()]
    assert labels == ["2 nodes (2+1), unbatched", "2 nodes (2+1), batched (4)",
                      "3 nodes (1+1+1), unbatched", "3 nodes (1+1+1), batched (auto)"]
    # one max_batch only: one line per ring, as before
    figs = figures([r for r in _batched_rows(BATCH_RATES) if r["max_batch"] == "auto"])
    assert [t.get_text() for t in figs["throughput_vs_samples.png"].axes[0].get_legend().get_texts()] == [
        "3 nodes (1+1+1)"]


def test_throughput_plot_file_with_two_max_batch_values(tmp_path):
    from mdi.lab import plots
    rows = _batched_rows(BATCH_RATES)
    path = plots.throughput_vs_samples(plots._pyplot(), str(tmp_path), summarize(rows), ["m"])
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    paths = plots.plot_all(str(tmp_path), rows, summarize(rows))  # the memory and time figures take them too
    assert [os.path.basename(p) for p in paths] == ["time_vs_tokens.png", "throughput_vs_samples.png",
                                                    "memory_per_node.png"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("on_torch")  # its models are float checkpoints without a GGUF
def test_a_run_past_its_timeout_fails_alone(tmp_path):
    """The warm starter of a run that timed out is ended: its late reply had answered the next
    run (recorded "failed: exit code 0" though it completed). 10 ms: no run finishes in time."""
    with open(SMOKE) as f:
        data = yaml.safe_load(f)
    model = [m for m in data["models"] if m["name"] == "tiny-llama"][0]
    model.pop("partitions")
    model.update(path=str(tmp_path / "models" / "tiny-llama"), nodes=[1], samples=[1, 2])
    data.update(models=[model], output=str(tmp_path / "out"), run_timeout=0.01, repeats=1, warmup=False)
    config = tmp_path / "late.yaml"
    config.write_text(yaml.safe_dump(data))
    r = _bench("--experiment", str(config), "--emulation", "off", timeout=280)
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        statuses = [row["status"] for row in csv.DictReader(f)]
    assert statuses == ["failed: starter did not answer within 0.01 s"] * 2, (statuses, r.stderr.decode()[-2000:])
    assert r.stderr.decode().count("starting a new one") == 1  # the second run's own starter


@pytest.mark.ring  # mdi-bench starts the workers
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("on_torch")  # its models are float checkpoints without a GGUF
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
        assert r["backends"].split(";") == ["torch"] * int(r["nodes"])  # what computed, beside what was asked
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
    assert json.loads((out / "machine.json").read_text())["ggml"].startswith("ggml ")

    os.remove(out / "memory_per_node.png")
    r = _bench("--experiment", str(config), "--plot-only")
    assert r.returncode == 0, r.stderr.decode()
    assert (out / "memory_per_node.png").is_file()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="board emulation needs root")
@pytest.mark.skipif(os.environ.get("CI") != "true" and cgroup_unavailable_reason() is not None,
                    reason="board emulation needs cgroup v1's cpu controller (CI has it; a cgroup-v2-only "
                           "machine, such as the GPU machine, does not)")
@pytest.mark.ring  # mdi-bench starts the workers
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("on_torch")  # its models are float checkpoints without a GGUF
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
    statuses = _bench_statuses(r, tmp_path / "out")
    assert r.returncode == 0 and statuses == ["ok"] * 60, (_bench_error(r), [s for s in statuses if s != "ok"][:3])


# --------------------------------------------------------------------------- quantized random models

TINY_Q = {"family": "llama", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2, "intermediate_size": 128,
          "vocab_size": 160, "block_size": 64, "seed": 3, "quant": "int4", "group_size": 32}


@pytest.mark.parametrize("random, needle", [
    (dict(TINY_Q, quant="int3"), "models[0].random.quant: expected one of int8, int4"),
    ({k: v for k, v in TINY_Q.items() if k != "quant"}, "models[0].random.group_size: a group size needs quant int8 or int4"),
    (dict(TINY_Q, group_size=48), "models[0].random.group_size: int4 groups are 32, 64, 128, not 48"),
    (dict(TINY_Q, gguf="q4_k"), "models[0].random: give quant (torch's int8/int4) or gguf (a GGUF type), not both"),
    (dict({k: v for k, v in TINY_Q.items() if k not in ("quant", "group_size")}, gguf="q3"),
     "models[0].random.gguf: expected one of f32, f16"),
])
def test_random_quant_schema_errors(random, needle):
    with pytest.raises(ExperimentError) as e:
        parse(model={"random": random})
    assert needle in str(e.value)


@pytest.mark.parametrize("model, needle", [
    ({"quant": "int2"}, "models[0].quant: expected one of none, auto, int8, int4"),
    ({"quant": "q4_k"}, "models[0].quant: expected one of none, auto, int8, int4, got 'q4_k' (a GGUF type is chosen "
                        "when the model is prepared"),
    ({"quant_kernel": "fastest"}, "models[0].quant_kernel: expected one of exact, fast"),
])
def test_run_quant_schema_errors(model, needle):
    with pytest.raises(ExperimentError) as e:
        parse(model=model)
    assert needle in str(e.value)


def test_a_backend_is_asked_per_model_and_a_wrong_one_is_named():
    assert parse().models[0].backend is None  # mdi's default: $MDI_BACKEND, else auto (the tests' own)
    assert [m.backend for m in parse({"backend": "torch"}, {"backend": "ggml"}).models] == ["ggml"]
    with pytest.raises(ExperimentError, match=r"x.yaml: backend: expected one of auto, ggml, torch, got 'cuda'"):
        parse({"backend": "cuda"})


def test_a_model_that_names_no_backend_runs_on_mdi_s_default(tmp_path, monkeypatch):
    """$MDI_BACKEND (the suite's torch, a user's ggml) had been overridden by an explicit auto in
    every run config (h80): a model naming none leaves runtime.backend to the starter's default,
    and the CSV says what that was."""
    from mdi.lab.nodes import Ring
    exp, plans = _batching_plan(tmp_path)
    ring = Ring(plans[0][0], exp, Emulation(EmulationSettings(mode="off"), 3), None, str(tmp_path), print)
    assert "backend" not in ring.run_config("auto")["runtime"]
    monkeypatch.setenv("MDI_BACKEND", "ggml")
    assert plans[0][0].model.asked_backend == "ggml"
    monkeypatch.setenv("MDI_BACKEND", "ggm")
    r = _bench("--experiment", SMOKE, "--dry-run", env=dict(os.environ))
    assert r.returncode == 2 and "$MDI_BACKEND must be one of auto, ggml, torch, got 'ggm'" in _bench_error(r)


@pytest.mark.ring  # mdi-bench starts the workers
@pytest.mark.timeout(300)
def test_a_random_gguf_model_runs_on_the_backend_asked(tmp_path):
    """`random: {gguf: q8_0}` writes a model.gguf by ggml's quantizer beside the weights, so big
    random shapes run on ggml too; `--backend` overrides the file's, the run config carries it, and
    the CSV says what was asked and what each node computed with. A rebuild with another type is
    refused, naming both."""
    model = {"name": "tiny-g", "path": str(tmp_path / "tiny-g"), "nodes": [2], "samples": [2],
             "random": {"family": "llama", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2,
                        "intermediate_size": 128, "block_size": 64, "seed": 0, "gguf": "q8_0"}}
    data = {"name": "g", "output": str(tmp_path / "out"), "models": [model], "tokens": 4, "repeats": 1,
            "warmup": False, "backend": "torch"}
    config = tmp_path / "g.yaml"
    config.write_text(yaml.safe_dump(data))
    r = _bench("--experiment", str(config), "--emulation", "off", "--backend", "ggml", timeout=240)
    assert r.returncode == 0, r.stderr.decode()
    assert (tmp_path / "tiny-g" / "model.gguf").is_file()
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["status"], row["backend"], row["backends"]) == ("ok", "ggml", "ggml;ggml")
    # what the weights were stored as, beside what was asked (`quant: auto`)
    assert row["weight_types"].startswith("ggml: ") and "Q8_0 x " in row["weight_types"]
    assert "; torch: int8/g32 x " in row["weight_types"], row["weight_types"]
    # a ggml node's weights are its GGUF tensors as stored (torch's sizes had overstated them)
    from mdi.lab.report import _mb
    from mdi.model.source import ModelSource
    source = ModelSource(str(tmp_path / "tiny-g"))
    starter, worker = source.gguf_bytes(0, 1, True, True), source.gguf_bytes(1, 2, False, False)
    assert row["weights_mb"] == "%s;%s" % (_mb(starter), _mb(worker))
    model["random"]["gguf"] = "q4_0"
    config.write_text(yaml.safe_dump(data))
    r = _bench("--experiment", str(config), "--emulation", "off", "--dry-run")
    assert r.returncode != 0 and "its model.gguf is q8_0, this spec gives q4_0" in _bench_error(r)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("on_torch")  # mdi's own int4 layout, built without a GGUF
def test_quantized_random_model_is_built_without_its_float_twin_and_runs(tmp_path, monkeypatch):
    """`random: {quant: int4}`: every quantizable weight stored as int4 (the sizes that
    layout.weight_bytes plans with), made one block of rows at a time (no float model), the
    same bytes on a rebuild, and mdi-start --model DIR --quant auto runs it."""
    import torch
    from safetensors import safe_open
    from mdi.lab import model_setup
    from mdi.lab.sweep import plan_sweep
    from mdi.model import layout, transformer
    from mdi.model.files.store import file_layout, read_mdi_config

    monkeypatch.setattr(transformer, "full_model", lambda *a, **k: pytest.fail("built the float model"))
    from mdi.model.quantization import quant
    blocks = []
    real_quantize = quant.quantize

    def counting_quantize(w, spec):
        blocks.append(tuple(w.shape))
        return real_quantize(w, spec)
    monkeypatch.setattr(quant, "quantize", counting_quantize)
    monkeypatch.setattr(model_setup, "ROWS_PER_BLOCK", 100)
    exp = parse(model={"path": str(tmp_path / "q"), "random": TINY_Q, "nodes": [2], "quant": "auto"})
    plans = plan_sweep(exp, lambda m: None)
    # quantized as drawn, 100 rows at a time at most: the 160-row head and embedding in two blocks
    assert (100, 64) in blocks and (60, 64) in blocks and max(rows for rows, _ in blocks) == 100

    path = str(tmp_path / "q")
    config = read_mdi_config(path)
    assert config.vocab_size == 160 and config.n_layer == 2
    stored = file_layout(path)
    want = set(layout.quantizable(config, (0, 2), True, True))
    # every quantizable weight, as mdi's int4 policy has it (quant.uniform_layout: the blocks
    # int4 in groups of 32; the embedding and head as that policy says)
    assert set(stored) == want and stored == quant.uniform_layout(config, (0, 2), True, True, "int4", 32)
    assert {s.label() for b, s in stored.items() if b.startswith("blocks.")} == {"int4/g32"}
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert tensors["blocks.0.mlp.down.qweight"].dtype == torch.uint8
    assert tuple(tensors["blocks.0.mlp.down.qweight"].shape) == (64, 64)  # [out, in / 2]
    assert tensors["blocks.1.attn.qkv.scales"].dtype == torch.float16
    assert tuple(tensors["blocks.1.attn.qkv.mins"].shape) == (128, 2)  # [out, in / 32]: q, k, v = 64 + 2 x 32 rows
    assert not any(k.endswith(".weight") and k[:-7] in want for k in tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert total == layout.weight_bytes(config, (0, 2), "float32", with_ends=True, quant=stored)
    # the sweep plans each node's weights at the quantized size too
    ring = plans[0][0]
    assert ring.weights == [layout.weight_bytes(config, r, "float32", with_ends=k == 0, quant=stored)
                            for k, r in enumerate(layout.layer_ranges(ring.counts))]
    # the tokenizer covers the whole vocabulary: every id the model samples decodes
    from mdi.model.tokenizers import load_tokenizer
    assert load_tokenizer(path).vocab_size == 160

    # deterministic: the same spec builds the same tensors; another spec at that path is refused
    again = str(tmp_path / "again")
    model_setup.build_random_model(again, "m", TINY_Q, "x.yaml")
    with safe_open(os.path.join(again, "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(tensors) and all(torch.equal(f.get_tensor(k), tensors[k]) for k in tensors)
    with pytest.raises(ExperimentError, match=r"exists but is not this random model \(its weights are stored as "
                                              r".*int4/g32 x 8.*, this spec gives .*int4/g64 x 8"):
        plan_sweep(parse(model={"path": path, "random": dict(TINY_Q, group_size=64), "nodes": [2]}), print)

    metrics = tmp_path / "m.json"
    monkeypatch.undo()
    r = subprocess.run([os.path.join(BIN, "mdi-start"), "--model", path, "--quant", "auto", "--prompt", "Hi",
                        "--backend", "torch", "--n-tokens", "5", "--temperature", "0", "--metrics-out", str(metrics), "--quiet"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=100, cwd=ROOT)
    assert r.returncode == 0, r.stderr.decode()
    record = json.loads(metrics.read_text())
    assert record["n_tokens"] == 5 and len(record["samples"][0]["token_ids"]) == 5


def test_quantized_random_gpt2_keeps_positions_float(tmp_path):
    """int8 per channel (no group_size); GPT-2's positions stay float, its biases are zeros."""
    from safetensors import safe_open
    from mdi.lab.model_setup import build_random_model
    from mdi.model import layout
    from mdi.model.files.store import file_layout, read_mdi_config
    spec = {"family": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16, "quant": "int8"}
    build_random_model(str(tmp_path), "g", spec, "x.yaml")
    config, stored = read_mdi_config(str(tmp_path)), file_layout(str(tmp_path))
    shapes = layout.quantizable(config, (0, 1), True, True)
    assert set(stored) == set(shapes) and "tok_emb" in stored  # the tied head
    assert all(s.kind == "int8" and s.group_size == shapes[b][1] for b, s in stored.items())  # per channel
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("pos_emb.weight").dtype.is_floating_point
        assert not f.get_tensor("blocks.0.attn.qkv.bias").any()
        total = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert total == layout.weight_bytes(config, (0, 1), "float32", with_ends=True, quant=stored)


def test_unquantized_random_spec_is_unchanged():
    """Without quant: the character vocabulary, no quantized weights (as before)."""
    from mdi.lab.model_setup import CHARS, random_model_config, random_quant_layout
    spec = {"family": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "seed": 0}
    config = random_model_config("m", spec)
    assert config.vocab_size == len(CHARS) and config.block_size == 256 and config.tied_head
    assert random_quant_layout(config, spec, "x") == {}


def test_cleanup_kills_a_leftover_node_only_if_its_pid_was_not_given_to_another_process(tmp_path, monkeypatch):
    import signal
    import tempfile
    from mdi.lab.sweep import cleanup_stale, process_started
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "mdi-worker"]) for _ in range(2)]
    try:
        ours, reused = procs
        dead = 4194303  # above any pid_max in use: the killed mdi-bench's PID, gone
        while os.path.exists("/proc/%d" % dead):
            dead -= 1
        (tmp_path / ("mdi-bench-state-%d.json" % dead)).write_text(json.dumps(
            {"pid": dead, "children": [[ours.pid, process_started(ours.pid)],
                                       [reused.pid, process_started(reused.pid) - 1]]}))  # started at another time
        logged = []
        assert cleanup_stale(logged.append) == 0
        assert ours.wait(timeout=60) == -signal.SIGKILL
        assert reused.poll() is None, "a process that took a recorded PID later was killed"
        assert logged[-1] == "mdi-bench: cleaned up after 1 stale run(s)"
        assert not list(tmp_path.glob("mdi-bench-state-*.json"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_runs_that_stopped_early_or_failed_are_counted_and_never_averaged_in(tmp_path):
    """A run whose samples stopped early was averaged in as an S-sample run (its decode rate
    that of the samples left), and a ring whose runs all failed vanished from summary.csv and
    report.md ("one node count only")."""
    from mdi.lab.report_md import write_report
    rows = [_ok_row(1, "2", 1, "10"), _ok_row(1, "2", 2, "18"),
            dict(_ok_row(1, "2", 2, "99"), repeat="2", status="ok (1 samples stopped early: eos)"),
            dict(_ok_row(2, "1+1", 2, ""), status="failed: node w1 (127.0.0.1:9): cannot connect"),
            dict(_ok_row(2, "1+1", 2, ""), repeat="2", status="failed: node w1 (127.0.0.1:9): cannot connect")]
    by = {(r["nodes"], r["samples"]): r for r in summarize(rows)}
    assert float(by["1", "2"]["decode_tokens_per_s_median"]) == 18  # the short run's 99 left out
    assert (by["1", "2"]["runs_ok"], by["1", "2"]["runs_short"], by["1", "2"]["runs_failed"]) == ("1", "1", "0")
    assert (by["2", "2"]["runs_ok"], by["2", "2"]["runs_failed"], by["2", "2"]["decode_tokens_per_s_median"]) == (
        "0", "2", "")
    path = tmp_path / "report.md"
    write_report(str(path), summarize(rows), {"experiment": {"name": "partial"}})
    text = path.read_text()
    assert "Runs left out of every number below: 2 failed, 1 stopped early" in text
    assert "2 nodes: no complete run (2 failed)" in text and "one node count measured" in text
    assert "no complete run (2 failed)" in text.split("| 2 | 1+1 |")[1].splitlines()[0]


def test_every_results_record_names_the_commit_that_measured():
    """mdi-bench's machine.json did; the benchmark scripts' records did not (90 of 105 files)."""
    import subprocess
    from mdi.lab.report import code_revision, machine_record
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert code_revision()["git_commit"] == head and machine_record("x.yaml")["git_commit"] == head
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import benchlib
        assert benchlib.machine_info(1)["git_commit"] == head
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))


def test_a_sweep_into_a_folder_of_an_earlier_one_moves_its_outputs_aside_first(tmp_path):
    """A second sweep rewrites results.csv from its first run: stopped before its first row, it
    had left the earlier report.md, summary.csv and plots describing rows that were gone."""
    from mdi.lab.sweep import keep_earlier_sweep
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "profiles").mkdir()
    for name in ("results.csv", "summary.csv", "report.md", "machine.json", "tokens_per_s.png"):
        (out / name).write_text(name)
    (out / "notes.txt").write_text("mine")
    lines = []
    keep_earlier_sweep(str(out), lines.append)
    aside = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1 and sorted(p.name for p in out.iterdir()) == sorted(["notes.txt", aside[0].name])
    assert (aside[0] / "report.md").read_text() == "report.md" and (aside[0] / "runs").is_dir()
    assert (aside[0] / "profiles").is_dir()
    assert lines == ["mdi-bench: %s held an earlier sweep's results: moved to %s" % (out, aside[0])]
    keep_earlier_sweep(str(out), lines.append)  # nothing of a sweep left: nothing moved
    assert len(lines) == 1


def test_every_result_file_says_where_it_was_measured_and_an_interrupted_sweep_says_so(tmp_path):
    """report.md (the file people publish) names the CPU, the ISA torch and ggml use on it and
    the commit; summary.csv and report.md name each ring's backends (both ways where runs of
    one group differed); a sweep stopped early says so first, with the runs it made."""
    from mdi.lab.report import machine_record
    from mdi.lab.report_md import write_report
    rows = [dict(_ok_row(2, "1+1", 1, "10"), backends="ggml;ggml"),
            dict(_ok_row(2, "1+1", 1, "12"), backends="ggml;torch", repeat="2")]
    summary = summarize(rows)
    assert summary[0]["backends"] == "ggml;ggml / ggml;torch"
    machine = dict(machine_record("exp.yaml"), experiment={"name": "x"}, interrupted=True, runs=2, runs_planned=9)
    if not machine["ggml"].startswith("unavailable"):
        assert machine["ggml_cpu_features"] and all(isinstance(f, str) for f in machine["ggml_cpu_features"])
    path = tmp_path / "report.md"
    write_report(str(path), summary, machine)
    text = path.read_text()
    assert text.splitlines()[2] == "**Interrupted**: 2 of 9 runs made; every figure below is from those only."
    line = next(l for l in text.splitlines() if l.startswith("Machine: "))
    assert machine["cpu_model"] in line and "ISA %s" % machine["cpu"]["isa"] in line
    assert machine["git_commit"][:12] in line
    assert "| 2 | 1+1 | - | ggml;ggml / ggml;torch | " in text
    write_report(str(path), summary, dict(machine, interrupted=False))
    assert "Interrupted" not in path.read_text()


def test_a_sample_range_empty_for_a_node_count_is_refused_naming_the_ring(tmp_path, smollm2_dir):
    config = tmp_path / "empty.yaml"
    config.write_text(yaml.safe_dump({"output": str(tmp_path / "out"), "repeats": 1, "emulation": {"enabled": False},
                                      "models": [{"name": "s", "path": smollm2_dir, "tokens": 4, "nodes": [1, 3],
                                                  "samples": ["N..2"]}]}))
    r = _bench("--experiment", str(config), "--dry-run")
    assert r.returncode != 0
    assert _bench_error(r) == ("mdi-bench: error: %s: models[0].samples: no sample count for the 3-node ring "
                               "(N..2 at N=3)" % config)


def test_a_sweep_that_measured_no_node_count_says_so():
    from mdi.lab.report_md import scaling_lines
    failed = [dict(_ok_row(n, "auto", n, ""), status="failed") for n in (1, 2)]
    (line,) = scaling_lines(summarize(failed))
    assert line.endswith(": no node count measured") and "1 node: no complete run (1 failed)" in line


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_board_stopped_with_a_signal_stops_its_command_and_removes_its_cgroup(tmp_path, signum):
    """`python -m mdi.lab.board` forwards SIGTERM to its command and ends it on Ctrl-C (a
    SIGINT to the board alone): the command had run on, orphaned inside the board's memory
    limit, and the cgroup stayed behind."""
    marker = "mdi-board-test-%d" % os.getpid()
    board = subprocess.Popen([sys.executable, "-m", "mdi.lab.board", "--memory-mb", "256", "--",
                              sys.executable, "-c", "import time; time.sleep(120)  # " + marker],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    children = []  # the command (and any wrapper of it): every process naming the marker but the board
    try:
        deadline = time.monotonic() + 60
        while not children and board.poll() is None and time.monotonic() < deadline:
            found = subprocess.run(["pgrep", "-f", marker], stdout=subprocess.PIPE, text=True).stdout.split()
            children = [int(p) for p in found if int(p) != board.pid]
            time.sleep(0.2)
        if not children:
            err = board.communicate(timeout=60)[1].decode()
            pytest.skip("no board here (cgroup v1 and root needed): %s" % err.strip()[-200:])
        board.send_signal(signum)
        assert board.wait(timeout=60) != 0
        for child in children:
            assert not os.path.exists("/proc/%d" % child) or open("/proc/%d/stat" % child).read().split()[2] == "Z"
        if signum == signal.SIGTERM:
            assert "killed by signal 15" in board.stderr.read().decode() + board.stdout.read().decode()
    finally:
        if board.poll() is None:
            board.kill()
            board.wait()
        for child in children:
            if os.path.exists("/proc/%d" % child):
                os.kill(child, signal.SIGKILL)


def test_a_report_on_one_repeat_or_a_loaded_machine_says_to_read_it_with_caution(tmp_path):
    """A verdict such as "does NOT rise with N" from one repeat at a load of 4 on 2 CPUs had been
    printed as a result (h79); report.md now says why it is only an indication."""
    from mdi.lab.report_md import write_report
    summary = summarize([_ok_row(2, "1+1", 1, "10")])
    path = tmp_path / "report.md"
    quiet = {"experiment": {"name": "x", "repeats": 3}, "cpu_count": 2, "loadavg_start": [0.5, 0.5, 0.5],
             "loadavg_end": [1.0, 1.0, 1.0]}
    three = summarize([dict(_ok_row(2, "1+1", 1, "10"), repeat=str(k)) for k in (1, 2, 3)])
    write_report(str(path), three, quiet)
    assert "Caution" not in path.read_text()
    write_report(str(path), summary, dict(quiet, experiment={"name": "x", "repeats": 1}, loadavg_end=[4.0, 2, 1]))
    line = next(l for l in path.read_text().splitlines() if l.startswith("**Caution**"))
    assert "1 complete run of a figure" in line and "load of 4.0 on 2 CPUs" in line
    # 3 repeats planned, but a sweep cut short (or runs that failed) left one run of a figure
    write_report(str(path), summary, quiet)
    assert "Caution**: 1 complete run of a figure" in path.read_text()


def test_a_random_model_whose_build_fails_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """A random.gguf build that failed (no ggml, a full disk) had been a traceback, and its half-built
    folder was refused by every later sweep (h80)."""
    from mdi.lab import model_setup
    from mdi.lab.spec import ModelEntry
    from mdi.model.files import prepare
    from mdi.model.layout import CheckpointError

    def no_ggml(*args, **kwargs):
        raise CheckpointError("--quant q8_0: ggml writes that type and its binding is not installed")
    monkeypatch.setattr(prepare, "prepare", no_ggml)
    path = tmp_path / "tiny"
    entry = ModelEntry("tiny", str(path), random={"family": "llama", "n_layer": 1, "n_embd": 32, "n_head": 4,
                                                  "gguf": "q8_0"})
    with pytest.raises(ExperimentError, match=r"^m\.random: building .*tiny failed: --quant q8_0: ggml writes"):
        model_setup.ensure_model(entry, "m", str(tmp_path / "x.yaml"), print)
    assert sorted(os.listdir(str(tmp_path))) == []


def test_random_models_are_checked_by_their_spec_not_their_name_and_ggml_needs_a_gguf(tmp_path):
    """h81: one random model listed twice under two names (to run it on two backends) had been
    refused as "not this random model"; a new seed on a model with a GGUF was silently ignored;
    `backend: ggml` on a model without a GGUF started every run's ring, then failed them all."""
    from mdi.lab import model_setup
    from mdi.lab.spec import ModelEntry
    from mdi.lab.sweep import plan_sweep
    spec = {"family": "llama", "n_layer": 2, "n_embd": 32, "n_head": 4, "n_kv_head": 2, "intermediate_size": 64,
            "block_size": 64, "seed": 0, "gguf": "q8_0"}
    path = str(tmp_path / "tiny")
    model_setup.ensure_model(ModelEntry("first", path, random=spec), "m", str(tmp_path / "x.yaml"), print)
    model_setup.ensure_model(ModelEntry("second", path, random=spec), "m", str(tmp_path / "x.yaml"), print)
    with pytest.raises(ExperimentError, match=r"not this random model \(it was built with seed 0\)"):
        model_setup.ensure_model(ModelEntry("first", path, random=dict(spec, seed=7)), "m", str(tmp_path / "x.yaml"),
                                 print)
    plain = {k: v for k, v in spec.items() if k != "gguf"}
    exp = parse_experiment({"models": [{"name": "p", "path": str(tmp_path / "plain"), "random": plain,
                                        "backend": "ggml"}]}, "x.yaml")
    with pytest.raises(ExperimentError, match=r"models\[0\].backend: ggml computes the model's GGUF and .* has none"):
        plan_sweep(exp, print, build=False)


def test_an_auto_ring_the_planner_shrank_says_on_how_many_nodes_its_figure_was_measured():
    """An auto ring of 2 whose planner left a node out had been reported as "2 nodes ... rises
    with N" from one node's runs (h81): the CSV's active_nodes and the report say so."""
    from mdi.lab.report_md import scaling_lines
    rows = [dict(_ok_row(1, "4", 1, "10")), dict(_ok_row(2, "auto", 2, "12"), active_nodes="1")]
    summary = summarize(rows)
    assert [r["active_nodes"] for r in summary] == ["1", "1"]
    (line,) = scaling_lines(summary)
    assert "2 nodes 12.00 tok/s (S=2, auto, computed on 1 of the 2 nodes: the planner left the others out)" in line
    assert "computed on" not in line.split(";")[0]  # the 1-node figure is as asked
