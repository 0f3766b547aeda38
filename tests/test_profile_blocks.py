"""How many random blocks a node times, and why: two small blocks stay in the last-level cache
and time faster than a node holding real layers runs them, so a profile spans twice that
cache (one subprocess, for a fresh process's import order; the worker's /profile is covered in
test_autoplan)."""
import os

import pytest

import mdi.model.profile_size as profile
from mdi.model.config import ModelConfig
from mdi.model.layout import QuantSpec, weight_bytes
from mdi.ring.profile_request import ProfileReply, ProfileRequest
from mdi.timing.node import profile_here
from mdi.system.devices import DEFAULT_CACHE_BYTES, last_level_cache_bytes

CONFIG = ModelConfig.from_dict(dict(name="t", family="llama", vocab_size=64, n_layer=12, n_embd=64, n_head=4,
                                    n_kv_head=2, intermediate_size=128, block_size=64))


def block_bytes(quant=None):
    return weight_bytes(CONFIG, (0, 2), "float32", quant=quant) // 2


def fake_sysfs(tmp_path, sizes):
    for i, size in enumerate(sizes):
        (tmp_path / ("index%d" % i)).mkdir()
        (tmp_path / ("index%d" % i) / "size").write_text(size + "\n")
    return str(tmp_path)


def test_the_last_level_cache_is_the_largest_the_cpu_reports(tmp_path):
    assert last_level_cache_bytes("cpu", fake_sysfs(tmp_path, ["48K", "32K", "2048K", "32M"])) == 32 * 1024 ** 2
    assert last_level_cache_bytes("cpu", str(tmp_path / "none")) == DEFAULT_CACHE_BYTES


@pytest.mark.parametrize("cache_blocks, expected", [(3, 6), (4.5, 9), (0.1, 2), (100, 12)])
def test_enough_blocks_to_span_twice_the_cache_within_the_model(monkeypatch, cache_blocks, expected):
    monkeypatch.setattr(profile, "last_level_cache_bytes", lambda device: int(cache_blocks * block_bytes()))
    assert profile.profile_blocks(CONFIG, "float32", None, "cpu") == expected


def test_quantized_blocks_are_smaller_so_more_of_them_are_timed(monkeypatch):
    monkeypatch.setattr(profile, "last_level_cache_bytes", lambda device: 2 * block_bytes())
    quant = {"blocks.%d.%s" % (j, name): QuantSpec("int4", 32)
             for j in range(2) for name in ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down")}
    plain = profile.profile_blocks(CONFIG, "float32", None, "cpu")
    assert plain == 4 and profile.profile_blocks(CONFIG, "float32", quant, "cpu") > plain


def test_the_two_blocks_quant_layout_repeats_over_every_timed_block():
    a, b, ends = QuantSpec("int4", 32), QuantSpec("int8", 64), QuantSpec("int8", 32)
    layout = profile.repeated_layout({"blocks.0.attn.qkv": a, "blocks.1.attn.qkv": b, "head": ends}, 5)
    assert layout == {"blocks.0.attn.qkv": a, "blocks.2.attn.qkv": a, "blocks.4.attn.qkv": a,
                      "blocks.1.attn.qkv": b, "blocks.3.attn.qkv": b, "head": ends}
    assert profile.repeated_layout(None, 4) == {}


def test_a_profile_reports_the_blocks_it_timed_and_the_reply_checks_them():
    request = ProfileRequest(CONFIG, "float32", "cpu", [1, 2], 8, 4, threads=1)
    reply = profile_here(request, "cpu", n_blocks=3)
    assert reply.blocks == 3 and sorted(reply.layer_s) == [1, 2] and sorted(reply.loop_s) == [1, 2]
    data = reply.to_json()
    assert ProfileReply.from_json(data).blocks == 3
    old = {k: v for k, v in data.items() if k != "blocks"}  # a worker from before: two blocks
    assert ProfileReply.from_json(old).blocks == profile.PROFILE_LAYERS
    for bad in (0, -1, True, "3", 10 ** 6):
        with pytest.raises(ValueError) as e:
            ProfileReply.from_json(dict(data, blocks=bad))
        assert "blocks" in str(e.value)


def test_rows_timed_cover_every_ring_size_the_planner_weighs():
    from mdi.starter.planning.node_speeds import batch_sizes
    # 6 samples over 3 nodes travel as 3 x 2 rows, over 2 as 2 x 3, over 1 as one pass of 6.
    assert batch_sizes(6, 3) == [1, 2, 3, 6]
    assert batch_sizes(12, 3, max_batch=4) == [1, 2, 4]  # runtime.max_batch caps a group
    assert batch_sizes(1, 1) == [1, 2]
    many = batch_sizes(40, 10)  # at most MAX_BATCH_SIZES: the smallest rings' groups go first
    assert len(many) == 8 and many[:3] == [1, 2, 4] and 40 not in many


def test_a_node_short_of_memory_times_fewer_blocks_but_never_fewer_than_two(monkeypatch):
    monkeypatch.setattr(profile, "last_level_cache_bytes", lambda device: 8 * block_bytes())
    assert profile.profile_blocks(CONFIG, "float32", None, "cpu") == 12
    five = profile.profile_bytes(CONFIG, 5, "float32", None, rows=3, positions=16)
    assert five > 5 * block_bytes()  # the KV cache counts too
    assert profile.profile_blocks(CONFIG, "float32", None, "cpu", five, rows=3, positions=16) == 5
    assert profile.profile_blocks(CONFIG, "float32", None, "cpu", five - 1, rows=3, positions=16) == 4
    assert profile.profile_blocks(CONFIG, "float32", None, "cpu", 0, rows=3, positions=16) == 2


def test_a_profile_runs_at_the_runs_threads_where_ggml_loaded_openmp_first():
    """mdi-plan and mdi-start load ggml (and its OpenMP) before the config's threads are known:
    OMP_NUM_THREADS set then came too late, and the starter's torch profile ran at every CPU
    while its run used runtime.threads (a plan from a profile 2x too parallel)."""
    import subprocess
    import sys
    from mdi.model.threads import usable_cpus
    if usable_cpus() < 2:
        pytest.skip("one CPU: every thread count is 1")
    script = "\n".join([
        "import os; os.environ.pop('OMP_NUM_THREADS', None)",
        "import mdi.starter.control  # ggml first, as mdi-plan imports it",
        "from mdi.cli.process import setup_process; setup_process(threads=1)",
        "from test_profile_blocks import CONFIG",
        "from mdi.ring.profile_request import ProfileRequest",
        "from mdi.timing.node import profile_here",
        "print(profile_here(ProfileRequest(CONFIG, 'float32', 'cpu', [1], 8, 4, threads=1), 'cpu', n_blocks=2).threads)"])
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", script], cwd=here, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1", out.stdout
