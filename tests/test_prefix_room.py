"""The prefix cache's room when nodes share one memory: an "auto" budget is half of what a
node's memory spares, and several processes on one machine each counted the machine's spare
memory as their own (a ring of 3 processes on a 23.5 GB box gave itself 36 GB and grew without
evicting). Nodes that draw on one memory (mdi.system.memory.memory_pool) share it."""
import json
import os
import subprocess

from conftest import BIN
from ringconfigs import write_run_config
from mdi.model.prefix_store import NodePrefixRoom, budget_positions
from mdi.system.memory import memory_pool


def test_nodes_on_one_memory_share_an_auto_budget_and_others_keep_their_own():
    a, b, c = NodePrefixRoom(1000, 10, "m1"), NodePrefixRoom(900, 20, "m1"), NodePrefixRoom(600, 10, "m2")
    assert budget_positions([a, b, c], auto=True) == min(900 // 30, 600 // 10) == 30
    assert budget_positions([a, b, c], auto=False) == min(100, 45, 60) == 45  # sizes the user gave, per node
    unknown = [NodePrefixRoom(1000, 10, None), NodePrefixRoom(1000, 10, None)]
    assert budget_positions(unknown, auto=True) == 100  # nothing says they share
    assert budget_positions([a, NodePrefixRoom(1000, 0, "m3")], auto=True) == 0  # a node that keeps none
    assert budget_positions([], auto=True) == 0


def test_a_memory_pool_is_this_boot_of_this_machine(tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text("1b4e28ba-2fa1-11d2-883f-0016d3cca427\n")
    pool = memory_pool(str(boot))
    assert pool == memory_pool(str(boot)) and len(pool) <= 64
    boot.write_text("6fa459ea-ee8a-3ca4-894e-db77e160355e\n")
    assert memory_pool(str(boot)) != pool
    assert memory_pool(str(tmp_path / "none")) is None
    assert memory_pool() == memory_pool()  # the same for one process, whatever it asks


def _token_budget(config, tmp_path, name):
    out = tmp_path / (name + ".json")
    proc = subprocess.run([os.path.join(BIN, "mdi-start"), "--config", config, "--prompt", "Hello", "--n-tokens", "2",
                           "--metrics-out", str(out), "--threads", "1"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())["nodes"][0]["prefix_cache"]["token_budget"]


def test_a_ring_on_one_machine_holds_what_one_process_would(tiny_models, workers, tmp_path):
    """A ring of 3 processes here keeps about the positions one process holding the whole model
    keeps (each node's bytes per position are its layers' share); before, the tightest node's
    own budget over its own share: twice that with layers 1, 1, 2 of 4."""
    model = tiny_models["llama"]
    alone = _token_budget(write_run_config(tmp_path / "one.yaml", model, runtime={"prefix_cache": "auto"}),
                          tmp_path, "one")
    ring = _token_budget(write_run_config(tmp_path / "ring.yaml", model, workers[:2], layers=[1, 1, 2],
                                          runtime={"prefix_cache": "auto"}), tmp_path, "ring")
    assert alone > 0 and 0.5 * alone < ring < 1.3 * alone, (ring, alone)
