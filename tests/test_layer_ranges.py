"""One layer-range convention: a node's layers are the half-open range [first, last) wherever
they appear. Data holds the pair [first, last] (a worker's /status, the metrics record, the
dashboard's JSON); text shows it through mdi.model.layout.layer_span / format_layers."""
import json

import pytest
import requests

from conftest import free_ports
from ringconfigs import parse_run_config
from mdi.model.layout import format_layers, layer_ranges, layer_span
from mdi.runconfig import NodeSpec
from mdi.serving.dashboard import STATE_PATH, BatchDashboard, BatchMonitor
from mdi.starter import batch
from mdi.starter.planning.planner import LayerPlan, PlanRow, format_plan
from mdi.starter.planning.recovery import RecoveryImpossible, plan_recovery

COUNTS = [1, 2, 1]  # the tiny model's 4 blocks: starter, w1, w2


# --------------------------------------------------------------------------- the display helper

def test_layer_span_shows_the_half_open_pair():
    assert layer_span(0, 10) == "[0, 10)"
    assert layer_span(3, 4) == "[3, 4)"  # one block: no "3-3"
    assert format_layers(10, 20) == "layers [10, 20)"
    # Built from the same pairs layer_ranges cuts, the texts join up end to start.
    assert [layer_span(*r) for r in layer_ranges([10, 10, 10])] == ["[0, 10)", "[10, 20)", "[20, 30)"]


def _ring():
    return [NodeSpec("starter"), NodeSpec("board1", port=8081), NodeSpec("board2", port=8082)]


def test_recovery_messages_show_the_range_the_node_held():
    ranges = [[0, 10], [10, 20], [20, 30]]
    spare = NodeSpec("spare1", port=8083)
    taken = plan_recovery(_ring(), ranges, "board1", [spare], lambda i, node, layers: True)
    assert format_layers(10, 20) in taken.how and "spare1" in taken.how
    merged = plan_recovery(_ring(), ranges, "board1", [], lambda i, node, layers: True)
    assert format_layers(10, 20) in merged.how
    try:
        plan_recovery(_ring(), ranges, "board2", [], lambda i, node, layers: False)
    except RecoveryImpossible as e:
        assert format_layers(20, 30) in str(e)
    else:
        raise AssertionError("the neighbour cannot hold board2's layers: no plan expected")


def test_recovery_takes_the_first_spare_that_can_hold_the_layers():
    """A spare too small for the lost node's layers is passed over (h96: it was taken, refused
    them at /init, and the run that its neighbours could have carried on failed): the next
    spare that fits takes them, else the neighbours share them, else one line names both."""
    ranges = [[0, 10], [10, 20], [20, 30]]
    small, big = NodeSpec("small", port=8083), NodeSpec("big", port=8084)
    asked = []

    def fits(i, node, layers):
        asked.append((i, node.name, list(layers)))
        return node.name != "small"
    taken = plan_recovery(_ring(), ranges, "board2", [small, big], fits)
    assert taken.spare is big and [n.name for n in taken.nodes] == ["starter", "board1", "big"]
    assert asked == [(2, "small", [20, 30]), (2, "big", [20, 30])]
    merged = plan_recovery(_ring(), ranges, "board2", [small], fits)
    assert merged.spare is None and merged.ranges == [[0, 10], [10, 30]]
    with pytest.raises(RecoveryImpossible, match=r"spare small cannot hold them and board2's neighbours cannot "
                                                 r"hold its layers \[20, 30\)"):
        plan_recovery(_ring(), ranges, "board2", [small], lambda i, node, layers: False)


def test_the_plan_table_shows_each_node_range():
    rows = [PlanRow("starter", [0, 16], 33.5, 2 ** 20, 2 ** 30), PlanRow("node1", [16, 30], 30.0, 2 ** 20, None),
            PlanRow("slow", None, 0.0, 0, None, "left out")]
    table = format_plan(LayerPlan([16, 14, 0], rows, 3, 1, 33.5, 63.5, 2, {1: 10.0}))
    lines = table.splitlines()
    # Each row: the range, then its count of blocks (last - first).
    assert "%s (16)" % layer_span(0, 16) in lines[1] and "%s (14)" % layer_span(16, 30) in lines[2]


# --------------------------------------------------------------------------- one ring, three views

def test_status_metrics_and_dashboard_show_the_same_ranges(tiny_models, workers):
    """A real ring on loopback watched by a batch dashboard: while it generates, every worker's
    GET /status and the dashboard's JSON are read; after it, the metrics record. All three must
    give each node the same pair."""
    ports = free_ports(4)
    cfg = parse_run_config(tiny_models["llama"], workers[:len(COUNTS) - 1], layers=COUNTS, data_ports=ports[:3],
                           n_tokens=4, runtime={"ring_timeout": 20})
    monitor = BatchMonitor(cfg, 1, cfg.generation.n_tokens)
    dashboard = BatchDashboard(cfg, monitor, "tiny", "127.0.0.1", ports[3])
    seen = {}

    def on_token(sample, token):
        monitor.on_token(sample, token)
        if not seen:  # once, mid-run: every node holds its layers and the dashboard watches them
            seen["status"] = {node.name: requests.get("http://%s/status" % node.address, timeout=10).json()["layers"]
                              for node in cfg.nodes[1:]}
            seen["dashboard"] = requests.get(dashboard.url.rstrip("/") + STATE_PATH, timeout=10).json()

    try:
        result = batch.run(cfg, ["Hello"], on_token=on_token, on_engine=monitor.attach)
    finally:
        dashboard.close()
    record = json.loads(json.dumps(result.metrics()))  # what --metrics-out writes
    in_record = {n["name"]: n["layers"] for n in record["nodes"]}
    on_dashboard = {n["name"]: n["layers"] for n in seen["dashboard"]["nodes"] if n["role"] in ("starter", "worker")}
    planned = dict(zip(["starter", "w1", "w2"], layer_ranges(COUNTS)))

    assert in_record == on_dashboard == planned
    for name, layers in seen["status"].items():
        assert layers == in_record[name] == on_dashboard[name], name
