"""The run YAML's nodes: a node's spec (where it listens, its layers, its own device, weights,
quant or backend), each node checked, the list checked (names, addresses and data ports once
each), and the layers split over the nodes."""
from dataclasses import dataclass
from typing import Any, Final, List, Optional

from mdi.model.backend import BACKENDS
from mdi.model.layout import balanced, quant_mode_problem
from mdi.runconfig.checks import ConfigError, IntOrAuto, check_keys

DEFAULT_HTTP_PORT = 8080
AUTO_LAYERS: Final = "auto"  # nodes[].layers: split by the planner (mdi.starter.planning.planner) from measured speeds
DATA_PORT_OFFSET = 1000  # a node's data-plane port defaults to its HTTP port + this


@dataclass
class NodeSpec:
    name: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT
    layers: Optional[IntOrAuto] = None  # a count; None: share the layers evenly ("balanced"); "auto": the planner splits them
    data_port: Optional[int] = None
    device: Optional[str] = None  # overrides model.device for this node
    weights: Optional[str] = None  # path on the node's own disk (pre-cut chunk or model dir)
    quant: Optional[str] = None  # overrides model.quant for this node's layers
    backend: Optional[str] = None  # overrides runtime.backend for this node (a ring may mix them)

    @property
    def address(self) -> str:
        return "%s:%d" % (self.host, self.port)

    @property
    def ring_port(self) -> int:
        return self.data_port if self.data_port is not None else self.port + DATA_PORT_OFFSET


def parse_node(where: str, raw: Any, default_name: str) -> NodeSpec:
    n = check_keys(where, raw, {"name": (str,), "host": (str,), "port": (int,), "layers": (int, str),
                                 "data_port": (int,), "device": (str,), "weights": (str,), "quant": (str,),
                                 "backend": (str,)})
    n.setdefault("name", default_name)
    node = NodeSpec(**n)
    for key in ("port", "data_port"):
        value = getattr(node, key)
        if value is not None and not 0 < value < 65536:
            raise ConfigError("%s.%s: expected a TCP port 1-65535, got %d" % (where, key, value))
    if isinstance(node.layers, str) and node.layers != AUTO_LAYERS:
        raise ConfigError("%s.layers: expected a positive integer or auto (the planner splits the layers by "
                          "measured speed, mdi-plan), got %r" % (where, node.layers))
    if isinstance(node.layers, int) and node.layers < 1:
        raise ConfigError("%s.layers: expected a positive integer, got %d" % (where, node.layers))
    if node.device is not None:
        check_device(where + ".device", node.device)
    if node.backend is not None and node.backend not in BACKENDS:
        raise ConfigError("%s.backend: expected one of %s, got %r" % (where, ", ".join(BACKENDS), node.backend))
    problem = quant_mode_problem(node.quant) if node.quant is not None else None
    if problem is not None:
        raise ConfigError("%s.quant: %s" % (where, problem))
    return node


def is_device_name(device: str) -> bool:
    return device in ("cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())


def runtime_device(source: str, model_device: Optional[str], device: str) -> str:
    """runtime.device: the run's device spelt where the other run-wide settings are; it is
    model.device's value (its one home), so naming both differently is an error."""
    check_device("%s: runtime.device" % source, device)
    if model_device is not None and _canonical(model_device) != _canonical(device):
        raise ConfigError("%s: runtime.device %r and model.device %r differ: name the run's device once"
                          % (source, device, model_device))
    return device


def _canonical(device: str) -> str:
    return "cuda:0" if device == "cuda" else device  # (torch's and ggml's "cuda" is the first GPU)


def check_device(where: str, device: str) -> None:
    if not is_device_name(device):
        raise ConfigError("%s: expected cpu, cuda or cuda:N, got %r" % (where, device))


def check_nodes(source: str, nodes: List[NodeSpec], spares: List[NodeSpec]) -> None:
    names, addresses, data = set(), set(), set()
    listed = [("nodes[%d]" % i, n) for i, n in enumerate(nodes)] + [("spares[%d]" % i, n) for i, n in enumerate(spares)]
    for i, (label, node) in enumerate(listed):
        where = "%s: %s" % (source, label)
        if node.name in names:
            raise ConfigError("%s.name: node %r is listed twice" % (where, node.name))
        if i > 0 and node.address in addresses:
            raise ConfigError("%s: address %s is listed twice" % (where, node.address))
        if i > 0 and (node.host, node.ring_port) in data:
            raise ConfigError("%s: data port %d on %s is used twice" % (where, node.ring_port, node.host))
        names.add(node.name)
        addresses.add(node.address)
        data.add((node.host, node.ring_port))
    # A worker's HTTP port and any node's data port are both bound on their host: one port, one use
    http = {(n.host, n.port): label for i, (label, n) in enumerate(listed) if i > 0}
    for label, node in listed:
        other = http.get((node.host, node.ring_port))
        if other is not None:
            raise ConfigError("%s: %s: data port %d on %s is also %s's HTTP port" % (source, label, node.ring_port,
                                                                                    node.host, other))
    given = [n.layers is not None for n in nodes]
    if any(given) and not all(given):
        raise ConfigError("%s: nodes: give 'layers' for every node or for none (balanced split)" % source)
    auto = [n.layers == AUTO_LAYERS for n in nodes]
    if any(auto) and not all(auto):
        raise ConfigError("%s: nodes: layers: auto goes on every node (the planner splits all the layers) or on none"
                          % source)


def partition(n_layer: int, nodes: List[NodeSpec], source: str = "config") -> List[int]:
    """Layer counts per node: as given (must sum to the model's layers) or balanced."""
    if nodes[0].layers == AUTO_LAYERS:
        raise ConfigError("%s: layers: auto must be planned first (mdi.starter.planning.run_plan.plan_run)" % source)
    if nodes[0].layers is None:
        if len(nodes) > n_layer:
            raise ConfigError("%s: %d nodes but the model has only %d layers" % (source, len(nodes), n_layer))
        return balanced(n_layer, len(nodes))
    # check_nodes let through only all counts, all None or all auto: here, all counts
    counts = [n.layers for n in nodes if isinstance(n.layers, int)]
    if len(counts) != len(nodes):
        raise ConfigError("%s: nodes: give 'layers' as a count for every node or for none" % source)
    if sum(counts) != n_layer:
        raise ConfigError("%s: nodes.layers: %s sums to %d, but the model has %d layers"
                          % (source, "+".join(map(str, counts)), sum(counts), n_layer))
    return counts
