"""Bad input gets one clear line and a non-zero exit, never a traceback."""
import json
import os
import subprocess

import pytest

import requests

from conftest import BIN, WorkerProcess, free_ports

STARTER = os.path.join(BIN, "mdi-start")


def mdi_start(*args, timeout=60):
    return subprocess.run([STARTER] + list(args), capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc, *needles, code=2):
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mdi: error:"), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, needles", [
    ("model: {dtype: float32}\n", ["model.path", "missing"]),
    ("model: {path: x, dtpye: float32}\n", ["dtpye", "unknown key"]),
    ("model: {path: x, dtype: float64}\n", ["model.dtype", "float64"]),
    ("model: {path: x}\ngeneration: {n_tokens: ten}\n", ["generation.n_tokens", "integer"]),
    ("model: {path: x}\ngeneration: {temperature: true}\n", ["generation.temperature"]),
    ("model: {path: x}\nnodes:\n  - {name: a, port: 1}\n  - {name: a, port: 2}\n", ["listed twice"]),
    ("model: {path: x}\nnodes:\n  - {name: a, port: 1}\n  - {name: b, port: 7}\n  - {name: c, port: 7}\n",
     ["listed twice"]),
    ("model: {path: x}\nnodes:\n  - {name: a, layers: 2}\n  - {name: b, port: 9}\n", ["every node"]),
    ("model: [unclosed\n", ["invalid YAML", "line"]),
    ("- just\n- a list\n", ["expected a mapping"]),
])
def test_config_errors_name_the_key(tmp_path, text, needles):
    path = write(tmp_path, text)
    proc = mdi_start("--config", path, "--prompt", "x")
    assert_one_line_error(proc, path, *needles)


def test_missing_config_file(tmp_path):
    assert_one_line_error(mdi_start("--config", str(tmp_path / "nope.yaml"), "--prompt", "x"), "not found")


def test_missing_checkpoint(tmp_path):
    path = write(tmp_path, "model: {path: %s}\n" % (tmp_path / "no-model"))
    assert_one_line_error(mdi_start("--config", path, "--prompt", "x"), "does not exist")
    # a relative one: the config file is named, with where it was looked for (h79)
    path = write(tmp_path, "model: {path: models/no-model}\n")
    assert_one_line_error(mdi_start("--config", path, "--prompt", "x"), "%s: model.path: model path models/no-model "
                          "does not exist (looked from the current folder, %s and " % (path, tmp_path))


def test_a_missing_model_is_said_before_a_missing_prompt_and_no_internal_name_shows(tmp_path, tiny_models):
    assert_one_line_error(mdi_start("--model", str(tmp_path / "nothere.gguf")), "model path", "does not exist")
    assert_one_line_error(mdi_start("--model", tiny_models["gpt2"]),
                          "no prompt: give --prompt TEXT (or generation.prompts in a --config file)")


def test_quiet_prints_the_summary_line_and_no_start_up_notes(tiny_models):
    proc = mdi_start("--model", tiny_models["gpt2"], "--prompt", "ab", "--n-tokens", "3", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("mdi: 3 tokens in ") and len(proc.stdout.splitlines()) == 1, proc.stdout
    assert "backend" not in proc.stderr, proc.stderr  # the start-up notes (info) are not shown
    loud = mdi_start("--model", tiny_models["gpt2"], "--prompt", "ab", "--n-tokens", "3")
    assert loud.returncode == 0 and "mdi: backends: starter" in loud.stderr, loud.stderr


def test_partition_must_sum_to_layers(tmp_path, tiny_models):
    path = write(tmp_path, "model: {path: %s}\nnodes:\n  - {name: s, layers: 2}\n  - {name: w, port: 9, layers: 3}\n"
                 % tiny_models["gpt2"])
    assert_one_line_error(mdi_start("--config", path, "--prompt", "x"), "sums to 5", "4 layers")


def test_prompt_longer_than_context(tmp_path, tiny_models):
    path = write(tmp_path, "model: {path: %s}\n" % tiny_models["llama"])
    assert_one_line_error(mdi_start("--config", path, "--prompt", "x" * 500), "context")


def test_unknown_character_for_char_tokenizer(tmp_path, tiny_models):
    path = write(tmp_path, "model: {path: %s}\n" % tiny_models["llama"])
    proc = mdi_start("--config", path, "--prompt", "snow \u2603")
    assert_one_line_error(proc)


def test_worker_not_running_is_reported_quickly(tmp_path, tiny_models):
    port, data = free_ports(2)
    # Refused at the first connection: no timeout could end it before the hang guard (Python and
    # torch alone took 10 s to start on a loaded 2-core box, so a wall-clock bound would flake).
    path = write(tmp_path, "model: {path: %s}\nnodes:\n  - {name: s, data_port: %d}\n  - {name: board9, port: %d}\n"
                 "runtime: {connect_timeout: 3600, init_timeout: 3600}\n" % (tiny_models["gpt2"], data, port))
    metrics = tmp_path / "m.json"
    proc = mdi_start("--config", path, "--prompt", "x", "--metrics-out", str(metrics), timeout=300)
    assert_one_line_error(proc, "board9", "127.0.0.1:%d" % port, code=1)
    import json
    record = json.loads(metrics.read_text())  # a run that never started still leaves its record, saying why
    assert record["stage"] == "start-up" and "board9" in record["error"]
    assert [s["prompt"] for s in record["samples"]] == ["x"] and record["n_tokens"] == 0


def test_n_samples_repeats_prompts_and_standalone_metrics(tmp_path, tiny_models):
    import json
    path = write(tmp_path, "model: {path: %s}\ngeneration: {n_tokens: 5, temperature: 0}\n" % tiny_models["gpt2"])
    metrics = tmp_path / "m.json"
    proc = mdi_start("--config", path, "--prompt", "ab", "--prompt", "cd", "--n-samples", "3",
                     "--metrics-out", str(metrics))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(metrics.read_text())
    assert [s["prompt"] for s in record["samples"]] == ["ab", "cd", "ab"]
    assert record["samples"][0]["token_ids"] == record["samples"][2]["token_ids"]
    assert record["n_nodes"] == 1 and record["nodes"][0]["layers"] == [0, 4]
    assert record["startup_seconds"] > 0  # reading, planning and loading, before the first token's time
    assert "mdi: 15 tokens" in proc.stdout


@pytest.mark.parametrize("args, needle", [(["--draft-max", "0"], "--draft-max"), (["--n-tokens", "x"], "--n-tokens"),
                                         (["--bogus"], "unrecognized arguments: --bogus")])
def test_bad_flags_get_one_line_not_the_usage_block(args, needle):
    assert_one_line_error(mdi_start("--model", "m", "--prompt", "a", *args), needle, "mdi-start --help")


def test_a_prompt_that_is_not_utf8_is_one_line(tiny_models):
    """Bytes that are not UTF-8 on the command line (Python keeps them as lone surrogates) are
    refused by name before anything loads: they had given a tokenizer's traceback, or wrong
    byte tokens and then a crash writing the metrics."""
    proc = subprocess.run([STARTER.encode(), b"--model", tiny_models["llama"].encode(), b"--prompt", b"ab",
                           b"--prompt", b"abc\xff\xfedef", b"--n-tokens", b"2"], capture_output=True, timeout=60)
    lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0] == "mdi: error: --prompt 2 is not UTF-8 text (byte 0xff at character 3)"


@pytest.mark.parametrize("yaml_text, needle", [
    ("model: {path: m}\nruntime: {ring_timeout: .nan}\n", "runtime.ring_timeout: expected a finite number"),
    ("model: {path: m}\nruntime: {connect_timeout: .inf}\n", "runtime.connect_timeout: expected a finite number"),
    ("model: {path: m}\ngeneration: {temperature: 0}\ngeneration: {n_tokens: 3}\n",
     "key 'generation' appears twice"),
    (b"model: {path: m}\n# caf\xe9\n", "not UTF-8 text (byte 0xe9"),
    ("model: {path: m}\nnodes:\n  - {name: s, port: 8080}\n  - {name: w, port: 9001, data_port: 9001}\n",
     "nodes[1]: data port 9001 on 127.0.0.1 is also nodes[1]'s HTTP port"),
    ("model: {path: m, quant: Q8_0}\n",
     "model.quant: expected one of none, auto, int8, int4, got 'Q8_0' (a GGUF type is chosen when the model is "
     "prepared: mdi-prepare PATH --quant q8_0"),
])
def test_a_config_that_would_hang_or_mislead_is_one_line(tmp_path, yaml_text, needle):
    """NaN and infinite timeouts passed every `<= 0` check (a ring timeout of NaN waited for
    ever); a key given twice kept its last value silently (temperature 0 dropped); a file that
    is not UTF-8 was a traceback."""
    path = tmp_path / "c.yaml"
    (path.write_bytes if isinstance(yaml_text, bytes) else path.write_text)(yaml_text)
    assert_one_line_error(mdi_start("--config", str(path), "--prompt", "a"), str(path), needle)


@pytest.mark.parametrize("args, needle", [
    (["--threads", "0"], "argument --threads: expected an integer >= 1"),
    (["--n-tokens", "0"], "mdi: error: --n-tokens: expected a positive integer"),  # the flag, not a YAML key
    (["--top-p", "2"], "mdi: error: --top-p: expected a number in (0, 1]"),
    (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N"),
    (["--quant", "q4_k"], "got 'q4_k' (a GGUF type is chosen when the model is prepared: mdi-prepare PATH "
                          "--quant q4_k"),
    (["--quant", "Q4_K_M"], "got 'Q4_K_M' (a GGUF type is chosen when the model is prepared: mdi-prepare PATH "
                            "--quant q4_k"),  # llama.cpp's mix: its base type, which mdi-prepare writes
    (["--kv-type", "float8"], "argument --kv-type: expected one of f16, q8_0, f32, got 'float8'"),
    (["--check", "--serve"], "--serve does not go with --check"),
    (["--check", "--metrics-out", "m.json"], "--metrics-out does not go with --check"),
    (["--metrics-out", "/dev/null/m.json"], "--metrics-out /dev/null/m.json: /dev/null is a file, not a directory"),
    (["--metrics-out", "/"], "--metrics-out /: is a directory"),
    (["--quant", "int4", "--group-size", "48"], "group_size 48: int4 groups are 32, 64, 128, not 48"),
    (["--check", "--port", "9000"], "--port goes with --serve"),  # --check and --perplexity had ignored them
    (["--perplexity", "x.txt", "--host", "0.0.0.0", "--insecure"], "--host and --insecure go with --serve"),
    (["--draft-max", "4"], "--draft-max: speculation is off (give --speculation ngram or draft:PATH too)"),
])
def test_flags_that_cannot_work_are_refused_before_the_run(tiny_models, args, needle):
    """(An unwritable --metrics-out had been a traceback after the whole run, its record lost.)"""
    assert_one_line_error(mdi_start("--model", tiny_models["llama"], "--prompt", "a", "--n-tokens", "2", *args), needle)


def test_check_says_a_worker_held_by_another_run_is_busy(tmp_path, tiny_models):
    """A serving starter holds its workers: --check of another ring on one of them says BUSY (its
    /init would be refused with a 409) and exits 1, where it had said "all nodes ready"."""
    from conftest import ServeProcess
    from ringconfigs import write_run_config
    worker = WorkerProcess(free_ports(1)[0]).wait_ready()
    server = None
    try:
        server = ServeProcess(write_run_config(tmp_path / "serve.yaml", tiny_models["llama"], [worker])).wait_ready()
        proc = mdi_start("--config", write_run_config(tmp_path / "check.yaml", tiny_models["llama"], [worker]),
                         "--check")
        assert proc.returncode == 1 and "problems found" in proc.stdout, proc.stdout + proc.stderr
        assert any("BUSY: run" in line for line in proc.stdout.splitlines()), proc.stdout
        # a run on it is refused by its /backend, before the starter builds the node's weights
        proc = mdi_start("--config", str(tmp_path / "check.yaml"), "--prompt", "x")
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert "/backend" in lines[0] and "busy with run" in lines[0], lines[0]
    finally:
        if server is not None:
            server.stop()
        worker.stop()


def test_help_explains_flags():
    proc = subprocess.run([STARTER, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--n-samples" in proc.stdout and "--metrics-out" in proc.stdout
    proc = subprocess.run([os.path.join(BIN, "mdi-worker"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--port" in proc.stdout


def test_check_reports_every_node_without_generating(tmp_path, tiny_models, workers):
    dead, limited, modest, cramped = free_ports(4)
    small = WorkerProcess(limited, extra=("--max-memory", "0.00001")).wait_ready()  # ~10 kB
    board = WorkerProcess(modest, extra=("--max-memory", "0.2")).wait_ready()  # 200 MB
    too_small = WorkerProcess(cramped, extra=("--max-memory", "0.00001")).wait_ready()  # a spare of ~10 kB
    try:
        nodes = "\n".join("  - {name: %s, port: %d}" % (n, p) for n, p in
                          [("starter", 8080), ("ok1", workers[0].port), ("tiny", limited), ("board", modest)])
        path = write(tmp_path, "model: {path: %s}\nnodes:\n%s\nspares:\n  - {name: gone, port: %d}\n"
                     "  - {name: extra, port: %d, backend: ggml}\n  - {name: cramped, port: %d}\n"
                     % (tiny_models["llama"], nodes, dead, workers[1].port, cramped))
        proc = mdi_start("--config", path, "--check", "--prompt", "hello")
    finally:
        small.stop()
        board.stop()
        too_small.stop()
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "fits" in lines["ok1"] and "v" in lines["ok1"] and "cpu" in lines["ok1"]
    # each node's CPU (its ISA decides which kernels win) and the kernels its load will measure
    from mdi.model.quantization import qkernels
    from mdi.system.cpu import cpu_info
    here = "kernels to measure: %s" % ", ".join(qkernels.offered_on("cpu"))
    for name in ("starter", "ok1"):
        assert "cpu %s" % cpu_info()["isa"] in lines[name], lines[name]
        # torch's kernels are measured on a torch node only (MDI_BACKEND=ggml runs this too)
        if "backend ggml" in lines[name]:
            assert "kernels to measure" not in lines[name], lines[name]
        else:
            assert here in lines[name], lines[name]
    assert "DOES NOT FIT" in lines["tiny"]
    # layers that fit a 200 MB budget, and torch's own memory beside them does not: said, as TIGHT
    assert "fits" in lines["board"] and ("TIGHT" in lines["board"]) == ("backend torch" in lines["board"])
    assert "TIGHT" not in lines["ok1"]
    assert "UNREACHABLE" in lines["gone"] and str(dead) in lines["gone"]
    # a spare's line names the backend it is asked for, and torch's kernels only where it may use them
    assert "backend ggml (asked)" in lines["extra"] and "kernels to measure" not in lines["extra"], lines["extra"]
    # a spare is checked against the smallest worker's layers, as recovery asks it (h96: one that
    # could hold none was said to fit, and recovery then took it)
    assert "the smallest worker's layers need" in lines["extra"] and "fits" in lines["extra"], lines["extra"]
    assert "DOES NOT FIT" in lines["cramped"], lines["cramped"]
    assert "problems found" in proc.stdout
    assert requests.get(workers[0].url + "/status", timeout=5).json()["state"] in ("idle", "stopped")


def test_check_fails_on_a_device_the_starter_cannot_use(tmp_path, tiny_models):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: cuda is usable")
    path = write(tmp_path, "model: {path: %s, device: cuda}\n" % tiny_models["llama"])
    proc = mdi_start("--config", path, "--check")
    assert proc.returncode == 1 and "starter: UNUSABLE: cuda: this node's torch sees no CUDA GPU" in proc.stdout, \
        proc.stdout + proc.stderr
    assert "problems found" in proc.stdout


def test_check_says_refused_for_a_worker_that_answers_and_cannot_run_the_config(tmp_path, tiny_models, workers):
    """A worker whose POST /backend refused `device: cuda` (its torch sees no GPU) was reported
    UNREACHABLE, which the Jetson README reads as a wrong token, a stopped service or a firewall."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: cuda is usable")
    path = write(tmp_path, "model: {path: %s}\nnodes:\n  - {name: starter, port: 8080}\n"
                 "  - {name: board1, port: %d, device: cuda}\n" % (tiny_models["llama"], workers[0].port))
    proc = mdi_start("--config", path, "--check")
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert proc.returncode == 1 and "REFUSED: " in lines["board1"] and "no CUDA GPU" in lines["board1"], proc.stdout


def test_progress_line_on_a_terminal(capsys, monkeypatch):
    # A batch run on a terminal shows tokens and tokens/s as it goes (one self-overwriting line).
    from mdi.cli.progress import Progress
    progress = Progress(n_samples=2, n_tokens=5)
    monkeypatch.setattr(Progress, "EVERY", 0.0)
    for _ in range(3):
        progress(None, 7)
    progress.close()
    err = capsys.readouterr().err
    assert "\rmdi: 3/10 tokens" in err and "tokens/s" in err and err.endswith("\r\033[K")


def test_an_output_that_is_a_device_a_fifo_or_a_link_is_written_through(tiny_models, tmp_path):
    """--metrics-out (and every record mdi writes) went to a temporary file renamed over the
    path: run as root, `--metrics-out /dev/null` replaced the system's /dev/null with a plain
    file, and a link was replaced by a file instead of its target being written."""
    import stat
    import threading
    from mdi.system.files import output_problem, write_json
    if os.geteuid() == 0:  # a null device of the test's own (a regression must not clobber the system's)
        null = str(tmp_path / "null")
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        proc = mdi_start("--model", tiny_models["llama"], "--prompt", "a", "--n-tokens", "2", "--metrics-out", null)
        assert proc.returncode == 0, proc.stderr
        assert stat.S_ISCHR(os.stat(null).st_mode)
    # /dev/stdout of a run whose output goes to a log file: the log keeps its lines, the record follows
    log = tmp_path / "runs.log"
    log.write_text("an earlier run\n")
    with open(str(log), "a") as out:
        subprocess.run([STARTER, "--model", tiny_models["llama"], "--prompt", "a", "--n-tokens", "2", "--metrics-out",
                        "/dev/stdout"], stdout=out, stderr=subprocess.PIPE, timeout=60, check=True)
    text = log.read_text()
    assert text.startswith("an earlier run\n") and "tokens/s" in text and '"n_tokens"' in text, text
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    assert output_problem(fifo) is None
    write_json(fifo, {"a": 1})
    reader.join(30)
    assert json.loads(got[0]) == {"a": 1} and stat.S_ISFIFO(os.stat(fifo).st_mode)
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    link.symlink_to(target)
    write_json(str(link), {"b": 2})
    assert link.is_symlink() and json.loads(target.read_text()) == {"b": 2}


def test_speculation_off_on_the_command_line_turns_a_config_s_off(tmp_path):
    """--speculation off had been refused as "--draft-max: speculation is off" (h73)."""
    from mdi.cli.start import _config_from_args, start_parser
    config = write(tmp_path, "model: {path: m}\ngeneration: {speculation: ngram}\n")
    cfg = _config_from_args(start_parser().parse_args(["--config", config, "--speculation", "off"]))
    assert cfg.generation.speculation.method == "off"
    cfg = _config_from_args(start_parser().parse_args(["--config", config, "--draft-max", "3"]))
    assert (cfg.generation.speculation.method, cfg.generation.speculation.max_draft) == ("ngram", 3)
