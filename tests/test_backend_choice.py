"""How a node's backend is chosen (mdi.model.backend.choose), with the measurements faked: an
asked backend that cannot serve is one line saying why; auto measures the backends that can
serve, keeps the cheaper for the run's work, remembers it per machine, and measures again a
choice it made while the machine was busy once the machine is quiet."""
import os
import pytest

from mdi.model import backend
from mdi.model.backend import BackendTiming, choose

FAST = BackendTiming(decode_s=0.001, prefill_token_s=0.0002)
SLOW = BackendTiming(decode_s=0.002, prefill_token_s=0.0004)
KEY = {"model": "tiny", "threads": 1}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MDI_PROFILE_CACHE", str(tmp_path))
    return tmp_path


def measuring(timings):
    calls = []

    def measure(name):
        calls.append(name)
        return timings[name]
    return measure, calls


def test_an_asked_backend_that_cannot_serve_says_why(cache):
    with pytest.raises(ValueError, match="backend ggml cannot run here: the model has no GGUF"):
        choose("ggml", {"ggml": "the model has no GGUF", "torch": None}, measuring({})[0])
    got = choose("torch", {"ggml": None, "torch": None}, measuring({})[0])
    assert (got.backend, got.describe()) == ("torch", "torch (asked)")


def test_auto_with_one_able_backend_measures_nothing(cache):
    measure, calls = measuring({})
    got = choose("auto", {"ggml": "the model has no GGUF", "torch": None}, measure, KEY)
    assert got.backend == "torch" and calls == []
    assert got.describe() == "torch (auto: ggml cannot: the model has no GGUF)"


def test_auto_keeps_the_cheaper_and_recalls_it(cache, monkeypatch):
    monkeypatch.setattr(backend, "machine_load", lambda: 0.2)
    measure, calls = measuring({"ggml": SLOW, "torch": FAST})
    first = choose("auto", {"ggml": None, "torch": None}, measure, KEY)
    assert first.backend == "torch" and sorted(calls) == ["ggml", "torch"] and not first.cached
    assert "2.00x faster" in first.reason and "busy" not in first.describe()
    second = choose("auto", {"ggml": None, "torch": None}, measure, KEY)
    assert second.backend == "torch" and second.cached and len(calls) == 2
    assert second.describe().startswith("torch (auto, recalled: decode 2.00 ms vs 1.00 ms per block")
    other = choose("auto", {"ggml": None, "torch": None}, measure, dict(KEY, threads=2))
    assert not other.cached and len(calls) == 4  # other shapes or threads: measured anew


def test_a_node_busy_with_a_run_does_not_measure_but_recalls(cache, monkeypatch):
    """A worker holding another starter's run answers POST /backend from memory, or refuses
    (409 there) rather than take every core for seconds beside that run."""
    monkeypatch.setattr(backend, "machine_load", lambda: 0.2)
    measure, calls = measuring({"ggml": SLOW, "torch": FAST})
    with pytest.raises(backend.WouldMeasure, match="busy with run 7"):
        choose("auto", {"ggml": None, "torch": None}, measure, KEY, busy="busy with run 7")
    assert calls == []
    choose("auto", {"ggml": None, "torch": None}, measure, KEY)  # measured between runs
    again = choose("auto", {"ggml": None, "torch": None}, measure, KEY, busy="busy with run 8")
    assert again.backend == "torch" and again.cached and len(calls) == 2
    asked = choose("ggml", {"ggml": None, "torch": None}, measure, busy="busy with run 8")  # nothing to measure
    assert asked.backend == "ggml"


def test_a_choice_made_on_a_busy_machine_is_measured_again_once_it_is_quiet(cache, monkeypatch):
    load = {"now": 1.8}
    monkeypatch.setattr(backend, "machine_load", lambda: load["now"])
    measure, calls = measuring({"ggml": SLOW, "torch": FAST})
    busy = choose("auto", {"ggml": None, "torch": None}, measure, KEY)
    assert "while the machine was busy (load 1.8 per core)" in busy.describe()
    recalled = choose("auto", {"ggml": None, "torch": None}, measure, KEY)  # still busy: recalled, said so
    assert recalled.cached and len(calls) == 2 and "busy" in recalled.describe()
    load["now"] = 0.1
    measure, calls = measuring({"ggml": FAST, "torch": SLOW})
    quiet = choose("auto", {"ggml": None, "torch": None}, measure, KEY)
    assert quiet.backend == "ggml" and not quiet.cached and len(calls) == 2
    assert "busy" not in quiet.describe()
    again = choose("auto", {"ggml": None, "torch": None}, measure, KEY)
    assert again.cached and again.backend == "ggml" and len(calls) == 2


def test_a_probe_that_fails_leaves_the_other_backend_said_why(cache, monkeypatch):
    monkeypatch.setattr(backend, "machine_load", lambda: 0.2)

    def measure(name):
        if name == "torch":
            raise RuntimeError("timing the torch backend took over 120 s")
        return FAST
    got = choose("auto", {"ggml": None, "torch": None}, measure, KEY)
    assert got.backend == "ggml"
    assert got.describe() == "ggml (auto: timing torch failed: timing the torch backend took over 120 s)"

    def broken(name):
        raise RuntimeError("no %s here" % name)
    with pytest.raises(RuntimeError, match="measuring the backends failed: ggml: no ggml here; torch: no torch here"):
        choose("auto", {"ggml": None, "torch": None}, broken, dict(KEY, threads=3))


def test_auto_keeps_a_gguf_torch_would_re_round_on_ggml(cache):
    """A Q4_K_M GGUF (Gemma 3's): torch would re-round its K-quant matrices; auto computes it on
    ggml without measuring, and says why. Q4_1 and Q8_0 are exact on both: measured."""
    from conftest import tiny_config
    from mdi.model.backend_select import select_backend
    from mdi.model.ggml import lib
    if lib.unavailable_reason() is not None:
        pytest.skip(lib.unavailable_reason())
    config = tiny_config("llama")
    types = {"blk.0.attn_q.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K", "blk.0.attn_k.weight": "Q8_0",
             "blk.0.attn_norm.weight": "F32"}
    got = select_backend("auto", config, 0, 1, types, "cpu", 1, 1)
    assert got.backend == "ggml" and got.seconds == 0.0
    assert got.describe() == ("ggml (auto: torch cannot: it would re-round the GGUF's Q4_K, Q6_K "
                              "(ggml computes them as stored))")
    assert select_backend("torch", config, 0, 1, types, "cpu", 1, 1).backend == "torch"  # asked: as asked


def test_auto_times_the_prefill_pass_the_run_makes(cache, monkeypatch):
    """auto's prefill pass is the run's own (runtime.prefill_chunk, up to the 256-token prompt it
    weighs) where the pass's length decides the product (prefill_weights dequantized), and at
    least 128 tokens where a token costs about the same in any pass (as stored): default runs
    time and remember what they did before. Each length is remembered apart."""
    from conftest import tiny_config
    from mdi.model import backend_select
    from mdi.model.ggml import lib
    if lib.unavailable_reason() is not None:
        pytest.skip(lib.unavailable_reason())
    monkeypatch.setattr(backend, "machine_load", lambda: 0.2)
    timed = []

    def probe(req):
        timed.append((req.backend, req.prefill_tokens))
        return BackendTiming(0.001 if req.backend == "ggml" else 0.002, 0.0002, req.rows, req.prefill_tokens)
    monkeypatch.setattr(backend_select, "run_probe", probe)
    config = tiny_config("llama")
    types = {"blk.0.attn_q.weight": "Q4_1", "blk.0.attn_norm.weight": "F32"}

    def passes(chunk, weights="quantized"):
        del timed[:]
        choice = backend_select.select_backend("auto", config, 0, 1, types, "cpu", 1, 1, prefill_weights=weights,
                                               prefill_chunk=chunk)
        return sorted(set(n for _, n in timed)), choice
    assert passes(None)[0] == [128]
    assert passes(64)[0] == []  # the same key as before the setting: recalled
    assert passes(500)[0] == [256]
    assert passes(512)[0] == []  # both time 256 tokens: one key
    got, choice = passes(64, "dequantized")
    assert got == [64] and "in 64-token passes" in choice.describe()
    assert passes(32, "dequantized")[0] == [32]
    # runtime.repack: false is timed as the run computes (its weights had been timed repacked, and
    # Q4_0's decode is 1.6x slower without), and remembered apart; true keeps the keys from before it
    flags = []
    monkeypatch.setattr(backend_select, "run_probe", lambda req: flags.append(req.repack) or probe(req))
    for repack, want in ((False, [False, False]), (False, []), (True, [])):
        del flags[:]
        backend_select.select_backend("auto", config, 0, 1, types, "cpu", 1, 1, repack=repack)
        assert flags == want, (repack, flags)
    # model.compute_dtype: torch is timed computing in it (float32 over bfloat16 weights is
    # another speed), and remembered apart; none keeps the keys from before it
    asked = []
    monkeypatch.setattr(backend_select, "run_probe", lambda req: asked.append(req.compute_dtype) or probe(req))
    for compute, want in ((None, [None, None]), ("float32", ["float32", "float32"]), ("float32", []), (None, [])):
        del asked[:]
        backend_select.select_backend("auto", config, 0, 1, types, "cpu", 1, 1, dtype="bfloat16",
                                      compute_dtype=compute)
        assert asked == want, (compute, asked)


def test_the_backend_request_says_the_prefill_chunk_only_where_it_changes_what_is_timed():
    from conftest import tiny_config
    from mdi.ring.backend_request import BackendRequest, validate_backend
    from mdi.ring.init_request import RequestError
    config = tiny_config("llama")

    def body(**kw):
        return BackendRequest(config, [0, 1], "auto", "cpu", "float32", **kw).to_json()
    assert "prefill_chunk" not in body(prefill_chunk=64)  # a worker from before it takes a default run's body
    assert "prefill_chunk" not in body()
    assert body(prefill_chunk=512)["prefill_chunk"] == 512
    assert validate_backend(body(prefill_chunk=32, prefill_weights="dequantized")).prefill_chunk == 32
    assert validate_backend(body(prefill_chunk=64)).prefill_chunk is None
    # a config may name any chunk; no pass is longer than a forward's rows, so a worker takes it
    assert validate_backend(body(prefill_chunk=5_000_000)).prefill_chunk == body(prefill_chunk=1 << 16)["prefill_chunk"]
    for bad in (0, "64", 1.5, True):
        with pytest.raises(RequestError, match="prefill_chunk must be an integer"):
            validate_backend(dict(body(), prefill_chunk=bad))
    assert "repack" not in body() and body(repack=False)["repack"] is False  # (likewise)
    assert validate_backend(body(repack=False)).repack is False and validate_backend(body()).repack is True
    with pytest.raises(RequestError, match="repack must be true or false"):
        validate_backend(dict(body(), repack="no"))
    assert "compute_dtype" not in body() and validate_backend(body(compute_dtype="float32")).compute_dtype == "float32"
    with pytest.raises(RequestError, match="compute_dtype"):
        validate_backend(dict(body(), compute_dtype="float8"))


def test_auto_takes_torch_without_timing_ggml_where_a_q8_0_cache_cannot_hold_the_heads(cache, monkeypatch):
    """kv_type q8_0 needs whole 32-value blocks per head: auto says so and takes torch, and
    ggml asked for by name is one line naming the setting, neither after a failed measurement."""
    from conftest import tiny_config
    from mdi.model import backend_select
    timed = []
    monkeypatch.setattr(backend_select, "run_probe", lambda req: timed.append(req.backend))
    config = tiny_config("llama")
    assert config.head_dim % 32, "the tiny model's heads must be partial q8_0 blocks for this test"
    types = {"blk.0.attn_q.weight": "Q4_1", "blk.0.attn_norm.weight": "F32"}
    got = backend_select.select_backend("auto", config, 0, 1, types, "cpu", 1, 1, kv_type="q8_0")
    assert got.backend == "torch" and timed == []
    assert "ggml cannot: kv_type q8_0 needs head_dim" in got.describe()
    with pytest.raises(ValueError, match="backend ggml cannot run here: kv_type q8_0 needs head_dim"):
        backend_select.select_backend("ggml", config, 0, 1, types, "cpu", 1, 1, kv_type="q8_0")


@pytest.mark.parametrize("entry", [None, [1, 2], "torch", 3])
def test_a_cache_entry_of_another_shape_is_measured_again_never_a_traceback(cache, monkeypatch, entry):
    """A per-machine cache file whose entry is valid JSON of another shape (a hand edit, a
    truncated rewrite by another program) had crashed every later start."""
    import json
    import os
    from mdi.system.machine_cache import MachineCache
    monkeypatch.setattr(backend, "machine_load", lambda: 0.2)
    measure, calls = measuring({"ggml": SLOW, "torch": FAST})
    choose("auto", {"ggml": None, "torch": None}, measure, KEY)
    for path in [p for p in os.listdir(str(cache)) if p.endswith(".json")]:
        with open(os.path.join(str(cache), path)) as f:
            data = json.load(f)
        data["entries"] = {name: entry for name in data["entries"]}
        with open(os.path.join(str(cache), path), "w") as f:
            json.dump(data, f)
    again = choose("auto", {"ggml": None, "torch": None}, measure, KEY)
    assert again.backend == "torch" and not again.cached and len(calls) == 4
    machines = MachineCache("test.json", 1)
    machines.write({"x": entry})
    assert machines.recall("k") is None
    machines.remember("k", 5, 5.0)
    assert machines.recall("k") == 5


def test_a_damaged_cache_file_is_said_once_and_measured_again(cache, caplog):
    import logging
    from mdi.system.machine_cache import MachineCache
    machines = MachineCache("damaged.json", 1)
    machines.remember("k", 5, 5.0)
    with open(machines.path, "r+") as f:  # a disk that filled as it was written, a hand edit
        f.truncate(len(f.read()) // 2)
    with caplog.at_level(logging.WARNING, logger="mdi.system.machine_cache"):
        assert machines.recall("k") is None and machines.recall("k") is None
    said = [r.getMessage() for r in caplog.records if "damaged.json" in r.getMessage()]
    assert len(said) == 1 and "measured again" in said[0], said
    machines.remember("k", 6, 5.0)  # written anew, whole
    assert machines.recall("k") == 6


@pytest.mark.parametrize("entry", [[["BF16"], 32], ["BF16", "32"], [{"a": 1}, 2], "F16"])
def test_a_hand_edited_prefill_rule_is_measured_again_never_a_traceback(cache, entry):
    from mdi.model.ggml import dequant_rows
    dequant_rows.CACHE.remember("key", entry, 5.0)
    assert dequant_rows._recall("key") is None
    dequant_rows.CACHE.remember("key", ["F16", 64], 5.0)
    assert dequant_rows._recall("key") == dequant_rows.DequantRule(dequant_rows.lib.TYPE_IDS["F16"], 64)


def test_a_wait_for_another_process_s_measurement_is_said(cache, caplog):
    """A second starter on the machine waited 7 s for the first one's measurement, silent."""
    import fcntl
    import logging
    import threading
    from mdi.system.machine_cache import MachineCache
    machines = MachineCache("held.json", 1)
    machines.remember("k", 1, 5.0)  # the folder and the lock file exist
    with open(machines.path + ".lock", "w") as held:  # another process's hold, as flock sees one
        fcntl.flock(held, fcntl.LOCK_EX)
        threading.Timer(0.3, lambda: fcntl.flock(held, fcntl.LOCK_UN)).start()
        with caplog.at_level(logging.INFO, logger="mdi.system.machine_cache"):
            machines.remember("k", 2, 60.0)
    assert machines.recall("k") == 2
    assert any("waiting for another process" in r.getMessage() and "held.json" in r.getMessage()
               for r in caplog.records), caplog.records


def test_a_remembered_choice_needs_no_lock_and_a_lock_held_too_long_is_measured_beside(cache, monkeypatch, caplog):
    """A start whose answer was remembered waited up to MEASURE_WAIT_S for another process
    measuring another model, and failed where that process was stopped (Ctrl-Z) and held it."""
    import fcntl
    import logging
    monkeypatch.setattr(backend, "machine_load", lambda: 0.2)
    measure, calls = measuring({"ggml": FAST, "torch": SLOW})
    assert choose("auto", {"ggml": None, "torch": None}, measure, KEY).backend == "ggml" and len(calls) == 2
    monkeypatch.setattr(backend, "MEASURE_WAIT_S", 0.2)
    with open(backend.CACHE.path + ".lock", "w") as held:  # another process's hold, as flock sees one
        fcntl.flock(held, fcntl.LOCK_EX)
        again = choose("auto", {"ggml": None, "torch": None}, measure, KEY)
        assert again.cached and len(calls) == 2  # recalled at once
        with caplog.at_level(logging.WARNING, logger="mdi"):
            other = choose("auto", {"ggml": None, "torch": None}, measure, dict(KEY, threads=2))
    assert not other.cached and len(calls) == 4  # measured beside the holder, not a failure
    assert any("measuring beside it" in r.getMessage() for r in caplog.records), caplog.records


def test_a_cache_that_cannot_be_written_is_said_once_and_leaves_nothing_behind(cache, monkeypatch, caplog):
    """A read-only cache folder (or a folder where the file should be) made every start measure
    again with a debug line only, and each start left a backends.json.<pid>.tmp behind."""
    import logging
    import os
    monkeypatch.setattr(backend, "machine_load", lambda: 0.2)
    os.makedirs(backend.CACHE.path)  # where backends.json should be
    measure, calls = measuring({"ggml": FAST, "torch": SLOW})
    with caplog.at_level(logging.WARNING, logger="mdi"):
        for _ in range(2):
            assert not choose("auto", {"ggml": None, "torch": None}, measure, KEY).cached
    said = [r.getMessage() for r in caplog.records if "cannot keep measurements" in r.getMessage()]
    assert len(said) == 1 and backend.CACHE.path in said[0] and "$MDI_PROFILE_CACHE" in said[0], caplog.records
    assert sorted(os.listdir(str(cache))) == ["backends.json", "backends.json.lock"], os.listdir(str(cache))


def test_another_build_of_the_binding_is_another_machine(tmp_path, monkeypatch):
    """One ggml-python version rebuilt for another ISA (an AVX2 build beside AVX-512, ggml-cuda)
    had kept the choices the other build measured: the libraries' sizes and times are keyed."""
    import importlib.util
    from types import SimpleNamespace
    from mdi.system.machine_cache import machine_key
    lib = tmp_path / "ggml" / "lib"
    lib.mkdir(parents=True)
    (lib / "libggml-cpu.so").write_bytes(b"x" * 10)
    binding = SimpleNamespace(origin=str(tmp_path / "ggml" / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: binding)
    first = machine_key()
    assert first["ggml_build"] and machine_key() == first
    (lib / "libggml-cpu.so").write_bytes(b"y" * 12)  # rebuilt
    assert machine_key()["ggml_build"] != first["ggml_build"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no binding: the keys from before
    assert "ggml_build" not in machine_key()


def test_a_linked_cache_file_keeps_its_link(cache, tmp_path):
    """A cache file linked elsewhere (a shared folder) had been replaced by a plain file."""
    from mdi.system.machine_cache import MachineCache, cache_dir
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    link = os.path.join(cache_dir(), "linked.json")
    os.makedirs(cache_dir(), exist_ok=True)
    os.symlink(str(target), link)
    MachineCache("linked.json", 1).remember("k", {"v": 1})
    assert os.path.islink(link) and MachineCache("linked.json", 1).recall("k") == {"v": 1}
